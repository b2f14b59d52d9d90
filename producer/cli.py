"""`qbatch`: submit requests, read results, run bulk jobs (see producer/README.md).

Exit codes (every command):
  0  success (for result-bearing commands: every line/request succeeded)
  1  some requests/lines did not succeed (failed, expired, cancelled), or a dry run
     found bad lines
  2  usage error or invalid input (bad flag, bad JSON body, mixed-format file)
  3  not finished in time (`--timeout` ran out; partial output is still written)
  4  unavailable: Kafka or Redis unreachable, unknown job, conflicting job state
  130 interrupted (Ctrl-C); re-run the same command to resume
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import redis
import typer
from kafka.errors import KafkaError
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from producer.bulk import Defaults, JobView, check_job_id
from producer.client import PublishError, QBatchClient
from producer.jobs import (
    DEFAULT_CHUNK,
    DEFAULT_JOB_TTL_S,
    INPUT_PATH_FIELD,
    CollectReport,
    JobError,
    JobStore,
    collect_job,
    file_sha256,
    retry_job,
    scan_file,
    submit_job,
)
from schemas import ConnectionSettings, ContractError, ResultEnvelope, Status

EXIT_OK = 0
EXIT_NOT_ALL_SUCCEEDED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_UNAVAILABLE = 4
EXIT_INTERRUPTED = 130

app = typer.Typer(
    name="qbatch",
    help="Submit LLM requests to qbatch (Kafka in, Redis out) and run bulk jobs.",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
bulk_app = typer.Typer(
    help="Bulk jobs: a JSONL file in (OpenAI Batch or native envelopes), a JSONL file out.",
    no_args_is_help=True,
)
app.add_typer(bulk_app, name="bulk")

err = Console(stderr=True)
out = Console(highlight=False, soft_wrap=True)


@dataclass
class Options:
    bootstrap: str | None = None
    redis_url: str | None = None
    topic: str | None = None
    prefix: str | None = None
    quiet: bool = False
    json: bool = False


def _opts(ctx: typer.Context) -> Options:
    return ctx.obj if isinstance(ctx.obj, Options) else Options()


@app.callback()
def _global(
    ctx: typer.Context,
    bootstrap: Annotated[
        str | None,
        typer.Option("--bootstrap", help="Kafka bootstrap servers (QBATCH_KAFKA_BOOTSTRAP)."),
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option("--redis-url", help="Redis URL (QBATCH_REDIS_URL).")
    ] = None,
    topic: Annotated[
        str | None, typer.Option("--topic", help="Requests topic (QBATCH_TOPIC).")
    ] = None,
    prefix: Annotated[
        str | None, typer.Option("--prefix", help="Redis key prefix (QBATCH_PREFIX).")
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No progress bars or chatter (cron).")
    ] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print a JSON summary on stdout.")
    ] = False,
) -> None:
    """Global options override the QBATCH_* environment."""
    ctx.obj = Options(bootstrap, redis_url, topic, prefix, quiet, json_out)


def _client(o: Options) -> QBatchClient:
    try:
        return QBatchClient(
            ConnectionSettings(),
            bootstrap=o.bootstrap,
            redis_url=o.redis_url,
            topic=o.topic,
            prefix=o.prefix,
        )
    except ValueError as exc:  # pydantic ValidationError (e.g. a bad --prefix)
        err.print(f"[red]error:[/] bad settings: {exc}")
        raise typer.Exit(EXIT_USAGE) from None


@contextmanager
def _guard() -> Iterator[None]:
    """Turn the expected failures into messages and exit codes."""
    try:
        yield
    except ContractError as exc:
        err.print(f"[red]invalid request:[/] {exc.message}")
        raise typer.Exit(EXIT_USAGE) from None
    except JobError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    except (KafkaError, PublishError) as exc:
        err.print(f"[red]Kafka error:[/] {exc!r}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    except redis.exceptions.RedisError as exc:
        err.print(f"[red]Redis error:[/] {exc}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: re-run the same command to resume")
        raise typer.Exit(EXIT_INTERRUPTED) from None


@contextmanager
def _progress(o: Options, description: str, enabled: bool = True) -> Iterator[Any]:
    """A rich progress bar on stderr; yields on_progress(done, total) (a no-op when quiet)."""
    if o.quiet or not enabled:
        yield lambda done, total: None
        return
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("[cyan]{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=err,
        transient=False,
    )
    with bar:
        task = bar.add_task(description, total=None, rate="")

        def update(done: int, total: int) -> None:
            t = bar.tasks[0]
            speed = t.speed
            bar.update(
                task,
                completed=done,
                total=total,
                rate=f"{speed:,.0f}/s" if speed else "",
            )

        yield update


def _say(o: Options, message: str) -> None:
    if not o.quiet:
        err.print(message)


def _emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, default=str) + "\n")
    sys.stdout.flush()


def _parse_deadline(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        err.print(f"[red]error:[/] --deadline must be an RFC 3339 time, got {value!r}")
        raise typer.Exit(EXIT_USAGE) from None
    if parsed.tzinfo is None:
        err.print("[red]error:[/] --deadline needs a time zone (e.g. 2025-01-01T06:00:00Z)")
        raise typer.Exit(EXIT_USAGE)
    return parsed


def _parse_json_obj(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # bad JSON, a 5,000-digit integer, depth
        err.print(f"[red]error:[/] {escape(what)} is not JSON this tool reads: {escape(str(exc))}")
        raise typer.Exit(EXIT_USAGE) from None
    if not isinstance(value, dict):
        err.print(f"[red]error:[/] {what} must be a JSON object")
        raise typer.Exit(EXIT_USAGE)
    return value


def _result_exit(results: list[ResultEnvelope | None]) -> int:
    if any(r is None for r in results):
        return EXIT_TIMEOUT
    if all(r is not None and r.status is Status.succeeded for r in results):
        return EXIT_OK
    return EXIT_NOT_ALL_SUCCEEDED


# ---------------------------------------------------------------- single requests


@app.command()
def submit(
    ctx: typer.Context,
    body: Annotated[str | None, typer.Option("--body", help="Request body as JSON.")] = None,
    body_file: Annotated[
        Path | None, typer.Option("--body-file", help="Read the body from FILE ('-': stdin).")
    ] = None,
    endpoint: Annotated[
        str | None,
        typer.Option(help="/v1/chat/completions or /v1/completions (default: from the body)."),
    ] = None,
    request_id: Annotated[
        str | None, typer.Option("--request-id", help="Default: generated.")
    ] = None,
    job_id: Annotated[str | None, typer.Option("--job-id")] = None,
    custom_id: Annotated[str | None, typer.Option("--custom-id")] = None,
    priority: Annotated[int | None, typer.Option(help="Lower runs earlier (default 0).")] = None,
    deadline: Annotated[
        str | None, typer.Option(help="RFC 3339; not started by then: expired.")
    ] = None,
    result_ttl: Annotated[
        int | None, typer.Option("--result-ttl", help="Seconds (default 86400).")
    ] = None,
    metadata: Annotated[str | None, typer.Option(help="JSON object echoed in the result.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait and print the result JSON.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to --wait.")] = 60.0,
) -> None:
    """Submit one request; prints its request_id (or, with --wait, the result JSON).

    The body comes from --body, --body-file, or stdin.
    """
    o = _opts(ctx)
    if body is not None and body_file is not None:
        err.print("[red]error:[/] give --body or --body-file, not both")
        raise typer.Exit(EXIT_USAGE)
    if body is not None:
        text = body
    elif body_file is not None and str(body_file) != "-":
        text = body_file.read_text(encoding="utf-8")
    else:
        text = sys.stdin.read()
    data = _parse_json_obj(text, "the body")
    meta = _parse_json_obj(metadata, "--metadata") if metadata else None
    with _guard(), _client(o) as client:
        rid = client.submit(
            data,
            request_id=request_id,
            endpoint=endpoint,
            job_id=job_id,
            custom_id=custom_id,
            priority=priority,
            deadline=_parse_deadline(deadline),
            result_ttl_s=result_ttl,
            metadata=meta,
        )
        if not wait:
            _emit_json({"request_id": rid}) if o.json else out.print(rid)
            return
        result = client.wait(rid, timeout=timeout)
    if result is None:
        err.print(f"[yellow]timed out[/] after {timeout}s waiting for {rid}")
        raise typer.Exit(EXIT_TIMEOUT)
    sys.stdout.write(result.model_dump_json(exclude_none=True) + "\n")
    raise typer.Exit(_result_exit([result]))


@app.command()
def get(
    ctx: typer.Context, request_id: Annotated[str, typer.Argument(help="The request id.")]
) -> None:
    """Print a result's JSON if it is written (exit 3 when not yet)."""
    o = _opts(ctx)
    with _guard(), _client(o) as client:
        result = client.get(request_id)
    if result is None:
        err.print(f"no result yet for {request_id}")
        raise typer.Exit(EXIT_TIMEOUT)
    sys.stdout.write(result.model_dump_json(exclude_none=True) + "\n")
    raise typer.Exit(_result_exit([result]))


