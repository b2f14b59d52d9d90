"""`qbatch summarize FILE...` and `qbatch bulk summarize DOCS.jsonl`: map-reduce
summaries of long documents, as rounds of resumable bulk jobs (`producer.summarize`).

Registered on the main app and on `bulk_app` by `register` (called from producer/cli.py),
so producer/cli_bulk.py does not grow.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from producer.bulk import Defaults, check_job_id
from producer.cli_common import (
    EXIT_NOT_ALL_SUCCEEDED,
    EXIT_OK,
    EXIT_TIMEOUT,
    DeadlineOpt,
    MetadataOpt,
    PriorityOpt,
    ResultTtlOpt,
    client_for,
    emit_json,
    guard,
    opts,
    progress,
    request_options,
    say,
    usage_error,
)
from producer.jobs import file_sha256
from producer.summarize.documents import Document, read_docs_jsonl, read_text_file
from producer.summarize.plan import DEFAULT_CONTEXT, DEFAULT_SUMMARY_TOKENS, Budget, PlanError
from producer.summarize.templates import TemplateError, load_templates
from producer.summarize.tokens import TOKENIZER_ENV, TokenizerError, load_tokenizer
from schemas import ContractError
from schemas.settings import BULK

OutOpt = Annotated[
    Path, typer.Option("--out", help="Output JSONL: one line per document, in input order.")
]
JobOpt = Annotated[
    str | None,
    typer.Option(
        "--job",
        help="Job id (rounds are bulk jobs {job}.L1, {job}.L2, ...). Default: derived from "
        "the inputs' and settings' sha256, so a re-run resumes.",
    ),
]
WorkDirOpt = Annotated[
    Path | None,
    typer.Option("--work-dir", help="Round files and state.db (default: {out}.work/)."),
]
TokenizerOpt = Annotated[
    str | None,
    typer.Option(
        "--tokenizer",
        envvar=TOKENIZER_ENV,
        help="The served model's tokenizer.json, or its model directory.",
    ),
]
ContextOpt = Annotated[
    int,
    typer.Option(
        "--context-tokens",
        envvar="QBATCH_CONTEXT_TOKENS",
        min=64,
        help="The served model's context (tokens).",
    ),
]
ChunkTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--chunk-tokens",
        min=1,
        help="Tokens a chunk (default: min(8192, what fits the context with the prompt).",
    ),
]
OverlapOpt = Annotated[
    int | None,
    typer.Option(
        "--overlap-tokens",
        min=0,
        help="Tokens shared by consecutive chunks (default: min(256, chunk/16)).",
    ),
]
SummaryOpt = Annotated[
    int, typer.Option("--summary-tokens", min=1, help="max_tokens of every summary.")
]
InstructionsOpt = Annotated[
    str | None,
    typer.Option("--instructions", help="What the summary should be (a JSONL line's own wins)."),
]
MapTemplateOpt = Annotated[
    Path | None,
    typer.Option(
        "--map-template",
        help="Map (and single-pass) prompt file; fields {text} {instructions} {part} {parts}.",
    ),
]
ReduceTemplateOpt = Annotated[
    Path | None,
    typer.Option("--reduce-template", help="Reduce prompt file; the same four fields."),
]
TimeoutOpt = Annotated[
    float | None, typer.Option("--timeout", help="Give up after S seconds (exit 3; re-run).")
]
LaneOpt = Annotated[str, typer.Option("--lane", help="Priority lane (default bulk).")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="body.model of every request.")]
ThinkingOpt = Annotated[
    bool, typer.Option("--thinking", help="Let the model think (default: enable_thinking off).")
]


def _job_id(inputs: list[Path], settings: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    for path in inputs:
        digest.update(file_sha256(path).encode())
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    stem = re.sub(r"[^A-Za-z0-9_.:-]", "_", inputs[0].stem)[:60] or "docs"
    return f"{stem}-{digest.hexdigest()[:12]}"


def _run(
    ctx: typer.Context,
    inputs: list[Path],
    documents: Callable[[], Iterable[Document]],
    out_path: Path,
    values: dict[str, Any],
) -> None:
    from producer.summarize.driver import Config, Driver

    o = opts(ctx)
    for path in inputs:
        if not path.is_file():
            raise usage_error(f"no such file: {path}")
    try:
        tokenizer = load_tokenizer(values["tokenizer"])
        templates = load_templates(
            map_file=values["map_template"],
            reduce_file=values["reduce_template"],
            instructions=values["instructions"],
        )
        options = request_options(
            priority=values["priority"],
            deadline=values["deadline"],
            result_ttl=values["result_ttl"],
            metadata=values["metadata"],
        )
        Defaults(**options)
    except (TokenizerError, TemplateError) as exc:
        raise usage_error(str(exc)) from None
    except ContractError as exc:
        raise usage_error(f"bad request option: {exc.message}") from None
    budget = Budget(
        context=values["context_tokens"],
        summary_tokens=values["summary_tokens"],
        chunk_tokens=values["chunk_tokens"],
        overlap_tokens=values["overlap_tokens"],
    )
    config = Config(
        job="",
        work_dir=values["work_dir"] or out_path.with_name(out_path.name + ".work"),
        out=out_path,
        budget=budget,
        templates=templates,
        model=values["model"],
        thinking=values["thinking"],
        options=options,
        lane=values["lane"],
        timeout=values["timeout"],
    )
    job = values["job"] or _job_id(inputs, {"settings": config.fingerprint()})
    try:
        check_job_id(job + ".L9999")
    except ContractError as exc:
        raise usage_error(f"--job: {exc.message}") from None
    config.job = job
    with guard(), client_for(o) as client:
        driver = Driver(client, tokenizer, config, bar=lambda label: progress(o, label))
        try:
            report = driver.run(documents())
        except (PlanError, TemplateError) as exc:
            raise usage_error(str(exc)) from None
        finally:
            driver.close()
    if o.json:
        emit_json({"job_id": job, "summarize": report.as_dict()})
    if not report.complete:
        say(o, f"job {job}: not finished in time after {report.rounds} rounds; re-run to resume")
        raise typer.Exit(EXIT_TIMEOUT)
    say(
        o,
        f"job {job}: {report.succeeded}/{report.documents} documents summarised "
        f"({report.failed} failed) in {report.rounds} rounds; wrote {out_path}",
    )
    raise typer.Exit(EXIT_NOT_ALL_SUCCEEDED if report.failed else EXIT_OK)


def summarize_files(
    ctx: typer.Context,
    files: Annotated[list[Path], typer.Argument(help="Text files (.txt, .md): one document each.")],
    out_path: OutOpt,
    job: JobOpt = None,
    work_dir: WorkDirOpt = None,
    tokenizer: TokenizerOpt = None,
    context_tokens: ContextOpt = DEFAULT_CONTEXT,
    chunk_tokens: ChunkTokensOpt = None,
    overlap_tokens: OverlapOpt = None,
    summary_tokens: SummaryOpt = DEFAULT_SUMMARY_TOKENS,
    instructions: InstructionsOpt = None,
    map_template: MapTemplateOpt = None,
    reduce_template: ReduceTemplateOpt = None,
    model: ModelOpt = None,
    thinking: ThinkingOpt = False,
    timeout: TimeoutOpt = None,
    lane: LaneOpt = BULK,
    priority: PriorityOpt = None,
    deadline: DeadlineOpt = None,
    result_ttl: ResultTtlOpt = None,
    metadata: MetadataOpt = None,
) -> None:
    """Summarise each FILE (custom_id: the path as given) into --out. Re-running resumes.

    Exit 0 every document summarised; 1 some failed (their lines say which level and
    chunk; `qbatch bulk retry {job}.L{n} --failed`, then re-run); 2 usage; 3 timed out.
    """
    values = dict(locals())
    _run(ctx, files, lambda: (read_text_file(path) for path in files), out_path, values)


def summarize_jsonl(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="JSONL: {custom_id, text, instructions?} a line.")],
    out_path: OutOpt,
    job: JobOpt = None,
    work_dir: WorkDirOpt = None,
    tokenizer: TokenizerOpt = None,
    context_tokens: ContextOpt = DEFAULT_CONTEXT,
    chunk_tokens: ChunkTokensOpt = None,
    overlap_tokens: OverlapOpt = None,
    summary_tokens: SummaryOpt = DEFAULT_SUMMARY_TOKENS,
    instructions: InstructionsOpt = None,
    map_template: MapTemplateOpt = None,
    reduce_template: ReduceTemplateOpt = None,
    model: ModelOpt = None,
    thinking: ThinkingOpt = False,
    timeout: TimeoutOpt = None,
    lane: LaneOpt = BULK,
    priority: PriorityOpt = None,
    deadline: DeadlineOpt = None,
    result_ttl: ResultTtlOpt = None,
    metadata: MetadataOpt = None,
) -> None:
    """Summarise every document of a JSONL file into --out (one line each, input order).

    A bad line (not UTF-8, not JSON, an unknown field, a duplicate custom_id, empty text)
    becomes that document's failed output line. Exit codes as `qbatch summarize`.
    """
    values = dict(locals())
    _run(ctx, [file], lambda: read_docs_jsonl(file), out_path, values)


def register(app: typer.Typer, bulk_app: typer.Typer) -> None:
    app.command("summarize")(summarize_files)
    bulk_app.command("summarize")(summarize_jsonl)


__all__ = ["register", "summarize_files", "summarize_jsonl"]
