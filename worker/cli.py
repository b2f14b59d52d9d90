"""`qbatch-worker`: every setting is a flag and a `QBATCH_*` environment variable.

Flags win over the environment. `qbatch-worker --help` lists them all with
their defaults; they are declared once, in `worker.config.WorkerSettings`.
"""

from __future__ import annotations

import signal
import sys
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


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except ValidationError as exc:
        print(f"qbatch-worker: bad settings:\n{exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    from worker.engines import build_engine
    from worker.kafka_io import DeadLetters, RequestConsumer
    from worker.redis_io import RedisReplies
    from worker.service import Worker, WorkerState

    state = WorkerState()
    if settings.metrics_port:
        # Up before the model loads (minutes on a GPU): liveness answers at once,
        # readiness says "not yet" until the engine is ready.
        health.serve(state, settings.metrics_host, settings.metrics_port)
    engine = build_engine(settings)
    # Start the engine before any Kafka client exists: vLLM forks its engine
    # processes, and forking after kafka-python's I/O threads start is unsafe.
    engine.start()
    worker = Worker(
        settings,
        engine,
        RequestConsumer(settings),
        RedisReplies.from_url(settings.redis_url, settings.keys, **settings.redis_kwargs()),
        DeadLetters(settings) if settings.dead_letter else None,
        state=state,
    )

    def _stop(signum: int, _frame: FrameType | None) -> None:
        logs.log.info("signal_received", signal=signal.Signals(signum).name)
        worker.request_stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
