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

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from producer.cli_bulk import bulk_app, default_job_id
from producer.cli_common import (
    EXIT_TIMEOUT,
    ContextStrategyOpt,
    CustomIdOpt,
    DeadlineOpt,
    JobIdOpt,
    MaxPromptTokensOpt,
    MetadataOpt,
    Options,
    PriorityOpt,
    ResultTtlOpt,
    ToolLoopOpt,
    bare_tool_loop,
    client_for,
    emit_json,
    err,
    guard,
    opts,
    out,
    parse_json_obj,
    request_options,
    result_exit,
    usage_error,
)
from producer.cli_serve import register as register_serve
from producer.cli_summarize import register as register_summarize
from producer.cli_tools import tools_app
from producer.cli_usage import register as register_usage
from producer.topic_results import TopicResults
from schemas import ResultEnvelope

app = typer.Typer(
    name="qbatch",
    help="Submit LLM requests to qbatch (Kafka in, Redis out) and run bulk jobs.",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(bulk_app, name="bulk")
app.add_typer(tools_app, name="tools")
register_summarize(app, bulk_app)
register_serve(app)
register_usage(app)

__all__ = ["app", "default_job_id", "main"]


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
        str | None,
        typer.Option("--topic", help="Requests topic of the interactive lane (QBATCH_TOPIC)."),
    ] = None,
    bulk_topic: Annotated[
        str | None,
        typer.Option("--bulk-topic", help="Requests topic of the bulk lane (QBATCH_BULK_TOPIC)."),
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
    routes: Annotated[
        Path | None,
        typer.Option(
            "--routes",
            help="Route table file (YAML/JSON): model -> {topic, bulk_topic}; "
            "default QBATCH_ROUTES (JSON), else one pool for every model.",
        ),
    ] = None,
) -> None:
    """Global options override the QBATCH_* environment."""
    ctx.obj = Options(bootstrap, redis_url, topic, prefix, quiet, json_out, bulk_topic, routes)


FromTopicOpt = Annotated[
    str | None,
    typer.Option(
        "--from-topic",
        help="Read the result from this Kafka results topic instead of Redis ('-': "
        "QBATCH_RESULTS_TOPIC); for workers run with --results-topic.",
    ),
]
SinceOpt = Annotated[
    float,
    typer.Option(help="With --from-topic: read results published up to S seconds ago."),
]


def _print(result: ResultEnvelope) -> None:
    sys.stdout.write(result.model_dump_json(exclude_none=True) + "\n")


def _topic_results(o: Options, topic: str) -> TopicResults:
    client = client_for(o)
    try:
        return TopicResults(client.settings, topic=None if topic == "-" else topic)
    except ValueError as exc:
        raise usage_error(str(exc)) from None


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
        typer.Option(
            help="/v1/chat/completions, /v1/completions or /v1/embeddings (default: from the body)."
        ),
    ] = None,
    request_id: Annotated[
        str | None, typer.Option("--request-id", help="Default: generated.")
    ] = None,
    job_id: JobIdOpt = None,
    custom_id: CustomIdOpt = None,
    priority: PriorityOpt = None,
    deadline: DeadlineOpt = None,
    result_ttl: ResultTtlOpt = None,
    metadata: MetadataOpt = None,
    tool_loop: ToolLoopOpt = None,
    context_strategy: ContextStrategyOpt = None,
    max_prompt_tokens: MaxPromptTokensOpt = None,
    lane: Annotated[
        str | None,
        typer.Option(help="Priority lane: interactive (default), bulk, or one of QBATCH_LANES."),
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait and print the result JSON.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to --wait.")] = 60.0,
    from_topic: FromTopicOpt = None,
) -> None:
    """Submit one request; prints its request_id (or, with --wait, the result JSON).

    The body comes from --body, --body-file, or stdin.
    """
    o = opts(ctx)
    if body is not None and body_file is not None:
        raise usage_error("give --body or --body-file, not both")
    if body is not None:
        text = body
    elif body_file is not None and str(body_file) != "-":
        text = body_file.read_text(encoding="utf-8")
    else:
        text = sys.stdin.read()
    data = parse_json_obj(text, "the body")
    options = request_options(
        priority=priority,
        deadline=deadline,
        result_ttl=result_ttl,
        metadata=metadata,
        job_id=job_id,
        custom_id=custom_id,
        tool_loop=tool_loop,
        context_strategy=context_strategy,
        max_prompt_tokens=max_prompt_tokens,
    )
    sent_ms = int(time.time() * 1000) - 5_000
    with guard(), client_for(o) as client:
        rid = client.submit(data, request_id=request_id, endpoint=endpoint, lane=lane, **options)
        if not wait:
            emit_json({"request_id": rid}) if o.json else out.print(rid)
            return
        if from_topic:
            reader = _topic_results(o, from_topic)
            result = reader.wait([rid], timeout, since_ms=sent_ms)[rid]
            reader.close()
        else:
            result = client.wait(rid, timeout=timeout)
    if result is None:
        err.print(f"[yellow]timed out[/] after {timeout}s waiting for {rid}")
        raise typer.Exit(EXIT_TIMEOUT)
    _print(result)
    raise typer.Exit(result_exit([result]))


@app.command()
def get(
    ctx: typer.Context, request_id: Annotated[str, typer.Argument(help="The request id.")]
) -> None:
    """Print a result's JSON if it is written (exit 3 when not yet)."""
    o = opts(ctx)
    with guard(), client_for(o) as client:
        result = client.get(request_id)
    if result is None:
        err.print(f"no result yet for {request_id}")
        raise typer.Exit(EXIT_TIMEOUT)
    _print(result)
    raise typer.Exit(result_exit([result]))


@app.command("wait")
def wait_cmd(
    ctx: typer.Context,
    request_ids: Annotated[list[str], typer.Argument(help="One or more request ids.")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for all of them.")] = 60.0,
    from_topic: FromTopicOpt = None,
    since: SinceOpt = 3_600.0,
) -> None:
    """Wait for results; prints one result JSON per line as they are all in (input order)."""
    o = opts(ctx)
    with guard():
        if from_topic:
            reader = _topic_results(o, from_topic)
            since_ms = int((time.time() - since) * 1000)
            found = reader.wait(request_ids, timeout, since_ms=since_ms)
            reader.close()
        else:
            with client_for(o) as client:
                found = client.wait_many(request_ids, timeout=timeout)
    for rid in request_ids:
        result = found.get(rid)
        if result is None:
            err.print(f"[yellow]timed out[/]: no result for {rid}")
        else:
            _print(result)
    raise typer.Exit(result_exit([found.get(rid) for rid in request_ids]))


def main() -> None:
    app(args=bare_tool_loop(sys.argv[1:]), prog_name="qbatch")


if __name__ == "__main__":
    main()
