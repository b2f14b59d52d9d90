"""The tool loop end to end: echo worker + `qbatch tools serve`, real Kafka and Redis.

The echo "model" answers the user's message (a `<tool_call>` block the test sends) and,
after a tool turn, the tools' results, so each test scripts its loop through the tools of
`tests/tool_fixtures.py`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from schemas import ErrorCode, ResultEnvelope, Status
from schemas.redis_conn import connect
from schemas.tool_events import ToolTurnEvent
from tests.integration.workers import Lane, start_executor, start_worker, stop_worker
from tests.tool_fixtures import call_block, registry

pytestmark = pytest.mark.usefixtures("stack")


@pytest.fixture
def lane() -> Iterator[Lane]:
    lane = Lane.new("qtl")
    lane.create_topics(partitions=2)
    yield lane
    lane.delete_topics()
    lane.clean_redis()


@pytest.fixture
def loop_stack(lane: Lane, tmp_path: Path) -> Iterator[dict[str, Any]]:
    worker = start_worker(lane, log=tmp_path / "worker.log")
    executor = start_executor(lane, log=tmp_path / "executor.log")
    procs = {"worker": worker, "executor": executor, "logs": tmp_path}
    try:
        yield procs
    finally:
        for name in ("executor", "worker"):
            stop_worker(procs[name])


def body(content: str, *tools: str, tool_choice: str | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "messages": [{"role": "user", "content": content}],
        "tools": registry.openai_tools(*tools),
    }
    if tool_choice:
        data["tool_choice"] = tool_choice
    return data


def ran(lane: Lane, key: str) -> int:
    client = connect(lane.redis_url)
    try:
        return int(client.get(f"{lane.prefix}:ran:{key}") or 0)
    finally:
        client.close()


def wait_ok(lane: Lane, rid: str, timeout: float = 60) -> ResultEnvelope:
    with lane.client() as client:
        result = client.wait(rid, timeout=timeout)
    assert result is not None, f"no result for {rid} within {timeout} s"
    return result


def test_a_weather_loop_runs_the_tool_and_returns_the_final_answer(
    lane: Lane, loop_stack: dict[str, Any]
) -> None:
    with lane.client() as client:
        rid = client.submit(
            body(call_block("get_weather", city="Paris"), "get_weather"),
            tool_loop={"max_turns": 4},
            metadata={"team": "t1"},
        )
    result = wait_ok(lane, rid)
    assert result.status is Status.succeeded, result.error
    assert result.metadata == {"team": "t1"}
    message = result.response.choices[0].message  # type: ignore[union-attr]
    assert json.loads(message.content or "") == {"city": "Paris", "temp": 21, "unit": "c"}
    report = result.tool_loop
    assert report is not None and report.turns == 2
    (turn,) = report.transcript
    (call,) = turn.calls
    assert (call.name, call.ok, call.error) == ("get_weather", True, None)
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.duration_ms >= 0
    assert result.response.usage == report.usage  # type: ignore[union-attr]
    assert report.usage.total_tokens > turn.usage.total_tokens  # summed over both turns
    assert ran(lane, "get_weather:Paris") == 1


def test_three_turns_and_the_turn_limit(lane: Lane, loop_stack: dict[str, Any]) -> None:
    with lane.client() as client:
        three = client.submit(
            body(call_block("step", n=1, until=3, tag="a"), "step"), tool_loop={"max_turns": 4}
        )
        capped = client.submit(
            body(call_block("step", n=1, until=9, tag="b"), "step"), tool_loop={"max_turns": 2}
        )
    ok = wait_ok(lane, three)
    assert ok.status is Status.succeeded
    assert ok.tool_loop is not None and ok.tool_loop.turns == 4
    assert [t.turn for t in ok.tool_loop.transcript] == [1, 2, 3]
    assert ok.response.choices[0].message.content == "done at 3"  # type: ignore[union-attr]
    limited = wait_ok(lane, capped)
    assert limited.status is Status.failed
    assert limited.error is not None and limited.error.code is ErrorCode.tool_loop_max_turns
    assert limited.tool_loop is not None and limited.tool_loop.turns == 2
    pending = limited.response.choices[0].message.tool_calls  # type: ignore[union-attr]
    assert pending and pending[0].function.name == "step"  # the calls not run are shown


BAD_CASES = [
    # (what, tools offered (name -> schema override), call, expected error kind)
    ("unknown tool", {"nope": {"type": "object"}}, ("nope", {}), "unknown_tool"),
    (
        "arguments invalid",
        {"get_weather": {"type": "object"}},
        ("get_weather", {"city": 5}),
        "invalid_arguments",
    ),
    ("timeout", {}, ("slow", {"seconds": 3}), "timeout"),
    ("exception", {}, ("boom", {}), "exception"),
    ("oversize", {}, ("big", {"size": 5000}), "result_too_large"),
    ("sensitive refused", {}, ("pay", {"amount": 500, "to": "mallory"}), "permission_denied"),
    ("sensitive approved", {}, ("pay", {"amount": 50, "to": "bob"}), None),
]


def test_every_bad_call_becomes_a_tool_message_the_model_can_read(
    lane: Lane, loop_stack: dict[str, Any]
) -> None:
    ids = {}
    with lane.client() as client:
        for what, overrides, (name, args), _ in BAD_CASES:
            tools = [
                {"type": "function", "function": {"name": n, "parameters": schema}}
                for n, schema in overrides.items()
            ] or registry.openai_tools(name)
            ids[what] = client.submit(
                {
                    "messages": [{"role": "user", "content": call_block(name, **args)}],
                    "tools": tools,
                },
                tool_loop={},
            )
    for what, _, _, kind in BAD_CASES:
        result = wait_ok(lane, ids[what])
        assert result.status is Status.succeeded, (what, result.error)
        assert result.tool_loop is not None
        (call,) = result.tool_loop.transcript[0].calls
        content = result.response.choices[0].message.content or ""  # type: ignore[union-attr]
        if kind is None:
            assert call.ok and content == "paid 50 to bob", what
        else:
            assert not call.ok and call.error is not None and call.error.value == kind, what
            assert json.loads(content)["error"]["type"] == kind, what  # what the model read
    assert ran(lane, "pay:mallory") == 0 and ran(lane, "pay:bob") == 1
    timeout_call = wait_ok(lane, ids["timeout"]).tool_loop.transcript[0].calls[0]  # type: ignore[union-attr]
    assert timeout_call.duration_ms < 2_500  # the wait ended at timeout_s, not the tool's 3 s


def _event_for(lane: Lane, rid: str, city: str) -> bytes:
    from schemas import RequestEnvelope
    from schemas.result import AssistantOutput
    from schemas.usage import Usage

    env = RequestEnvelope.model_validate(
        {
            "request_id": rid,
            "body": body("weather?", "get_weather"),
            "tool_loop": {"max_turns": 3},
        }
    )
    call = {
        "id": "call_fixed0001",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    event = ToolTurnEvent(
        request_id=rid,
        turn=1,
        lane="interactive",
        envelope=env,
        message=AssistantOutput(content=None, tool_calls=[call]),  # type: ignore[list-item]
        usage=Usage(prompt_tokens=3, completion_tokens=5, total_tokens=8),
        emitted_ms=int(time.time() * 1000),
    )
    return event.model_dump_json(exclude_none=True).encode()


def test_a_redelivered_turn_reuses_the_record_and_garbage_is_dead_lettered(
    lane: Lane, loop_stack: dict[str, Any]
) -> None:
    producer = KafkaProducer(bootstrap_servers=lane.bootstrap)
    rid = "redelivered-1"
    event = _event_for(lane, rid, "Oslo")
    for _ in range(2):  # the same turn twice, as after an executor crash before its commit
        producer.send(lane.tool_calls_topic, key=rid.encode(), value=event)
    producer.send(lane.tool_calls_topic, key=b"junk", value=b'{"not": "an event"}')
    producer.flush()
    producer.close()
    result = wait_ok(lane, rid)
    assert result.status is Status.succeeded
    assert ran(lane, "get_weather:Oslo") == 1  # the second delivery reused the record
    consumer = KafkaConsumer(
        lane.dlq_topic,
        bootstrap_servers=lane.bootstrap,
        auto_offset_reset="earliest",
        consumer_timeout_ms=15_000,
    )
    try:
        dead = next(iter(consumer))
    finally:
        consumer.close()
    assert dead.key == b"junk"
    headers = dict(dead.headers)
    assert headers["qbatch.source.topic"].decode() == lane.tool_calls_topic


def test_turns_wait_for_a_missing_executor_and_two_executors_share_the_work(
    lane: Lane, tmp_path: Path
) -> None:
    worker = start_worker(lane, log=tmp_path / "worker.log")
    executors = []
    try:
        with lane.client() as client:
            ids = [
                client.submit(
                    body(call_block("get_weather", city=f"c{i}"), "get_weather"), tool_loop={}
                )
                for i in range(40)
            ]
            time.sleep(4)
            assert all(r is None for r in client.get_many(ids).values())  # waiting on Kafka
            executors = [start_executor(lane, log=tmp_path / f"executor{i}.log") for i in range(2)]
            results = client.wait_many(ids, timeout=90)
        assert all(r is not None and r.status is Status.succeeded for r in results.values())
        assert [ran(lane, f"get_weather:c{i}") for i in range(40)] == [1] * 40
    finally:
        for proc in [*executors, worker]:
            stop_worker(proc)


def test_bulk_run_with_an_embedded_executor_writes_the_transcript(
    lane: Lane, tmp_path: Path
) -> None:
    from tests.integration.workers import qbatch

    tools = registry.openai_tools("get_weather")
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": call_block("get_weather", city=f"b{i}")}],
                "tools": tools,
            },
        }
        for i in range(5)
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    worker = start_worker(lane, log=tmp_path / "worker.log")
    try:
        done = qbatch(
            lane, "--quiet", "bulk", "run", str(src), "--out", str(out), "--tool-loop", "3",
            "--registry", "tests.tool_fixtures:registry", "--timeout", "120",
        )  # fmt: skip
    finally:
        stop_worker(worker)
    assert done.returncode == 0, done.stderr
    rows = {row["custom_id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == [f"line-{i}" for i in range(5)]
    for i in range(5):
        row = rows[f"line-{i}"]
        body = row["response"]["body"]  # the OpenAI Batch output shape
        assert json.loads(body["choices"][0]["message"]["content"])["city"] == f"b{i}"
        assert row["tool_loop"]["turns"] == 2
        (call,) = row["tool_loop"]["transcript"][0]["calls"]
        assert call["name"] == "get_weather" and call["ok"] is True
        assert body["usage"] == row["tool_loop"]["usage"]
    assert [ran(lane, f"get_weather:b{i}") for i in range(5)] == [1] * 5
    again = qbatch(lane, "bulk", "submit", str(src), "--job", "x", "--tool-loop", "0")
    assert again.returncode == 2  # --tool-loop counts turns: 0 is a usage error


def test_the_readme_weather_example_runs_as_written(lane: Lane, tmp_path: Path) -> None:
    """The README's "Tool loop" example, run as a user would: the file as the executor's
    registry and as the client script. Only the question changes: the echo "model" is
    scripted by a `<tool_call>` block where a real model would decide to call."""
    import re
    import subprocess
    import sys

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Tool loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the README's Tool loop section has no python example"
    question = '"Weather in Paris?"'
    assert question in code.group(1)
    scripted = json.dumps(call_block("get_weather", city="Paris"))
    (tmp_path / "weather_tools.py").write_text(code.group(1).replace(question, scripted))
    worker = start_worker(lane, log=tmp_path / "worker.log")
    executor = start_executor(
        lane, "weather_tools:registry", log=tmp_path / "executor.log", pythonpath=tmp_path
    )
    try:
        run = subprocess.run(
            [sys.executable, "weather_tools.py"],
            cwd=tmp_path, env=lane.env(), capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    finally:
        stop_worker(executor)
        stop_worker(worker)
    assert run.returncode == 0, run.stderr[-3000:]
    answer, transcript = run.stdout.strip().splitlines()
    assert json.loads(answer) == {"city": "Paris", "temp": 21, "unit": "celsius"}
    assert "get_weather" in transcript and '"temp":21' in transcript


def test_a_tool_slower_than_the_poll_interval_keeps_the_executor_in_its_group(
    lane: Lane, tmp_path: Path
) -> None:
    """A call running past kafka-python's max.poll.interval.ms (here 6 s, the broker's
    minimum session) once cost the executor its partitions: its commit failed, exit 70, and
    the turn ran again on the next owner. Now it polls, paused, while calls run."""
    lane.extra_env.update(
        QBATCH_TOOLS_SESSION_TIMEOUT_MS="6000", QBATCH_TOOLS_MAX_POLL_INTERVAL_MS="6000"
    )
    worker = start_worker(lane, log=tmp_path / "worker.log")
    executor = start_executor(lane, log=tmp_path / "executor.log")
    try:
        with lane.client() as client:
            rid = client.submit(
                body(call_block("nap", seconds=10, tag="long"), "nap"),
                tool_loop={"max_turns": 2},
            )
            result = client.wait(rid, timeout=90)
        assert result is not None and result.status is Status.succeeded, result
        assert result.response.choices[0].message.content == "rested"  # type: ignore[union-attr]
        assert ran(lane, "nap:long") == 1, "the call ran again elsewhere"
        assert executor.poll() is None, "the executor exited"
        consumer = KafkaConsumer(bootstrap_servers=lane.bootstrap, group_id=f"{lane.group}-tools")
        try:
            parts = [
                TopicPartition(lane.tool_calls_topic, p)
                for p in consumer.partitions_for_topic(lane.tool_calls_topic) or ()
            ]
            deadline = time.monotonic() + 30
            while True:
                ends = consumer.end_offsets(parts)
                committed = {tp: consumer.committed(tp) or 0 for tp in parts}
                if committed == ends or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert committed == ends, "the turn event's offset was never committed"
        finally:
            consumer.close()
        log = (tmp_path / "executor.log").read_text()
        assert "commit_lost_to_rebalance" not in log and "executor_failed" not in log
    finally:
        stop_worker(executor)
        stop_worker(worker)


def test_a_cancelled_jobs_turn_runs_no_tool_and_is_answered_cancelled(
    lane: Lane, tmp_path: Path
) -> None:
    """The job of a loop is cancelled while its turn waits for an executor: the executor
    runs none of the turn's calls and sends the turn back aborted, and the worker answers
    the request `cancelled` (not `tool_loop_aborted`)."""
    from producer.jobs import JobStore

    worker = start_worker(lane, log=tmp_path / "worker.log")
    executor = None
    try:
        with lane.client() as client:
            client.redis.hset(client.keys.job("loopjob"), mapping={"total": 1, "status": "running"})
            rid = client.submit(
                body(call_block("get_weather", city="Rome"), "get_weather"),
                tool_loop={"max_turns": 4},
                job_id="loopjob",
            )
            consumer = KafkaConsumer(
                bootstrap_servers=lane.bootstrap, auto_offset_reset="earliest", group_id=None
            )
            consumer.assign([TopicPartition(lane.tool_calls_topic, p) for p in range(2)])
            deadline = time.monotonic() + 60
            seen = False
            while not seen and time.monotonic() < deadline:  # the turn is on its topic
                for records in consumer.poll(timeout_ms=500).values():
                    seen = seen or any(
                        ToolTurnEvent.model_validate_json(r.value).request_id == rid
                        for r in records
                    )
            consumer.close()
            assert seen, "the worker published no turn"
            assert JobStore.of(client).cancel("loopjob") in ("cancelling", "cancelled")
        executor = start_executor(lane, log=tmp_path / "executor.log")
        result = wait_ok(lane, rid)
    finally:
        for proc in (executor, worker):
            if proc is not None:
                stop_worker(proc)
    assert result.status is Status.cancelled, result.error
    assert result.error is not None and result.error.code is ErrorCode.cancelled
    assert ran(lane, "get_weather:Rome") == 0