@app.command("wait")
def wait_cmd(
    ctx: typer.Context,
    request_ids: Annotated[list[str], typer.Argument(help="One or more request ids.")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for all of them.")] = 60.0,
) -> None:
    """Wait for results; prints one result JSON per line as they are all in (input order)."""
    o = _opts(ctx)
    with _guard(), _client(o) as client:
        found = client.wait_many(request_ids, timeout=timeout)
    for rid in request_ids:
        result = found.get(rid)
        if result is None:
            err.print(f"[yellow]timed out[/]: no result for {rid}")
        else:
            sys.stdout.write(result.model_dump_json(exclude_none=True) + "\n")
    raise typer.Exit(_result_exit([found.get(rid) for rid in request_ids]))


# ---------------------------------------------------------------- bulk


JobOpt = Annotated[str, typer.Option("--job", help="Job id (1-96 chars of [A-Za-z0-9_.:-]).")]


def _defaults(priority: int | None, deadline: str | None, result_ttl: int | None) -> Defaults:
    return Defaults(priority=priority, deadline=_parse_deadline(deadline), result_ttl_s=result_ttl)


def default_job_id(path: Path, sha: str) -> str:
    """`{file stem}-{sha256[:12]}`: the same file gives the same job, so a re-run resumes."""
    stem = re.sub(r"[^A-Za-z0-9_.:-]", "_", path.stem)[:60] or "job"
    return f"{stem}-{sha[:12]}"


def _check_job(job: str) -> str:
    try:
        return check_job_id(job)
    except ContractError as exc:
        err.print(f"[red]error:[/] {exc.message}")
        raise typer.Exit(EXIT_USAGE) from None


def _do_submit(
    o: Options,
    client: QBatchClient,
    file: Path,
    job: str,
    defaults: Defaults,
    chunk: int,
    job_ttl: int,
    dry_run: bool,
) -> int:
    if not file.is_file():
        err.print(f"[red]error:[/] no such file: {file}")
        return EXIT_USAGE
    try:
        scan = scan_file(file, job, defaults=defaults)
    except UnicodeDecodeError as exc:
        err.print(f"[red]error:[/] {file} is not UTF-8: {exc}")
        return EXIT_USAGE
    bad = scan.bad
    if dry_run:
        if o.json:
            _emit_json(
                {
                    "job_id": job,
                    "format": scan.format,
                    "total": scan.total,
                    "valid": scan.total - len(bad),
                    "bad": [
                        {
                            "line": b.line,
                            "custom_id": b.custom_id,
                            "param": b.error.param if b.error else None,
                            "message": b.error.message if b.error else "",
                        }
                        for b in bad
                    ],
                }
            )
        for b in bad:
            err.print(f"line {b.line}: {b.error.message if b.error else '?'}", markup=False)
        _say(
            o,
            f"{file}: {scan.format or 'empty'} format, {scan.total} lines, "
            f"{scan.total - len(bad)} valid, {len(bad)} bad",
        )
        return EXIT_NOT_ALL_SUCCEEDED if bad else EXIT_OK
    if scan.total == 0:
        err.print(f"[red]error:[/] {file} has no requests")
        return EXIT_USAGE
    if scan.mixed:
        for b in scan.mixed:
            err.print(f"line {b.line}: {b.error.message if b.error else ''}", markup=False)
        err.print(
            "[red]error:[/] the file mixes OpenAI Batch lines and native envelopes; nothing sent"
        )
        return EXIT_USAGE
    store = JobStore(client.redis, client.keys, job_ttl)
    with _progress(o, f"submit {job}") as bar:
        report = submit_job(
            client,
            store,
            job,
            scan,
            input_path=str(file.resolve()),
            sha=file_sha256(file),
            chunk=chunk,
            on_progress=bar,
        )
    if o.json:
        _emit_json({"submit": report.as_dict()})
    if report.already_submitted:
        _say(o, f"job {job} was already submitted (status {report.status})")
    else:
        _say(
            o,
            f"job {job}: {report.published} lines published"
            + (f" (resumed after {report.resumed_from})" if report.resumed_from else "")
            + (f", {report.invalid} invalid lines answered as errors" if report.invalid else "")
            + (
                f", {report.cancelled_unsent} cancelled before sending"
                if report.cancelled_unsent
                else ""
            )
            + f"; status {report.status}",
        )
    for b in bad[:20]:
        _say(o, f"  line {b.line}: {b.error.message if b.error else ''}")
    return EXIT_NOT_ALL_SUCCEEDED if bad else EXIT_OK


@bulk_app.command("submit")
def bulk_submit(
    ctx: typer.Context,
    file: Annotated[
        Path, typer.Argument(help="JSONL: OpenAI Batch input lines or native envelopes.")
    ],
    job: JobOpt,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Validate every line; send nothing.")
    ] = False,
    priority: Annotated[
        int | None, typer.Option(help="Default priority for lines without one.")
    ] = None,
    deadline: Annotated[str | None, typer.Option(help="Default RFC 3339 deadline.")] = None,
    result_ttl: Annotated[
        int | None, typer.Option("--result-ttl", help="Default result TTL (s).")
    ] = None,
    job_ttl: Annotated[
        int, typer.Option("--job-ttl", help="TTL of the job keys (s).")
    ] = DEFAULT_JOB_TTL_S,
    chunk: Annotated[
        int, typer.Option(help="Lines per acknowledged chunk.", min=1)
    ] = DEFAULT_CHUNK,
) -> None:
    """Publish a file as job ID. Re-running resumes; a finished submission is a no-op.

    Exit 0: every line published; 1: some lines were invalid (answered as per-line
    errors; with --dry-run: listed and nothing sent).
    """
    o = _opts(ctx)
    job = _check_job(job)
    with _guard(), _client(o) as client:
        code = _do_submit(
            o, client, file, job, _defaults(priority, deadline, result_ttl), chunk, job_ttl, dry_run
        )
    raise typer.Exit(code)


