"""Per-tenant usage (issue 17, part 3): what one result counts, the day it counts on, the
Redis hash read back, the `qbatch usage` table, and the server's metrics counting a
result only when Redis counted it for the first time."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prometheus_client import generate_latest
from rich.console import Console

from producer.cli_usage import usage_table
from producer.serve.metrics import UsageRecorder
from producer.usage import (
    UsageRow,
    counts_as_usage,
    last_days,
    parse_hash,
    result_day,
    result_usage,
)
from schemas import ResultEnvelope

JAN_2_NOON = int(datetime(2026, 1, 2, 12, tzinfo=UTC).timestamp())


def result(
    rid: str = "r1", *, ok: bool = True, reasoning: int | None = 3, finished: int | None = None
) -> ResultEnvelope:
    usage: dict[str, Any] = {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    data: dict[str, Any] = {
        "request_id": rid,
        "status": "succeeded" if ok else "failed",
        "worker": {"id": "w", "model": "served-model"},
        "timings": {"finished": finished},
    }
    if ok:
        data["response"] = {
            "id": "x",
            "created": 1,
            "model": "qwen",
            "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
            "usage": usage,
        }
    else:
        data["error"] = {"code": "engine_error", "message": "boom"}
    return ResultEnvelope.model_validate(data)


def test_a_result_counts_one_request_and_its_tokens() -> None:
    assert result_usage(result()) == (
        "qwen",
        {"requests": 1, "prompt_tokens": 10, "completion_tokens": 7, "reasoning_tokens": 3},
    )
    assert result_usage(result(reasoning=None))[1]["reasoning_tokens"] == 0
    model, counts = result_usage(result(ok=False))
    assert model == "served-model" and counts["requests"] == 1 and counts["prompt_tokens"] == 0
    refused = result(ok=False).model_copy(update={"worker": None})  # a bad line, never sent
    assert counts_as_usage(result(ok=False)) and not counts_as_usage(refused)


def test_the_day_is_the_results_own_finish_time_in_ms_or_s() -> None:
    assert result_day(result(finished=JAN_2_NOON * 1000)) == "2026-01-02"
    assert result_day(result(finished=JAN_2_NOON)) == "2026-01-02"
    assert result_day(result(finished=None), now=JAN_2_NOON + 86_400) == "2026-01-03"
    assert last_days(3, now=JAN_2_NOON) == ["2026-01-02", "2026-01-01", "2025-12-31"]


def test_a_usage_hash_reads_back_as_rows_by_model() -> None:
    fields = {
        b"requests:org/model:v1": b"2",
        b"prompt_tokens:org/model:v1": b"20",
        b"requests:qwen": b"1",
        b"bogus:qwen": b"9",
        b"requests:": b"4",
    }
    rows = parse_hash("team-a", "2026-01-02", fields)
    assert [(r.model, r.counts["requests"], r.counts["prompt_tokens"]) for r in rows] == [
        ("org/model:v1", 2, 20),
        ("qwen", 1, 0),
    ]


def test_the_usage_table_shows_rows_and_totals() -> None:
    counts = {"requests": 2, "prompt_tokens": 1500, "completion_tokens": 7, "reasoning_tokens": 1}
    rows = [UsageRow("team-a", "2026-01-02", "qwen", counts)] * 2
    console = Console(width=140, record=True)
    console.print(usage_table(rows))
    text = console.export_text()
    assert text.count("team-a") == 2 and "1,500" in text and "3,000" in text
    assert "total" in text and "reasoning" in text


class OnceStore:
    """What `UsageStore.record` answers: the counts the first time, None after."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def record(self, tenant: str, res: ResultEnvelope) -> tuple[str, dict[str, int]] | None:
        if res.request_id in self.seen:
            return None
        self.seen.add(res.request_id)
        return result_usage(res)


class BrokenStore:
    def record(self, tenant: str, res: ResultEnvelope) -> None:
        raise ConnectionError("redis down")


def test_metrics_count_a_result_once_and_a_redis_error_does_not_raise() -> None:
    recorder = UsageRecorder(OnceStore())  # type: ignore[arg-type]
    for rid in ("r1", "r1", "r2"):
        recorder("team-a", result(rid))
    text = generate_latest(recorder.registry).decode()
    assert 'qbatch_serve_usage_requests_total{model="qwen",tenant="team-a"} 2.0' in text
    assert (
        'qbatch_serve_usage_tokens_total{kind="prompt",model="qwen",tenant="team-a"} 20.0' in text
    )
    assert (
        'qbatch_serve_usage_tokens_total{kind="reasoning",model="qwen",tenant="team-a"} 6.0' in text
    )
    UsageRecorder(BrokenStore())("team-a", result())  # type: ignore[arg-type]
