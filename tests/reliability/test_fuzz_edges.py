"""Scenario 4, continued: fuzzing the tool executor's and `qbatch serve`'s edges
(hypothesis), as `test_fuzz.py` fuzzes the worker's (issue 40).

* **Executor**: tool-turn events as bytes: arbitrary, and VALID events (a first turn and
  a second one carrying a transcript) mutated at any depth, with calls multiplied past
  MAX_TOOLS and arguments of zero-width characters. The executor's own pure path runs
  them (`ToolTurnEvent` decode -> `malformed_answer` | `pending_calls` -> `run_calls` ->
  `next_envelope`): nothing escapes, and every outcome is an envelope a worker decodes
  (`decode_request`), for the same request, under MAX_ENVELOPE_BYTES, with `loop` set
  (its `abort` when the loop could not go on). One exception there once stopped every
  executor, at every restart.
* **Serve, batch input**: byte streams of OpenAI Batch lines, valid and mutated, junk,
  bad UTF-8, deep nesting, lines over the envelope limit, cut at random chunk borders,
  through the server's own streaming check (`scan_stream` + `InputCheck`): never raises,
  the error list stays within its caps, every entry is `{code, line, message, param}`,
  and a file without errors has only valid lines.
* **Serve, sync body**: `run_sync` on mutated chat bodies and arbitrary JSON with a client
  whose `submit` is the real one up to publishing: an `ApiError` of 4xx (or the 504 of no
  answer) or a JSON answer; nothing else.

The fast variants (~200-300 examples each) run in CI; `-m slow` runs 5,000 each.
"""

from __future__ import annotations

import collections
import copy
import json
from typing import Any

import anyio
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import ValidationError

from producer.bulk import Defaults
from producer.client import QBatchClient
from producer.serve.batches import MAX_ERRORS, MAX_ERRORS_BYTES, InputCheck
from producer.serve.errors import ApiError
from producer.serve.sync import run_sync
from producer.stream_scan import scan_stream
from producer.tools import ToolRegistry
from schemas import decode_request, limits
from schemas.decode import encode_request
from schemas.limits import MAX_ENVELOPE_BYTES
from schemas.tool_events import ToolTurnEvent
from tests.reliability.conftest import figures, fuzz_settings
from tests.reliability.test_fuzz import _get, _paths, json_values
from tests.unit.test_tool_loop_logic import envelope, record, result
from worker.tool_loop.answers import malformed_answer, next_envelope
from worker.tool_loop.continuation import continuation, pending_calls
from worker.tool_loop.routing import route
from worker.tool_loop.runner import run_calls

STATS: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _print_figures() -> Any:
    yield
    figures("fuzz_edges", **dict(sorted(STATS.items())))


FAST = fuzz_settings(250)
LONG = fuzz_settings(5_000)

# ------------------------------------------------------------------ executor

REGISTRY = ToolRegistry()


@REGISTRY.tool(timeout_s=2)
def f(a: int) -> dict[str, object]:
    """The tool the base events call (tests/unit/test_tool_loop_logic.py's CALL)."""
    return {"a": a}


def _base_events() -> list[dict[str, Any]]:
    env = envelope(body={"tool_choice": "required"}, tool_loop={"max_turns": 4})
    first = route(env, result(env, calls=True), lane="bulk", now_ms=7)
    assert isinstance(first, ToolTurnEvent)
    second_env = continuation(first, [record()])
    second = route(second_env, result(second_env, calls=True, n=3), lane="interactive", now_ms=9)
    assert isinstance(second, ToolTurnEvent)
    return [e.model_dump(mode="json", exclude_none=True) for e in (first, second)]


BASE_EVENTS = _base_events()
ZERO_WIDTH = "\u200b"


@st.composite
def mutated_events(draw: st.DrawFn) -> bytes:
    doc: Any = copy.deepcopy(draw(st.sampled_from(BASE_EVENTS)))
    calls = doc["message"]["tool_calls"]
    if draw(st.booleans()):  # more calls than a turn may have, or a handful
        many = draw(st.sampled_from([2, limits.MAX_TOOLS, limits.MAX_TOOLS + 1, 300]))
        doc["message"]["tool_calls"] = [
            {**copy.deepcopy(calls[0]), "id": f"call_{i}"} for i in range(many)
        ]
    if draw(st.booleans()):  # an argument the tool's schema refuses, quoted in its error
        size = draw(st.sampled_from([10, 50_000, 160_000]))
        doc["message"]["tool_calls"][0]["function"]["arguments"] = json.dumps(
            {"a": ZERO_WIDTH * size}, ensure_ascii=False
        )
    for _ in range(draw(st.sampled_from([0, 0, 1, 2, 4]))):  # most stay valid or nearly
        path = draw(st.sampled_from(_paths(doc)))
        if not path:
            continue
        parent, last = _get(doc, path[:-1]), path[-1]
        op = draw(st.sampled_from(["drop", "insert", "replace", "replace"]))
        if op == "drop":
            del parent[last]
        elif op == "insert":
            if isinstance(parent, dict):
                parent[draw(st.text(max_size=10))] = draw(json_values)
            else:
                parent.insert(last, draw(json_values))
        else:
            parent[last] = draw(json_values)
    return json.dumps(doc).encode()


