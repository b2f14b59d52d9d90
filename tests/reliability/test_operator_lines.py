"""What an operator sees when a dependency is missing at start: one plain qbatch line,
every stderr line in the worker's format, the libraries' repeats rate-limited, and a
readiness probe that says why."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.reliability.conftest import EnvLane, free_port, make_lane, wait_http


def _lines(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(errors="replace")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_kafka_down_at_start(lane: EnvLane, spawn: Any, tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    down = make_lane("qbdown", dead, lane.redis_url)
    port = free_port()
    worker = spawn(down, "--drain-timeout-s", "2", name="kafka-down", metrics_port=port)
    wait_http(port)
    time.sleep(8)
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)
        ready: dict[str, Any] = {"ok": True}
    except urllib.error.HTTPError as exc:
        ready = json.loads(exc.read())
    assert worker.poll() is None
    lines = _lines(tmp_path / "kafka-down.log")  # every line parses: one format
    ours = [x for x in lines if x["event"] == "kafka_unreachable"]
    assert len(ours) == 1 and ours[0]["message"] == f"waiting for Kafka at {dead}"
    theirs = [x for x in lines if x.get("logger", "").startswith("kafka")]
    by_message = {x["event"] for x in theirs}
    assert len(theirs) <= 2 * len(by_message)  # each distinct message at most ~once per 30 s
    assert ready["ok"] is False and ready["kafka_ok"] is False
    started = time.monotonic()
    worker.terminate()
    worker.wait(30)
    assert time.monotonic() - started < 15