def _status_table(view: JobView) -> Table:
    table = Table(title=f"job {view.job_id}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")

    def fmt_ms(ms: int) -> str:
        return datetime.fromtimestamp(ms / 1000).isoformat(timespec="seconds") if ms else "-"

    rows = [
        ("status", view.label),
        ("progress", f"{view.done}/{view.total} ({view.progress_pct:.1f}%)"),
        ("submitted", f"{view.submitted}/{view.total}"),
        ("succeeded", str(view.succeeded)),
        ("failed", str(view.failed)),
        ("expired", str(view.expired)),
        ("cancelled", str(view.cancelled)),
        ("pending", str(view.pending)),
        ("created", fmt_ms(view.created_at)),
        ("last result", fmt_ms(view.updated_at)),
        ("elapsed", f"{view.elapsed_s:.1f}s"),
        ("rate", f"{view.rate:.1f} results/s" if view.rate else "-"),
        ("ETA", f"{view.eta_s:.0f}s" if view.eta_s is not None else "-"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


@bulk_app.command("status")
def bulk_status(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="Job id.")],
    json_out: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
) -> None:
    """Show a job's counters, progress, rate and ETA (exit 4 if there is no such job)."""
    o = _opts(ctx)
    with _guard(), _client(o) as client:
        view = JobStore(client.redis, client.keys).view(job)
    if view is None:
        err.print(f"[red]error:[/] no job {job!r} under prefix {client.keys.prefix!r}")
        raise typer.Exit(EXIT_UNAVAILABLE)
    if json_out or o.json:
        _emit_json(view.as_dict())
    else:
        out.print(_status_table(view))


