"""What every `qbatch` command shares: exit codes, consoles, global options, the guard
that turns expected failures into exit codes, progress bars, and the request-option
flags.

The request-option flags (`--priority`, `--deadline`, `--result-ttl`, `--metadata`,
`--job-id`, `--custom-id`, `--tool-loop`) are declared here once, with the help text of the
`schemas.RequestOptions` field each sets, and parsed by `request_options()`: `submit`,
`bulk submit` and `bulk run` all take them from here.
"""

from __future__ import annotations

import json
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

from producer.client import PublishError, QBatchClient
from producer.jobs import JobError
from producer.placement import PlacementMode
from schemas import ConnectionSettings, ContractError, ResultEnvelope, Status
from schemas.context import ContextStrategy
from schemas.limits import DEFAULT_TOOL_TURNS
from schemas.request import RequestOptions
from schemas.routes import RoutesError, load_routes

EXIT_OK = 0
EXIT_NOT_ALL_SUCCEEDED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_UNAVAILABLE = 4
EXIT_INTERRUPTED = 130

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
    bulk_topic: str | None = None
    routes: Path | None = None


def opts(ctx: typer.Context) -> Options:
    return ctx.obj if isinstance(ctx.obj, Options) else Options()


def client_for(o: Options) -> QBatchClient:
    try:
        settings = ConnectionSettings()
        if o.routes is not None:
            table = load_routes(o.routes)
            settings = settings.model_copy(update={"routes": table})
        return QBatchClient(
            settings,
            bootstrap=o.bootstrap,
            redis_url=o.redis_url,
            topic=o.topic,
            bulk_topic=o.bulk_topic,
            prefix=o.prefix,
        )
    except RoutesError as exc:
        err.print(f"[red]error:[/] --routes: {escape(str(exc))}")
        raise typer.Exit(EXIT_USAGE) from None
    except ValueError as exc:  # pydantic ValidationError (e.g. a bad --prefix, QBATCH_ROUTES)
        err.print(f"[red]error:[/] bad settings: {escape(str(exc))}")
        raise typer.Exit(EXIT_USAGE) from None


@contextmanager
def guard() -> Iterator[None]:
    """Turn the expected failures into messages and exit codes."""
    try:
        yield
    except ContractError as exc:
        err.print(f"[red]invalid request:[/] {escape(exc.message)}")
        raise typer.Exit(EXIT_USAGE) from None
    except JobError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    except (KafkaError, PublishError) as exc:
        err.print(f"[red]Kafka error:[/] {escape(repr(exc))}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    except redis.exceptions.RedisError as exc:
        err.print(f"[red]Redis error:[/] {escape(str(exc))}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: re-run the same command to resume")
        raise typer.Exit(EXIT_INTERRUPTED) from None


@contextmanager
def progress(o: Options, description: str, enabled: bool = True) -> Iterator[Any]:
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
            speed = bar.tasks[0].speed
            bar.update(task, completed=done, total=total, rate=f"{speed:,.0f}/s" if speed else "")

        yield update


def say(o: Options, message: str) -> None:
    if not o.quiet:
        err.print(message)


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, default=str) + "\n")
    sys.stdout.flush()


def usage_error(message: str) -> typer.Exit:
    err.print(f"[red]error:[/] {escape(message)}")
    return typer.Exit(EXIT_USAGE)


