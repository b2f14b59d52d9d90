"""Scenario 3: poison records (20 kinds) mixed at 10% into good traffic.

Every good request succeeds; every bad one is answered with the right status, code
and field, or (when no request_id can be recovered) only dead-lettered; nothing
stalls a partition (committed offsets reach the log end).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from typing import Any

import pytest
import redis

from tests.reliability.conftest import (
    EnvLane,
    chat,
    dlq_count,
    dlq_sources,
    figures,
    produce,
    wait_committed,
    wait_results,
)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}  # fmt: skip


def j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def with_tool_parameters(rid: str, parameters: dict[str, Any]) -> tuple[bytes, bytes]:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    return rid.encode(), j(chat(rid, "x", body={"tools": [tool]}))


# kind -> (make(rid) -> (key, value), expected). expected: (status, code, param) for an
# answered record, None for a record with no recoverable id (dead letter only),
# "dup" for a duplicate of a good request (no second result).
Make = Callable[[str], tuple[bytes | None, bytes]]
KINDS: dict[str, tuple[Make, Any, bool]] = {
    # name: (make, expected, dead-lettered)
    "not_json": (
        lambda r: (r.encode(), b"{not json"),
        ("failed", "invalid_request", "(envelope)"),
        True,
    ),
    "array": (lambda r: (r.encode(), b"[1, 2]"), ("failed", "invalid_request", "(envelope)"), True),
    "latin1": (
        lambda r: (r.encode(), f'{{"request_id": "{r}", "x": "\xe9"}}'.encode("latin-1")),
        ("failed", "invalid_request", "(envelope)"),
        True,
    ),
    "empty_value": (lambda r: (r.encode(), b""), ("failed", "invalid_request", "(envelope)"), True),
    "unknown_field": (
        lambda r: (r.encode(), j({**chat(r, "x"), "colour": "red"})),
        ("failed", "invalid_request", "colour"),
        True,
    ),
    "misspelt_body_field": (
        lambda r: (r.encode(), j(chat(r, "x", body={"max_token": 5}))),
        ("failed", "invalid_request", "body.max_token"),
        True,
    ),
    "bad_role": (
        lambda r: (
            r.encode(),
            j({"request_id": r, "body": {"messages": [{"role": "robot", "content": "x"}]}}),
        ),
        ("failed", "invalid_request", "body.messages[0]"),
        True,
    ),
    "bad_tool_schema": (
        lambda r: with_tool_parameters(
            r, {"type": "object", "properties": {"a": {"type": "nonsense"}}}
        ),
        ("failed", "invalid_request", "body.tools[0].function.parameters"),
        True,
    ),
    "tool_msg_no_id": (
        lambda r: (
            r.encode(),
            j(
                {
                    "request_id": r,
                    "body": {
                        "messages": [
                            {"role": "user", "content": "x"},
                            {"role": "tool", "content": "r"},
                        ]
                    },
                }
            ),
        ),
        ("failed", "invalid_request", "body.messages[1].tool_call_id"),
        True,
    ),
    "negative_max_tokens": (
        lambda r: (r.encode(), j(chat(r, "x", body={"max_tokens": -1}))),
        ("failed", "invalid_request", "body.max_tokens"),
        True,
    ),
    "huge_max_tokens": (
        lambda r: (r.encode(), j(chat(r, "x", body={"max_tokens": 10**9}))),
        ("failed", "invalid_request", "body.max_tokens"),
        True,
    ),
    "n_over_bound": (
        lambda r: (r.encode(), j(chat(r, "x", body={"n": 17}))),
        ("failed", "invalid_request", "body.n"),
        True,
    ),
    "version_2": (
        lambda r: (r.encode(), j({**chat(r, "x"), "v": 2})),
        ("failed", "invalid_request", "v"),
        True,
    ),
    "key_mismatch": (
        lambda r: (b"other-" + r.encode(), j(chat(r, "x"))),
        ("failed", "invalid_request", "request_id"),
        True,
    ),
    "tool_choice_unknown": (
        lambda r: (
            r.encode(),
            j(
                chat(
                    r,
                    "x",
                    body={
                        "tools": [TOOL],
                        "tool_choice": {"type": "function", "function": {"name": "nope"}},
                    },
                )
            ),
        ),
        ("failed", "invalid_request", "body"),
        True,
    ),
    "unknown_model": (
        lambda r: (r.encode(), j(chat(r, "x", body={"model": "gpt-17"}))),
        ("failed", "unknown_model", None),
        True,
    ),
    "context_overflow": (
        lambda r: (r.encode(), j(chat(r, " ".join(["word"] * 300), body={"max_tokens": 100}))),
        ("failed", "context_length_exceeded", None),
        True,
    ),
    "expired_deadline": (
        lambda r: (r.encode(), j(chat(r, "x", deadline="2020-01-01T00:00:00Z"))),
        ("expired", "deadline_exceeded", None),
        False,
    ),
    "oversize": (
        lambda r: (r.encode(), j(chat(r, "x" * 1_001_000))),
        ("failed", "invalid_request", "(envelope)"),
        True,
    ),
    # issue 22: records that used to stop the worker for good (or strand a job)
    "huge_integer": (
        lambda r: (r.encode(), j(chat(r, "x")).replace(b'"x"}]', b'"x"}], "seed": ' + b"9" * 5000)),
        ("failed", "invalid_request", "(envelope)"),
        True,
    ),
    "huge_integer_metadata": (
        lambda r: (
            r.encode(),
            j(chat(r, "x", metadata={"n": 1})).replace(b'"n": 1', b'"n": ' + b"9" * 5000),
        ),
        ("failed", "invalid_request", "(envelope)"),
        True,
    ),
    "deep_nesting": (
        lambda r: (
            r.encode(),
            j(chat(r, "x", metadata={"n": 1})).replace(
                b'"n": 1', b'"n": ' + b"[" * 50_000 + b"]" * 50_000
            ),
        ),
        ("failed", "invalid_request", "(envelope)"),
        True,
    ),
    "overflowing_pattern": (
        lambda r: with_tool_parameters(
            r,
            {
                "type": "object",
                "properties": {"a": {"type": "string", "pattern": "a{99999999999}"}},
            },
        ),
        ("failed", "invalid_request", "body.tools[0].function.parameters"),
        True,
    ),
    "reserved_job_suffix": (
        lambda r: (r.encode(), j(chat(r, "x", job_id="vic:done"))),
        ("failed", "invalid_request", "job_id"),
        True,
    ),
    # no recoverable request_id: dead letter only
    "bad_request_id_no_key": (lambda r: (None, j(chat("bad id! " + r, "x"))), None, True),
    "garbage_no_key": (lambda r: (None, b"\x00\x01\xfe garbage " + r.encode()), None, True),
    "empty_no_key": (lambda r: (None, b""), None, True),
    "bad_key_and_id": (
        lambda r: (b"bad key/" + r.encode(), j({"request_id": "*", "body": {}})),
        None,
        True,
    ),
}
CAPPED = {"oversize": 3, "deep_nesting": 3}  # large records: a few are enough


def run_poison(lane: EnvLane, r: redis.Redis, spawn: Any, n_good: int) -> None:
    n_bad = n_good // 9  # 10% of all records
    kinds = list(KINDS)
    bad: list[tuple[str, str]] = []  # (rid, kind)
    records: list[tuple[bytes | None, bytes]] = []
    good = [chat(f"pg{i}", f"fine {i}") for i in range(n_good)]
    per_kind: collections.Counter[str] = collections.Counter()
    duplicates = 0
    k = 0
    for i, env in enumerate(good):
        records.append((env["request_id"].encode(), j(env)))
        if i % 9 == 8 and len(bad) + duplicates < n_bad:
            kind = kinds[k % len(kinds)]
            k += 1
            if per_kind[kind] >= CAPPED.get(kind, 10**9):
                kind = "not_json"
            if k % (len(kinds) + 1) == 0:  # a duplicate of an earlier good request
                records.append((good[i - 5]["request_id"].encode(), j(good[i - 5])))
                duplicates += 1
                continue
            rid = f"pb{i}"
            per_kind[kind] += 1
            bad.append((rid, kind))
            records.append(KINDS[kind][0](rid))
    produce(lane, records)
    worker = spawn(lane, "--max-model-len", "256", "--max-inflight", "1024")
    good_ids = [e["request_id"] for e in good]
    answered = [(rid, kind) for rid, kind in bad if KINDS[kind][1] is not None]
    results = wait_results(r, lane.prefix, good_ids + [rid for rid, _ in answered], 180)
    assert wait_committed(lane, 60), "a partition stalled: committed offsets below the log end"
    expected_dlq = sum(1 for _, kind in bad if KINDS[kind][2])
    dead = dlq_count(lane, timeout=30)
    assert worker.poll() is None
    unique_dead = dlq_sources(dead)
    by_code = collections.Counter(
        (res.get("error") or {}).get("code", "ok") for res in results.values()
    )
    figures(
        f"poison_{n_good}",
        good=n_good,
        bad=len(bad),
        duplicates=duplicates,
        kinds=len(per_kind),
        good_succeeded=sum(
            1 for rid in good_ids if results.get(rid, {}).get("status") == "succeeded"
        ),
        bad_answered=sum(1 for rid, _ in answered if rid in results),
        bad_id_less=len(bad) - len(answered),
        by_code=dict(by_code),
        dlq=len(dead),
        dlq_unique=len(unique_dead),
        dlq_expected=expected_dlq,
    )
    assert len(per_kind) >= 20
    for rid in good_ids:
        assert results[rid]["status"] == "succeeded", results.get(rid)
    for rid, kind in answered:
        res = results.get(rid)
        assert res is not None, f"{kind} {rid}: no result"
        status, code, param = KINDS[kind][1]
        assert res["status"] == status, (kind, res)
        assert res["error"]["code"] == code, (kind, res["error"])
        if param is not None:
            assert res["error"]["param"] == param, (kind, res["error"])
    # at-least-once: a record redelivered after a rebalance is dead-lettered again
    assert len(unique_dead) == expected_dlq
    # duplicates were not answered twice
    for env in good[:200]:
        assert r.llen(f"{lane.prefix}:done:{env['request_id']}") == 1


def test_poison_mix_2k(lane: EnvLane, redis_client: redis.Redis, spawn: Any) -> None:
    run_poison(lane, redis_client, spawn, 2_000)


@pytest.mark.slow
def test_poison_mix_10k(lane: EnvLane, redis_client: redis.Redis, spawn: Any) -> None:
    run_poison(lane, redis_client, spawn, 10_000)