def _collect_exit(report: CollectReport, allow_failures: bool) -> int:
    if report.interrupted:
        return EXIT_INTERRUPTED
    if not report.complete:
        return EXIT_TIMEOUT
    if report.all_succeeded or allow_failures:
        return EXIT_OK
    return EXIT_NOT_ALL_SUCCEEDED


def _do_collect(
    o: Options,
    client: QBatchClient,
    job: str,
    out_path: Path,
    errors: Path | None,
    timeout: float | None,
) -> CollectReport:
    store = JobStore(client.redis, client.keys)
    with _progress(o, f"collect {job}") as bar:
        report = collect_job(store, job, out_path, errors=errors, timeout=timeout, on_progress=bar)
    if o.json:
        _emit_json({"collect": report.as_dict()})
    counts = ", ".join(f"{v} {k}" for k, v in report.counts.items() if v)
    state = (
        "complete"
        if report.complete
        else "interrupted"
        if report.interrupted
        else "INCOMPLETE (timed out)"
    )
    _say(
        o,
        f"job {job}: wrote {report.written}/{report.total} lines to {out_path}"
        + (f" (errors in {errors})" if errors else "")
        + f" [{counts or 'nothing yet'}]; {state}",
    )
    if report.missing_results:
        err.print(
            f"[yellow]warning:[/] {report.missing_results} results expired from Redis "
            "before they were collected"
        )
    return report