def check_event(raw: bytes) -> None:
    try:
        event = ToolTurnEvent.model_validate_json(raw)
    except ValidationError as exc:
        STATS["executor_malformed"] += 1
        answer = malformed_answer(raw, str(exc)[:300])
        if answer is not None:  # its envelope was readable: answered, aborted
            STATS["executor_malformed_answered"] += 1
            assert answer.loop is not None and answer.loop.abort is not None
            assert decode_request(encode_request(answer)).request_id == answer.request_id
        return
    calls = pending_calls(event)
    records = run_calls(REGISTRY, calls)
    assert len(records) == len(calls)
    env, failure = next_envelope(event, records)
    raw_env = encode_request(env)
    assert len(raw_env) <= MAX_ENVELOPE_BYTES
    decoded = decode_request(raw_env)  # what the worker will read
    assert decoded.request_id == event.request_id and decoded.loop is not None
    if failure is None:
        STATS["executor_continued"] += 1
        assert decoded.loop.abort is None and decoded.loop.turn == event.turn + 1
    else:
        STATS["executor_aborted"] += 1
        assert decoded.loop.abort is not None


@FAST
@given(st.binary(max_size=300))
def test_executor_arbitrary_bytes(raw: bytes) -> None:
    check_event(raw)


NO_TOOL_LOOP_EVENT = (
    b'{"v": 1, "request_id": "r1", "turn": 1, "lane": "bulk", "envelope": {"job_id": "j1", '
    b'"priority": 0, "result_ttl_s": 86400, "metadata": {"team": "t"}, "v": 1, '
    b'"request_id": "r1", "endpoint": "/v1/chat/completions", "body": {"messages": '
    b'[{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
    b'{"name": "f", "parameters": {"type": "object"}}}], "tool_choice": "required"}}, '
    b'"message": {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", '
    b'"function": {"name": "f", "arguments": "{\\"a\\": 1}"}}]}, "usage": '
    b'{"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "emitted_ms": 7}'
)
"""Found by this suite (2026-12-07): an event whose envelope lost `tool_loop` passed as an
event, and the executor published an aborted continuation no worker could read."""
LAST_TURN_EVENT = NO_TOOL_LOOP_EVENT.replace(b'"turn": 1', b'"turn": 3').replace(
    b'"metadata": {"team": "t"}', b'"metadata": {"team": "t"}, "tool_loop": {"max_turns": 3}'
)
"""Found the same day by the long run: an event of a loop's last turn (the worker answers
that turn itself) made a continuation past `tool_loop.max_turns`."""


@FAST
@given(mutated_events())
@example(NO_TOOL_LOOP_EVENT)
@example(LAST_TURN_EVENT)
def test_executor_mutated_valid_events(raw: bytes) -> None:
    check_event(raw)


@pytest.mark.slow
@LONG
@given(mutated_events())
def test_executor_mutated_valid_events_long(raw: bytes) -> None:
    check_event(raw)


def test_the_base_events_continue() -> None:
    """The unmutated events continue (so the fuzz starts from valid input)."""
    for doc in BASE_EVENTS:
        event = ToolTurnEvent.model_validate(doc)
        env, failure = next_envelope(event, run_calls(REGISTRY, pending_calls(event)))
        assert failure is None and env.loop is not None and env.loop.abort is None


# ------------------------------------------------------------------ serve: batch input

ENDPOINT = "/v1/chat/completions"
VALID_LINE: dict[str, Any] = {
    "custom_id": "c1",
    "method": "POST",
    "url": ENDPOINT,
    "body": {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 5,
        "metadata": {"k": "v"},
    },
}
RESULT_BOUND = 1 << 20


@st.composite
def batch_lines(draw: st.DrawFn, index: int) -> bytes:
    kind = draw(
        st.sampled_from(["valid"] * 12 + ["mutated", "mutated", "junk", "deep", "long", "bad8"])
    )
    if kind == "junk":
        return draw(st.binary(max_size=80)).replace(b"\n", b" ")
    if kind == "deep":
        depth = draw(st.sampled_from([50, 5_000, 100_000]))
        return b'{"custom_id": "d", "body": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "long":
        return json.dumps({**VALID_LINE, "custom_id": "x" * (MAX_ENVELOPE_BYTES + 10)}).encode()
    if kind == "bad8":
        return b'{"custom_id": "\xff\xfe", "method": "POST"}'
    doc = copy.deepcopy(VALID_LINE)
    doc["custom_id"] = draw(st.sampled_from([f"c{index}", "c1", "same"]))
    if kind == "mutated":
        for _ in range(draw(st.integers(1, 3))):
            path = draw(st.sampled_from(_paths(doc)))
            if not path:
                continue
            parent, last = _get(doc, path[:-1]), path[-1]
            if draw(st.booleans()):
                del parent[last]
            else:
                parent[last] = draw(json_values | st.sampled_from([10**9, -(2**31), 16, "x"]))
    return json.dumps(doc).encode()


