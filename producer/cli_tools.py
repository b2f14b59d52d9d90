"""`qbatch tools`: run the tool executor, list a registry's tools.

`qbatch tools serve --registry myapp.tools:registry [--config tools.yaml]` runs the
executor of tool loops (see worker/tool_executor.py); it needs the worker extra
(`pip install 'qbatch[worker]'`) for its logging, metrics and HTTP tools.
`qbatch tools list` prints the OpenAI `tools` list a request should offer.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from producer.cli_common import EXIT_USAGE, Options, err, opts, usage_error

if TYPE_CHECKING:
    from worker.tool_loop.registry import ToolRegistry

tools_app = typer.Typer(
    help="The tool loop's executor: run the model's tool calls and continue the loop.",
    no_args_is_help=True,
)

RegistryOpt = Annotated[
    str | None,
    typer.Option("--registry", help="A ToolRegistry to run, as module:attribute."),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", help="HTTP tools from a YAML or JSON file (added to --registry)."),
]


def build_registry(ref: str | None, config: Path | None) -> ToolRegistry:
    """--registry and/or --config -> one registry (usage errors name the flag)."""
    if ref is None and config is None:
        raise usage_error("give --registry module:attribute and/or --config tools.yaml")
    from worker.tool_loop.registry import ToolRegistry, load_registry

    sys.path.insert(0, ".")  # `--registry myapp.tools:registry` from the current directory
    try:
        registry = load_registry(ref) if ref else ToolRegistry()
        if config is not None:
            registry.load_config(str(config))
    except (ImportError, AttributeError, TypeError, ValueError, OSError) as exc:
        raise usage_error(f"cannot load the tools: {type(exc).__name__}: {exc}") from None
    return registry


def executor_settings(o: Options, **overrides: Any) -> Any:
    """ExecutorSettings from the environment, the global flags and `overrides`."""
    try:
        from worker.tool_loop.executor import ExecutorSettings
    except ImportError as exc:
        err.print(f"[red]error:[/] the executor needs qbatch[worker] installed ({exc})")
        raise typer.Exit(EXIT_USAGE) from None
    given = {
        "kafka_bootstrap": o.bootstrap,
        "redis_url": o.redis_url,
        "topic": o.topic,
        "prefix": o.prefix,
        **overrides,
    }
    try:
        return ExecutorSettings(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        raise usage_error(f"bad settings: {exc}") from None


@contextlib.contextmanager
def embedded_executor(o: Options, registry: ToolRegistry, **overrides: Any) -> Iterator[None]:
    """An executor on a thread for the length of the block (`bulk run --tool-loop`)."""
    from worker import logs
    from worker.tool_loop.executor import ToolExecutor

    logs.configure("warning")
    executor = ToolExecutor(executor_settings(o, **overrides), registry)
    thread = threading.Thread(target=executor.run, name="qbatch-tools", daemon=True)
    thread.start()
    try:
        yield
    finally:
        executor.request_stop()
        thread.join(timeout=30)


@tools_app.command("serve")
def tools_serve(
    ctx: typer.Context,
    registry: RegistryOpt = None,
    config: ConfigOpt = None,
    group: Annotated[
        str | None, typer.Option("--group", help="Consumer group (QBATCH_TOOLS_GROUP).")
    ] = None,
    tool_calls_topic: Annotated[
        str | None,
        typer.Option("--tool-calls-topic", help="Topic of turns (QBATCH_TOOL_CALLS_TOPIC)."),
    ] = None,
    max_batch: Annotated[
        int | None, typer.Option("--max-batch", help="Turn events per poll (default 256).")
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", help="/metrics, /healthz, /readyz (9101; 0: off)."),
    ] = None,
    log_format: Annotated[
        str | None, typer.Option("--log-format", help="json (default) or console.")
    ] = None,
) -> None:
    """Consume tool-loop turns, run their calls, publish the continuations. Scale it by
    starting more processes with the same --group."""
    o = opts(ctx)
    tools = build_registry(registry, config)
    settings = executor_settings(
        o,
        tools_group=group,
        tool_calls_topic=tool_calls_topic,
        tools_max_batch=max_batch,
        tools_metrics_port=metrics_port,
        log_format=log_format,
    )
    from worker import health, logs
    from worker.metrics import TOOLS_REGISTRY
    from worker.tool_loop.executor import ExecutorState, ToolExecutor

    logs.configure(settings.log_level, settings.log_format)
    state = ExecutorState()
    if settings.tools_metrics_port:
        try:
            health.serve(
                state, settings.tools_metrics_host, settings.tools_metrics_port, TOOLS_REGISTRY
            )
        except OSError as exc:
            port = settings.tools_metrics_port
            raise usage_error(f"cannot serve metrics on port {port}: {exc}") from None
    executor = ToolExecutor(settings, tools, state=state)

    def stop(signum: int, _frame: FrameType | None) -> None:
        logs.log.info("signal_received", signal=signal.Signals(signum).name)
        executor.request_stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    raise typer.Exit(executor.run())


@tools_app.command("list")
def tools_list(registry: RegistryOpt = None, config: ConfigOpt = None) -> None:
    """Print the OpenAI `tools` list of the registry (what a request should offer)."""
    tools = build_registry(registry, config)
    sys.stdout.write(json.dumps(tools.openai_tools(), indent=2) + "\n")
