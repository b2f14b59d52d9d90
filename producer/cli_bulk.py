"""`qbatch bulk ...`: a JSONL file in (OpenAI Batch or native envelopes), a JSONL file out.

The I/O lives in `producer.jobs`; this module is the command line over it. Request-option
flags come from `producer.cli_common` and set defaults for lines that do not set them.
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer

from producer.bulk import Defaults, check_job_id
from producer.cli_common import (
    EXIT_INTERRUPTED,
    EXIT_NOT_ALL_SUCCEEDED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ContextStrategyOpt,
    DeadlineOpt,
    MaxPromptTokensOpt,
    MetadataOpt,
    Options,
    PlacementOpt,
    PriorityOpt,
    ResultTtlOpt,
    ToolLoopOpt,
    client_for,
    emit_json,
    err,
    guard,
    opts,
    out,
    progress,
    request_options,
    say,
    usage_error,
)
from producer.cli_tools import RegistryOpt, build_registry, embedded_executor
from producer.client import QBatchClient
from producer.collect import CollectReport, collect_job, retry_job
from producer.job_view import status_table
from producer.jobs import (
    DEFAULT_CHUNK,
    DEFAULT_JOB_TTL_S,
    INPUT_PATH_FIELD,
    JobStore,
    file_sha256,
    submit_job,
)
from producer.placement import PlacementMode
from producer.stream_scan import scan_stream
from producer.usage import CLI_TENANT, UsageStore
from schemas import ContractError
from schemas.context import ContextStrategy
from schemas.settings import BULK

BulkLaneOpt = Annotated[
    str,
    typer.Option(
        "--lane",
        help="Priority lane the job's lines travel on (default bulk: interactive requests "
        "are served first; see QBATCH_LANES).",
    ),
]
JobTtlOpt = Annotated[int, typer.Option("--job-ttl", help="TTL of the job keys (s).")]
ChunkOpt = Annotated[int, typer.Option(help="Lines per acknowledged chunk.", min=1)]

bulk_app = typer.Typer(
    help="Bulk jobs: a JSONL file in (OpenAI Batch or native envelopes), a JSONL file out.",
    no_args_is_help=True,
)

JobOpt = Annotated[str, typer.Option("--job", help="Job id (1-96 chars of [A-Za-z0-9_.:-]).")]


def _defaults(
    priority: int | None,
    deadline: str | None,
    result_ttl: int | None,
    metadata: str | None,
    tool_loop: int | None,
    context_strategy: ContextStrategy | None,
    max_prompt_tokens: int | None,
) -> Defaults:
    """The request-option flags as a bulk job's defaults (checked once, up front)."""
    options = request_options(
        priority=priority,
        deadline=deadline,
        result_ttl=result_ttl,
        metadata=metadata,
        tool_loop=tool_loop,
        context_strategy=context_strategy,
        max_prompt_tokens=max_prompt_tokens,
    )
    try:
        return Defaults(embeddings_base64=True, **options)
    except ContractError as exc:
        raise usage_error(f"bad default: {exc.message}") from None


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
    lane: str,
    placement: PlacementMode = PlacementMode.prefix,
) -> int:
    if not file.is_file():
        err.print(f"[red]error:[/] no such file: {file}")
        return EXIT_USAGE
    try:
        scan = scan_stream(file, job, defaults=defaults.routed(client.routes))
    except UnicodeDecodeError as exc:
        err.print(f"[red]error:[/] {file} is not UTF-8: {exc}")
        return EXIT_USAGE
    bad = scan.bad
    if dry_run:
        if o.json:
            emit_json(
                {
                    "job_id": job,
                    "format": scan.format,
                    "total": scan.total,
                    "valid": scan.total - scan.invalid,
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
        say(
            o,
            f"{file}: {scan.format or 'empty'} format, {scan.total} lines, "
            f"{scan.total - scan.invalid} valid, {scan.invalid} bad"
            + (f" (the first {len(bad)} listed)" if len(bad) < scan.invalid else ""),
        )
        return EXIT_NOT_ALL_SUCCEEDED if scan.invalid else EXIT_OK
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
    store = JobStore.of(client, job_ttl)
    with progress(o, f"submit {job}") as bar:
        report = submit_job(
            client,
            store,
            job,
            scan,
            input_path=str(file.resolve()),
            sha=file_sha256(file),
            chunk=chunk,
            on_progress=bar,
            lane=lane,
            placement=placement,
        )
    if o.json:
        emit_json({"submit": report.as_dict()})
    if report.already_submitted:
        say(o, f"job {job} was already submitted (status {report.status})")
    else:
        say(
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
        say(o, f"  line {b.line}: {b.error.message if b.error else ''}")
    return EXIT_NOT_ALL_SUCCEEDED if scan.invalid else EXIT_OK


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
    priority: PriorityOpt = None,
    deadline: DeadlineOpt = None,
    result_ttl: ResultTtlOpt = None,
    metadata: MetadataOpt = None,
    tool_loop: ToolLoopOpt = None,
    context_strategy: ContextStrategyOpt = None,
    max_prompt_tokens: MaxPromptTokensOpt = None,
    job_ttl: JobTtlOpt = DEFAULT_JOB_TTL_S,
    chunk: ChunkOpt = DEFAULT_CHUNK,
    lane: BulkLaneOpt = BULK,
    placement: PlacementOpt = PlacementMode.prefix,
) -> None:
    """Publish a file as job ID. Re-running resumes; a finished submission is a no-op.

    Exit 0: every line published; 1: some lines were invalid (answered as per-line
    errors; with --dry-run: listed and nothing sent).
    """
    o = opts(ctx)
    job = _check_job(job)
    defaults = _defaults(
        priority, deadline, result_ttl, metadata, tool_loop, context_strategy, max_prompt_tokens
    )
    with guard(), client_for(o) as client:
        code = _do_submit(o, client, file, job, defaults, chunk, job_ttl, dry_run, lane, placement)
    raise typer.Exit(code)


@bulk_app.command("status")
def bulk_status(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="Job id.")],
    json_out: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
) -> None:
    """Show a job's counters, progress, rate and ETA (exit 4 if there is no such job)."""
    o = opts(ctx)
    with guard(), client_for(o) as client:
        view = JobStore.of(client).view(job)
    if view is None:
        err.print(f"[red]error:[/] no job {job!r} under prefix {client.keys.prefix!r}")
        raise typer.Exit(EXIT_UNAVAILABLE)
    if json_out or o.json:
        emit_json(view.as_dict())
    else:
        out.print(status_table(view))


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
    store = JobStore.of(client)
    with progress(o, f"collect {job}") as bar:
        usage = UsageStore(client.redis, client.keys)
        report = collect_job(
            store,
            job,
            out_path,
            errors=errors,
            timeout=timeout,
            on_progress=bar,
            on_result=lambda r: usage.record(CLI_TENANT, r),
        )
    if o.json:
        emit_json({"collect": report.as_dict()})
    counts = ", ".join(f"{v} {k}" for k, v in report.counts.items() if v)
    state = (
        "complete"
        if report.complete
        else "interrupted"
        if report.interrupted
        else "INCOMPLETE (timed out)"
    )
    say(
        o,
        f"job {job}: wrote {report.written}/{report.total} lines to {out_path}"
        + (f" (errors in {errors})" if errors else "")
        + f" [{counts or 'nothing yet'}]; {state}",
    )
    if report.missing_results:
        err.print(
            f"[yellow]warning:[/] {report.missing_results} results expired from Redis "
            "before they were collected (written as failed lines, internal_error)"
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
    o = opts(ctx)
    with guard(), client_for(o) as client:
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
    o = opts(ctx)
    with guard(), client_for(o) as client:
        status = JobStore.of(client, job_ttl).cancel(job)
    if not status:
        err.print(f"[red]error:[/] no job {job!r}")
        raise typer.Exit(EXIT_UNAVAILABLE)
    if o.json:
        emit_json({"job_id": job, "status": status})
    say(o, f"job {job}: {status}")


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
    priority: PriorityOpt = None,
    deadline: DeadlineOpt = None,
    result_ttl: ResultTtlOpt = None,
    metadata: MetadataOpt = None,
    tool_loop: ToolLoopOpt = None,
    context_strategy: ContextStrategyOpt = None,
    max_prompt_tokens: MaxPromptTokensOpt = None,
    registry: RegistryOpt = None,
    tools_config: Annotated[
        Path | None,
        typer.Option("--tools-config", help="HTTP tools (YAML/JSON) for the embedded executor."),
    ] = None,
    job_ttl: JobTtlOpt = DEFAULT_JOB_TTL_S,
    chunk: ChunkOpt = DEFAULT_CHUNK,
    lane: BulkLaneOpt = BULK,
    placement: PlacementOpt = PlacementMode.prefix,
) -> None:
    """Submit FILE and collect its results into --out (for cron). Re-running resumes.

    With --tool-loop N every line runs as a tool loop; with --registry (and/or
    --tools-config) this command also runs an executor for those tools while it waits,
    so no `qbatch tools serve` is needed.

    Exit 0 only when every line succeeded (or, with --allow-failures, when every line
    has a result); 1 some lines did not succeed; 3 timed out; see `qbatch --help`.
    """
    o = opts(ctx)
    if not file.is_file():
        err.print(f"[red]error:[/] no such file: {file}")
        raise typer.Exit(EXIT_USAGE)
    job = _check_job(job or default_job_id(file, file_sha256(file)))
    tools = None
    if registry is not None or tools_config is not None:
        if tool_loop is None:
            raise usage_error("--registry/--tools-config run tools for --tool-loop N; give it")
        tools = build_registry(registry, tools_config)
    defaults = _defaults(
        priority, deadline, result_ttl, metadata, tool_loop, context_strategy, max_prompt_tokens
    )
    with guard(), client_for(o) as client:
        executor = embedded_executor(o, tools) if tools is not None else nullcontext()
        with executor:
            code = _do_submit(
                o, client, file, job, defaults, chunk, job_ttl, False, lane, placement
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
    chunk: ChunkOpt = DEFAULT_CHUNK,
    lane: BulkLaneOpt = BULK,
) -> None:
    """Resubmit a finished job's failed/expired lines (same job, same custom_ids).

    The new attempt's request ids are `{job}.{line}.r{k}`; `bulk collect` keeps the newest
    attempt of each line. Lines invalid in the file are not retried.
    """
    o = opts(ctx)
    if not failed:
        err.print("[red]error:[/] say what to retry: --failed")
        raise typer.Exit(EXIT_USAGE)
    with guard(), client_for(o) as client:
        store = JobStore.of(client)
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
        with progress(o, f"retry {job}") as bar:
            report = retry_job(client, store, job, path, chunk=chunk, on_progress=bar, lane=lane)
    if o.json:
        emit_json({"retry": report.as_dict()})
    say(
        o,
        f"job {job}: attempt {report.attempt}: {report.retried} lines resubmitted"
        + (
            f", {report.skipped_invalid} invalid lines not retried"
            if report.skipped_invalid
            else ""
        )
        + f"; status {report.status}",
    )
