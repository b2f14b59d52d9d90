"""structlog set-up: one JSON object per line, so log shippers need no parsing rules.

The libraries' own stdlib logging (kafka-python, urllib3, ...) goes through the same
renderer, so every line on stderr has one format, and is rate-limited: with Kafka down,
kafka-python repeats the same ERROR every ~2 s; the first goes through, later ones of
the same logger and message are held back for `RATE_LIMIT_S` and then reported once
with `repeated=N`. qbatch's own lines say what is wrong in plain words
("kafka_unreachable", "redis_unavailable") instead.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import structlog

RATE_LIMIT_S = 30.0


class RepeatFilter(logging.Filter):
    """Lets the first of identical records (same logger, level and message template)
    through, then at most one per `interval_s`, carrying how many were held back."""

    def __init__(
        self, interval_s: float = RATE_LIMIT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        with self._lock:
            last, held = self._seen.get(key, (float("-inf"), 0))
            if now - last < self.interval_s:
                self._seen[key] = (last, held + 1)
                return False
            self._seen[key] = (now, 0)
        if held:
            record.repeated = held
        return True


def _repeated(_: object, __: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
    held = getattr(event.get("_record"), "repeated", None)
    if held:
        event["repeated"] = held
    return event


def configure(level: str = "info", fmt: str = "json") -> None:
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                *shared,
                structlog.stdlib.add_logger_name,
                _repeated,
                structlog.stdlib.ExtraAdder(allow=()),
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    # Opt-in, for chasing client defects (tests/reliability/README.md): kafka-python at
    # DEBUG, with timestamps, to a file; SIGUSR1 dumps every thread's stack to stderr.
    debug_log = os.environ.get("QBATCH_KAFKA_DEBUG_LOG")
    if debug_log:
        file_handler = logging.FileHandler(debug_log)
        file_handler.setFormatter(
            logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
        )
        kafka_log = logging.getLogger("kafka")
        kafka_log.setLevel(logging.DEBUG)
        kafka_log.addHandler(file_handler)
        kafka_log.propagate = False
        warnings = logging.StreamHandler(sys.stderr)
        warnings.setLevel(logging.WARNING)
        warnings.setFormatter(handler.formatter)
        warnings.addFilter(RepeatFilter())
        kafka_log.addHandler(warnings)
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


log = structlog.get_logger("qbatch.worker")
