"""structlog set-up: one JSON object per line, so log shippers need no parsing rules."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys

import structlog


def configure(level: str = "info", fmt: str = "json") -> None:
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # Opt-in, for chasing client defects (tests/reliability/README.md): kafka-python at
    # DEBUG, with timestamps, to a file; SIGUSR1 dumps every thread's stack to stderr.
    debug_log = os.environ.get("QBATCH_KAFKA_DEBUG_LOG")
    if debug_log:
        handler = logging.FileHandler(debug_log)
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
        )
        kafka_log = logging.getLogger("kafka")
        kafka_log.setLevel(logging.DEBUG)
        kafka_log.addHandler(handler)
        kafka_log.propagate = False
        warnings = logging.StreamHandler(sys.stderr)
        warnings.setLevel(logging.WARNING)
        kafka_log.addHandler(warnings)
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


log = structlog.get_logger("qbatch.worker")