@st.composite
def batch_files(draw: st.DrawFn) -> list[bytes]:
    count = draw(st.integers(0, 8))
    lines = [draw(batch_lines(i)) for i in range(count)]
    text = b"\n".join(lines) + draw(st.sampled_from([b"", b"\n", b"\r\n", b"\n\n"]))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def check_batch(chunks: list[bytes], max_lines: int) -> None:
    check = InputCheck(ENDPOINT, max_lines)
    scan = scan_stream(
        lambda: iter(chunks),
        "batch_fz",
        defaults=Defaults(max_result_bytes=RESULT_BOUND, priority_range=(0, 0)),
        visit=check.visit,
        max_lines=max_lines,
        errors="replace",
    )
    first = scan.numbers[0] if scan.numbers else None
    errors = check.result(scan.format, scan.total, first, scan.over_limit)
    assert len(errors) <= MAX_ERRORS + 3  # the head entries and one "too_many_errors"
    assert len(json.dumps(errors)) <= MAX_ERRORS_BYTES + 4_096
    for entry in errors:
        assert set(entry) == {"code", "line", "message", "param"}
        assert isinstance(entry["code"], str) and isinstance(entry["message"], str)
    if errors:
        STATS["batch_refused"] += 1
        return
    STATS["batch_accepted"] += 1
    assert scan.total >= 1 and scan.invalid == 0 and not scan.over_limit
    for line in scan.lines_from(0):  # what the runner then publishes
        assert line.ok and line.envelope is not None
        assert line.envelope.priority in (None, 0)  # the tenant's range, clamped


@FAST
@given(batch_files(), st.sampled_from([3, 50_000]))
def test_batch_input_streams(chunks: list[bytes], max_lines: int) -> None:
    check_batch(chunks, max_lines)


@pytest.mark.slow
@LONG
@given(batch_files(), st.sampled_from([3, 50_000]))
def test_batch_input_streams_long(chunks: list[bytes], max_lines: int) -> None:
    check_batch(chunks, max_lines)


# ------------------------------------------------------------------ serve: sync body


class UnpublishedClient(QBatchClient):
    """The real `submit` up to Kafka: builds and checks the envelope, then has nothing to
    send to and no answer to wait for (the 504 path)."""

    def __init__(self) -> None:  # no Kafka, no Redis
        super().__init__(producer=object(), redis_client=object())

    def send(self, envelope: Any, lane: str | None = None) -> Any:
        STATS["sync_would_publish"] += 1
        return None

    def flush(self, futures: Any = (), timeout: float | None = None) -> None:
        return None

    def wait_raw(self, request_id: str, timeout: float | None = 30.0) -> bytes | None:
        return None


CLIENT = UnpublishedClient()
VALID_BODY = VALID_LINE["body"]


@st.composite
def sync_bodies(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 4)) == 0:
        return draw(json_values)
    doc = copy.deepcopy(VALID_BODY)
    if draw(st.booleans()):
        doc.update(n=128, max_tokens=32_000, top_logprobs=20)  # a result past the bound
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        if not path:
            continue
        parent, last = _get(doc, path[:-1]), path[-1]
        if draw(st.booleans()):
            del parent[last]
        else:
            parent[last] = draw(json_values)
    return doc


class NoAnswer:
    """A result waiter that never gets an answer (the 504 path)."""

    async def wait_raw(self, request_id: str, timeout: float) -> bytes | None:
        return None


def check_sync(body: Any) -> None:
    async def call() -> tuple[int, bytes]:
        return await run_sync(
            CLIENT,
            NoAnswer(),  # type: ignore[arg-type]
            anyio.CapacityLimiter(1),
            body,
            ENDPOINT,
            1.0,
            "tenant-fz",
            None,
            RESULT_BOUND,
        )

    try:
        status, payload = anyio.run(call)
    except ApiError as exc:
        assert 400 <= exc.status < 500 or exc.status == 504, exc
        STATS[f"sync_{exc.status}"] += 1
        return
    json.loads(payload)  # an answer came back (not reached with this client)
    assert status < 600


@FAST
@given(sync_bodies())
def test_sync_bodies_are_answered(body: Any) -> None:
    check_sync(body)


@pytest.mark.slow
@LONG
@given(sync_bodies())
def test_sync_bodies_are_answered_long(body: Any) -> None:
    check_sync(body)
