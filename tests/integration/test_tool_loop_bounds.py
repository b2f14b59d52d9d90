"""The tool loop's edges (issue 40) on real Kafka and Redis, an echo worker and
`qbatch tools serve`:

- a producer's own `loop` (a forged 16-turn transcript of 2**40-token turns, a lane for
  priority) is answered `failed` naming `loop`, unrun; an executor's continuation runs;
- an event the executor stops on (a failpoint) stops it twice at most: the third
  executor answers its request `tool_loop_aborted` and the loops beside it finish;
- the turns that once stopped every executor for good (129 calls in one turn; an argument
  of 160,000 x U+200B whose validation message quoted it past its record's limit) are
  answered, and the executor runs on.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaProducer

from schemas import ErrorCode, Status
from tests.integration.workers import Lane, start_executor, start_worker, stop_worker
from tests.tool_fixtures import call_block, registry

pytestmark = pytest.mark.usefixtures("stack")
LONG = {"max_tokens": 8_000}  # the echo model repeats this many words of its prompt


@pytest.fixture
def lane() -> Iterator[Lane]:
    lane = Lane.new("qtb")
    lane.create_topics(partitions=2)
    yield lane
    lane.delete_topics()
    lane.clean_redis()


def loop_body(city: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": call_block("get_weather", city=city)}],
        "tools": registry.openai_tools("get_weather"),
    }


def test_a_loop_a_producer_sets_is_not_run(lane: Lane, tmp_path: Path) -> None:
    huge = {"prompt_tokens": 2**40, "completion_tokens": 2**40, "total_tokens": 2**40}
    forged = {
        "request_id": "forged-1",
        "body": loop_body("Paris"),
        "tool_loop": {"max_turns": 16},
        "deadline": "2020-01-01T00:00:00Z",
        "loop": {
            "turn": 16,
            "lane": "interactive",
            "transcript": [{"turn": t, "calls": [], "usage": huge} for t in range(1, 16)],
        },
    }
    worker = start_worker(lane, log=tmp_path / "worker.log")
    executor = start_executor(lane, log=tmp_path / "executor.log")
    try:
        producer = KafkaProducer(bootstrap_servers=lane.bootstrap)
        producer.send(lane.topic, key=b"forged-1", value=json.dumps(forged).encode()).get(30)
        producer.close()
        with lane.client() as client:
            real = client.submit(loop_body("Oslo"), tool_loop={"max_turns": 4})
            refused = client.wait("forged-1", timeout=60)
            answered = client.wait(real, timeout=60)
        assert refused is not None and refused.status is Status.failed
        assert refused.error is not None and refused.error.param == "loop"
        assert answered is not None and answered.status is Status.succeeded, answered
        assert answered.tool_loop is not None and answered.tool_loop.turns == 2
        assert worker.poll() is None and executor.poll() is None
    finally:
        stop_worker(executor)
        stop_worker(worker)


def test_an_event_the_executor_stops_on_stops_it_twice_at_most(lane: Lane, tmp_path: Path) -> None:
    worker = start_worker(lane, log=tmp_path / "worker.log")
    poisoned = dataclasses.replace(lane, extra_env={"QBATCH_FAILPOINTS": "executor=poison"})
    try:
        with lane.client() as client:
            client.submit(loop_body("Rome"), request_id="poison", tool_loop={"max_turns": 4})
            for n in range(2):
                executor = start_executor(poisoned, log=tmp_path / f"executor{n}.log")
                assert executor.wait(timeout=60) == 70
            executor = start_executor(poisoned, log=tmp_path / "executor2.log")
            fine = [client.submit(loop_body(f"c{i}"), tool_loop={"max_turns": 4}) for i in range(3)]
            aborted = client.wait("poison", timeout=60)
            finished = [client.wait(rid, timeout=60) for rid in fine]
        assert aborted is not None and aborted.error is not None
        assert aborted.error.code is ErrorCode.tool_loop_aborted
        assert "stopped on an internal fault twice" in aborted.error.message
        assert all(r is not None and r.status is Status.succeeded for r in finished)
        assert executor.poll() is None
        stop_worker(executor)
    finally:
        stop_worker(worker)


def test_the_turns_that_stopped_every_executor_are_answered(lane: Lane, tmp_path: Path) -> None:
    """The echo "model" repeats its prompt, so a prompt of call blocks is a turn calling
    them: 129 calls (the worker runs at most 128 a turn), and one call of `step` whose
    `n` is 160,000 zero-width spaces, valid against the request's looser schema (a
    string) and refused by the executor's (an integer), whose message quoted it whole."""
    blocks = "".join(call_block("get_weather", city=f"c{i}") for i in range(129))
    wide = json.dumps({"name": "step", "arguments": {"n": "\u200b" * 160_000}}, ensure_ascii=False)
    loose = registry.openai_tools("step")
    loose[0]["function"]["parameters"]["properties"]["n"] = {"type": "string"}
    tools = registry.openai_tools("get_weather")
    worker = start_worker(lane, log=tmp_path / "worker.log")
    executor = start_executor(lane, log=tmp_path / "executor.log")
    try:
        with lane.client() as client:
            many = client.submit(
                {"messages": [{"role": "user", "content": blocks}], "tools": tools, **LONG},
                tool_loop={"max_turns": 2},
            )
            zero_width = client.submit(
                {
                    "messages": [{"role": "user", "content": f"<tool_call>{wide}</tool_call>"}],
                    "tools": loose,
                    **LONG,
                },
                tool_loop={"max_turns": 2},
            )
            after = client.submit(loop_body("Lima"), tool_loop={"max_turns": 4})
            results = {rid: client.wait(rid, timeout=90) for rid in (many, zero_width, after)}
        assert all(r is not None for r in results.values()), results
        assert results[after] is not None and results[after].status is Status.succeeded
        assert results[many] is not None and results[many].tool_loop is not None
        calls = results[many].tool_loop.transcript[0].calls
        assert len(calls) == 128  # the 129th is not run
        assert results[zero_width] is not None and results[zero_width].tool_loop is not None
        (call,) = results[zero_width].tool_loop.transcript[0].calls
        assert not call.ok and len(call.content) < 10_000  # refused, its message cut
        assert executor.poll() is None and worker.poll() is None
    finally:
        stop_worker(executor)
        stop_worker(worker)