TimeoutOpt = Annotated[
    float | None, typer.Option(help="Give up after S seconds (partial output is written; exit 3).")
]


@bulk_app.command("collect")
def bulk_collect(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="Job id.")],
    out_path: Annotated[Path, typer.Option("--out", help="OpenAI Batch output JSONL.")],
    errors: Annotated[
        Path | None, typer.Option("--errors", help="Put lines that did not succeed here.")
    ] = None,
    timeout: TimeoutOpt = None,
    allow_failures: Annotated[bool, typer.Option("--allow-failures")] = False,
) -> None:
    """Wait for a job's results and write them (input-line order; one line per input line).

    Re-running rewrites the output from the job stream (nothing lost or doubled).
    Exit 0 all succeeded, 1 some did not, 3 timed out, 130 interrupted.
    """
    o = _opts(ctx)
    with _guard(), _client(o) as client:
        report = _do_collect(o, client, job, out_path, errors, timeout)
    raise typer.Exit(_collect_exit(report, allow_failures))


@bulk_app.command("cancel")
def bulk_cancel(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="Job id.")],
    job_ttl: Annotated[
        int, typer.Option("--job-ttl", help="TTL of the cancel flag (s).")
    ] = DEFAULT_JOB_TTL_S,
) -> None:
    """Cancel a job: requests not yet started finish as `cancelled`; finished ones stay."""
    o = _opts(ctx)
    with _guard(), _client(o) as client:
        status = JobStore(client.redis, client.keys, job_ttl).cancel(job)
    if not status:
        err.print(f"[red]error:[/] no job {job!r}")
        raise typer.Exit(EXIT_UNAVAILABLE)
    if o.json:
        _emit_json({"job_id": job, "status": status})
    _say(o, f"job {job}: {status}")