def parse_json_obj(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # bad JSON, a 5,000-digit integer, depth
        raise usage_error(f"{what} is not JSON this tool reads: {exc}") from None
    if not isinstance(value, dict):
        raise usage_error(f"{what} must be a JSON object")
    return value


def parse_deadline(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise usage_error(f"--deadline must be an RFC 3339 time, got {value!r}") from None
    if parsed.tzinfo is None:
        raise usage_error("--deadline needs a time zone (e.g. 2025-01-01T06:00:00Z)")
    return parsed


def result_exit(results: list[ResultEnvelope | None]) -> int:
    if any(r is None for r in results):
        return EXIT_TIMEOUT
    if all(r is not None and r.status is Status.succeeded for r in results):
        return EXIT_OK
    return EXIT_NOT_ALL_SUCCEEDED


# ---------------------------------------------------------------- request-option flags


def _help(field: str, prefix: str = "") -> str:
    description = RequestOptions.model_fields[field].description or ""
    return f"{prefix}{description}"


JobIdOpt = Annotated[str | None, typer.Option("--job-id", help=_help("job_id"))]
CustomIdOpt = Annotated[str | None, typer.Option("--custom-id", help=_help("custom_id"))]
PriorityOpt = Annotated[int | None, typer.Option("--priority", help=_help("priority"))]
DeadlineOpt = Annotated[str | None, typer.Option("--deadline", help=_help("deadline"))]
ResultTtlOpt = Annotated[int | None, typer.Option("--result-ttl", help=_help("result_ttl_s"))]
MetadataOpt = Annotated[str | None, typer.Option("--metadata", help=_help("metadata"))]


def bare_tool_loop(argv: list[str]) -> list[str]:
    """`--tool-loop` written without a number (`bulk run F --tool-loop --registry m:r`, as
    the design writes it) means the default turn limit: insert it, so the option keeps
    taking an integer everywhere else. Pure."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--tool-loop" and (i + 1 == len(argv) or not argv[i + 1].lstrip("-").isdigit()):
            out.append(str(DEFAULT_TOOL_TURNS))
    return out


ToolLoopOpt = Annotated[
    int | None,
    typer.Option(
        "--tool-loop",
        help="Run the model's tool calls and continue, for at most N model turns "
        f"(tool_loop.max_turns; bare --tool-loop: {DEFAULT_TOOL_TURNS}); needs an "
        "executor (`qbatch tools serve`).",
        min=1,
    ),
]
ContextStrategyOpt = Annotated[
    ContextStrategy | None,
    typer.Option(
        "--context-strategy",
        help="A prompt over the window: error (refuse), sliding_window (drop the oldest "
        "turns), truncate_middle or truncate_head (cut the longest message). context.strategy",
    ),
]
MaxPromptTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--max-prompt-tokens",
        help="The window in prompt tokens (context.max_prompt_tokens; at most the model's "
        "context minus max_tokens).",
        min=1,
    ),
]
PlacementOpt = Annotated[
    PlacementMode,
    typer.Option(
        "--placement",
        help="prefix: lines sharing a long prompt prefix (system prompt, tools, first "
        "turns) go to one partition, published together, so one worker's prefix cache "
        "serves the family (at most 64 lines in a row per partition); none: Kafka's key "
        "partitioner, file order.",
    ),
]
DEFAULTS_NOTE = " For a bulk job: the default for lines that do not set it."


def request_options(
    *,
    priority: int | None = None,
    deadline: str | None = None,
    result_ttl: int | None = None,
    metadata: str | None = None,
    job_id: str | None = None,
    custom_id: str | None = None,
    tool_loop: int | None = None,
    context_strategy: ContextStrategy | None = None,
    max_prompt_tokens: int | None = None,
) -> dict[str, Any]:
    """The flags' values as `schemas.RequestOptions` keyword arguments (unset ones left out)."""
    context = {"strategy": context_strategy, "max_prompt_tokens": max_prompt_tokens}
    values: dict[str, Any] = {
        "tool_loop": {"max_turns": tool_loop} if tool_loop is not None else None,
        "context": {k: v for k, v in context.items() if v is not None} or None,
        "priority": priority,
        "deadline": parse_deadline(deadline),
        "result_ttl_s": result_ttl,
        "metadata": parse_json_obj(metadata, "--metadata") if metadata else None,
        "job_id": job_id,
        "custom_id": custom_id,
    }
    return {k: v for k, v in values.items() if v is not None}
