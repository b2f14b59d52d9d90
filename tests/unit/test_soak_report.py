"""The chaos soak's socket-free verdicts (tests/reliability/soak_report.py) on made-up runs."""

from __future__ import annotations

import json
import math

from tests.reliability.soak_report import job_verdict, recovery_times, statuses_of


def result(status: str) -> bytes:
    return json.dumps({"status": status}).encode()


def test_a_job_whose_books_match_its_results_passes() -> None:
    results = {"j.1": result("succeeded"), "j.2": result("succeeded"), "j.3": result("cancelled")}
    row, problems = job_verdict(
        "j",
        3,
        {"status": "cancelled", "total": "3", "succeeded": "2", "cancelled": "1"},
        3,
        statuses_of(results),
    )
    assert problems == []
    assert row == {
        "status": "cancelled",
        "succeeded": 2,
        "failed": 0,
        "expired": 0,
        "cancelled": 1,
        "stream": 3,
    }


def test_every_way_a_jobs_books_can_be_wrong_is_named() -> None:
    results = {"j.1": result("succeeded"), "j.2": result("failed"), "other.1": result("failed")}
    # a counter short of the results, a total off by one, a stream entry missing
    _, problems = job_verdict("j", 2, {"total": "3", "succeeded": "1"}, 1, statuses_of(results))
    assert len(problems) == 3
    assert "counters" in problems[0] and "'failed': 1" in problems[0]
    assert problems[1] == "job j: total 3 counted 1"
    assert problems[2] == "job j: stream holds 1 entries for 2 lines"


def test_a_line_without_a_result_is_a_counter_mismatch() -> None:
    _, problems = job_verdict(
        "j", 2, {"total": "2", "succeeded": "2"}, 2, statuses_of({"j.1": result("succeeded")})
    )
    assert problems == [
        "job j: counters {'succeeded': 2, 'failed': 0, 'expired': 0, 'cancelled': 0} but results {'succeeded': 1}"
    ]


def test_recovery_counts_only_requests_published_before_the_fault() -> None:
    published = {"a": 1.0, "b": 4.0, "late": 12.0}
    first_seen = {"a": 2.0, "b": 15.5, "late": 40.0}  # "late" came after the fault began
    times = recovery_times([("broker_kill", 10.0, 13.0)], published, first_seen)
    assert times == {
        "broker_kill": {
            "from_start_p50": 5.5,
            "from_start_max": 5.5,
            "after_end_p50": 2.5,
            "after_end_max": 2.5,
        }
    }


def test_recovery_summarises_each_kind_over_its_faults() -> None:
    published = {"a": 0.0}
    first_seen = {"a": 30.0}
    applied = [
        ("worker_kill", 10.0, 12.0),  # answered 20 s after the start, 18 after the end
        ("worker_kill", 28.0, 29.0),  # 2 s after the start, 1 after the end
        ("worker_kill", 35.0, 36.0),  # answered before it began: 0
        ("master_kill", 5.0, -1.0),  # never undone: left out
    ]
    times = recovery_times(applied, published, first_seen)
    assert times == {
        "worker_kill": {
            "from_start_p50": 2.0,
            "from_start_max": 20.0,
            "after_end_p50": 1.0,
            "after_end_max": 18.0,
        }
    }


def test_a_request_never_answered_makes_recovery_infinite() -> None:
    times = recovery_times([("redis_slow", 5.0, 6.0)], {"a": 1.0}, {})
    assert math.isinf(times["redis_slow"]["from_start_max"])


def test_a_fault_before_any_request_recovers_at_once() -> None:
    times = recovery_times([("worker_stop", 1.0, 2.0)], {"a": 3.0}, {"a": 4.0})
    assert times["worker_stop"] == {
        "from_start_p50": 0.0,
        "from_start_max": 0.0,
        "after_end_p50": 0.0,
        "after_end_max": 0.0,
    }