@bulk_app.command("run")
def bulk_run(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="JSONL input file.")],
    out_path: Annotated[Path, typer.Option("--out", help="OpenAI Batch output JSONL.")],
    job: Annotated[
        str | None, typer.Option("--job", help="Default: {file stem}-{sha256[:12]} of the file.")
    ] = None,
    errors: Annotated[
        Path | None, typer.Option("--errors", help="Lines that did not succeed.")
    ] = None,
    timeout: TimeoutOpt = None,
    allow_failures: Annotated[
        bool, typer.Option("--allow-failures", help="Exit 0 when complete, even with failed lines.")
    ] = False,
    priority: Annotated[int | None, typer.Option()] = None,
    deadline: Annotated[str | None, typer.Option()] = None,
    result_ttl: Annotated[int | None, typer.Option("--result-ttl")] = None,
    job_ttl: Annotated[int, typer.Option("--job-ttl")] = DEFAULT_JOB_TTL_S,
    chunk: Annotated[int, typer.Option(min=1)] = DEFAULT_CHUNK,
) -> None:
    """Submit FILE and collect its results into --out (for cron). Re-running resumes.

    Exit 0 only when every line succeeded (or, with --allow-failures, when every line
    has a result); 1 some lines did not succeed; 3 timed out; see `qbatch --help`.
    """
    o = _opts(ctx)
    if not file.is_file():
        err.print(f"[red]error:[/] no such file: {file}")
        raise typer.Exit(EXIT_USAGE)
    job = _check_job(job or default_job_id(file, file_sha256(file)))
    with _guard(), _client(o) as client:
        code = _do_submit(
            o,
            client,
            file,
            job,
            _defaults(priority, deadline, result_ttl),
            chunk,
            job_ttl,
            dry_run=False,
        )
        if code not in (EXIT_OK, EXIT_NOT_ALL_SUCCEEDED):
            raise typer.Exit(code)
        report = _do_collect(o, client, job, out_path, errors, timeout)
    raise typer.Exit(_collect_exit(report, allow_failures))


@bulk_app.command("retry")
def bulk_retry(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="Job id.")],
    failed: Annotated[
        bool,
        typer.Option("--failed", help="Resubmit lines whose latest attempt failed or expired."),
    ] = False,
    file: Annotated[
        Path | None, typer.Option("--file", help="Input file (default: the path stored at submit).")
    ] = None,
    chunk: Annotated[int, typer.Option(min=1)] = DEFAULT_CHUNK,
) -> None:
    """Resubmit a finished job's failed/expired lines (same job, same custom_ids).

    The new attempt's request ids are `{job}.{line}.r{k}`; `bulk collect` keeps the newest
    attempt of each line. Lines invalid in the file are not retried.
    """
    o = _opts(ctx)
    if not failed:
        err.print("[red]error:[/] say what to retry: --failed")
        raise typer.Exit(EXIT_USAGE)
    with _guard(), _client(o) as client:
        store = JobStore(client.redis, client.keys)
        path = file
        if path is None:
            stored = store.field(job, INPUT_PATH_FIELD)
            if stored is None:
                err.print(f"[red]error:[/] job {job!r} has no stored input path; give --file")
                raise typer.Exit(EXIT_UNAVAILABLE)
            path = Path(stored)
        if not path.is_file():
            err.print(f"[red]error:[/] input file {path} is gone; give --file")
            raise typer.Exit(EXIT_USAGE)
        with _progress(o, f"retry {job}") as bar:
            report = retry_job(client, store, job, path, chunk=chunk, on_progress=bar)
    if o.json:
        _emit_json({"retry": report.as_dict()})
    _say(
        o,
        f"job {job}: attempt {report.attempt}: {report.retried} lines resubmitted"
        + (
            f", {report.skipped_invalid} invalid lines not retried"
            if report.skipped_invalid
            else ""
        )
        + f"; status {report.status}",
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
