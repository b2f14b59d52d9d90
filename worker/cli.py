"""`qbatch-worker`: every setting is a flag and a `QBATCH_*` environment variable.

Flags win over the environment. `qbatch-worker --help` lists them all with
their defaults; they are declared once, in `worker.config.WorkerSettings`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from pydantic import ValidationError
from pydantic_settings import SettingsConfigDict

from worker import health, logs
from worker.config import WorkerSettings


class WorkerCli(WorkerSettings):
    model_config = SettingsConfigDict(
        env_prefix="QBATCH_",
        extra="ignore",
        frozen=True,
        cli_parse_args=True,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        cli_avoid_json=True,
        cli_prog_name="qbatch-worker",
        cli_use_class_docs_for_groups=False,
    )


def load_settings(argv: list[str] | None = None) -> WorkerSettings:
    if argv is None:
        argv = sys.argv[1:]
    cli = WorkerCli(_cli_parse_args=argv)
    return WorkerSettings.model_validate(cli.model_dump())


EXIT_FAULT = 70  # as worker.service.EXIT_FAULT (not imported: the service pulls heavy deps)
EXIT_BAD_SETTINGS = 2
EXIT_STOP_OVERRAN = 3
"""SIGTERM (or a fault) asked for a stop and the drain overran drain_timeout_s plus
STOP_MARGIN_S: the process ends anyway, its unfinished records redelivered elsewhere."""
STOP_MARGIN_S = 30.0


def _backstop(timeout_s: float, fault: Callable[[], str | None] = lambda: None) -> None:
    """Ends the process if a stop does not complete in time, whatever is stuck; with the
    fault's exit status when a fault asked for the stop."""

    def fire() -> None:
        reason = fault()
        logs.log.error("stop_overran", limit_s=timeout_s, fault=reason)
        sys.stderr.flush()
        os._exit(EXIT_FAULT if reason else EXIT_STOP_OVERRAN)

    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except ValidationError as exc:
        print(f"qbatch-worker: bad settings:\n{exc}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    logs.configure(settings.log_level, settings.log_format)
    from worker.engines import build_engine
    from worker.service import WorkerState, build_worker

    state = WorkerState()
    if settings.metrics_port:
        # Up before the model loads (minutes on a GPU): liveness answers at once,
        # readiness says "not yet" until the engine is ready.
        try:
            health.serve(state, settings.metrics_host, settings.metrics_port)
        except OSError as exc:
            print(
                f"qbatch-worker: cannot serve metrics on {settings.metrics_host}:"
                f"{settings.metrics_port}: {exc.strerror or exc} (set --metrics-port, "
                "0 disables)",
                file=sys.stderr,
            )
            return EXIT_BAD_SETTINGS
    engine = build_engine(settings)
    # Start the engine before any Kafka client exists: vLLM forks its engine
    # processes, and forking after kafka-python's I/O threads start is unsafe.
    engine.start()
    worker = build_worker(settings, engine, state=state)
    limit = settings.drain_timeout_s + STOP_MARGIN_S
    armed = threading.Event()

    def arm() -> None:
        if not armed.is_set():
            armed.set()
            _backstop(limit, lambda: worker.state.fault)

    def _stop(signum: int, _frame: FrameType | None) -> None:
        logs.log.info("signal_received", signal=signal.Signals(signum).name)
        worker.request_stop()
        arm()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    worker.on_stop = arm
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
