"""Third-party log lines: one format with qbatch's own, and rate-limited."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from worker.logs import RepeatFilter


def record(msg: str, name: str = "kafka.net.manager") -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, ("ECONNREFUSED",), None)


def test_repeats_are_held_back_and_counted() -> None:
    now = [0.0]
    flt = RepeatFilter(30.0, clock=lambda: now[0])
    assert flt.filter(record("Connection failed: %s"))
    for t in (2.0, 4.0, 6.0):
        now[0] = t
        assert not flt.filter(record("Connection failed: %s"))
    assert flt.filter(record("Metadata refresh: failed %s"))  # another message passes
    now[0] = 31.0
    again = record("Connection failed: %s")
    assert flt.filter(again) and again.repeated == 3  # type: ignore[attr-defined]


def test_library_lines_are_json_like_ours_and_rate_limited() -> None:
    code = (
        "import logging\n"
        "from worker import logs\n"
        "logs.configure('info', 'json')\n"
        "for _ in range(20): logging.getLogger('kafka.net.manager').error('Connection failed: %s', 'x')\n"
        "logs.log.info('ours', n=1)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert [line["event"] for line in lines] == ["Connection failed: x", "ours"]
    assert lines[0]["logger"] == "kafka.net.manager" and lines[0]["level"] == "error"
