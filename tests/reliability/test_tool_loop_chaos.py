"""Tool loops under kill -9: the executor and then the worker die mid-stream.

300 loops of three model turns each (the `step` tool scripts the echo model). The
executor is killed once a third of the loops are done, the worker at two thirds; both are
restarted. Every loop must finish with its full transcript, and a tool may run twice only
for calls whose record was not written yet when the executor died (at most one poll's
worth, `--max-batch`): a recorded call never runs again, whoever redelivers it (the
executor's own uncommitted poll, or the worker re-running a turn, whose call ids are
derived from request and turn). The `step` tool's permission hook checks the ledger just
before each run and counts runs of calls already recorded: that count must be 0.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import redis

from schemas import Status
from tests.integration.workers import Lane, start_executor, start_worker, stop_worker
from tests.reliability.conftest import figures
from tests.tool_fixtures import call_block, registry

N = 300
MAX_BATCH = 16
# Four answers at a time, 20 ms each: loops finish at most ~200 a second, so the last
# third takes >= 0.5 s and a 50-ms poll cannot miss it (unlimited, a whole third finished
# inside one batch on a busy CI machine and the worker kill landed after the end).
ECHO = ("--echo-delay-ms", "20", "--echo-concurrency", "4")


@pytest.fixture
def lane() -> Lane:
    lane = Lane.new("qtc")
    lane.create_topics(partitions=4)
    yield lane  # type: ignore[misc]
    lane.delete_topics()
    lane.clean_redis()


def _done(client: object, ids: list[str]) -> int:
    return sum(r is not None for r in client.get_many(ids).values())  # type: ignore[attr-defined]


def _wait_done(client: object, ids: list[str], at_least: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    done = 0
    while time.monotonic() < deadline:
        done = _done(client, ids)
        if done >= at_least:
            return done
        time.sleep(0.05)
    return done


@pytest.mark.usefixtures("stack")
def test_loops_finish_and_recorded_calls_never_rerun_across_kill_9(
    lane: Lane, tmp_path: Path
) -> None:
    worker = start_worker(lane, *ECHO, log=tmp_path / "worker1.log")
    executor = start_executor(
        lane, "tests.tool_fixtures:registry", "--max-batch", str(MAX_BATCH),
        log=tmp_path / "executor1.log",
    )  # fmt: skip
    procs = [worker, executor]
    tools = registry.openai_tools("step")
    try:
        with lane.client() as client:
            ids = [
                client.submit(
                    {
                        "messages": [
                            {
                                "role": "user",
                                "content": call_block("step", n=1, until=2, tag=f"L{i}"),
                            }
                        ],
                        "tools": tools,
                    },
                    tool_loop={"max_turns": 3},
                    flush=False,
                )
                for i in range(N)
            ]
            client.flush()
            at_executor_kill = _wait_done(client, ids, N // 3, 120)
            os.kill(executor.pid, signal.SIGKILL)
            executor.wait(10)
            executor = start_executor(
                lane, "tests.tool_fixtures:registry", "--max-batch", str(MAX_BATCH),
                log=tmp_path / "executor2.log",
            )  # fmt: skip
            procs.append(executor)
            at_worker_kill = _wait_done(client, ids, 2 * N // 3, 120)
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(10)
            worker = start_worker(lane, *ECHO, log=tmp_path / "worker2.log")
            procs.append(worker)
            results = client.wait_many(ids, timeout=180)
        assert 0 < at_executor_kill < N and at_executor_kill <= at_worker_kill < N, (
            f"both kills must land mid-stream (done at the executor kill: {at_executor_kill}, "
            f"at the worker kill: {at_worker_kill}, of {N})"
        )
        missing = [rid for rid, r in results.items() if r is None]
        assert not missing, f"{len(missing)} loops never finished"
        for rid, result in results.items():
            assert result is not None and result.status is Status.succeeded, (rid, result)
            assert result.tool_loop is not None and result.tool_loop.turns == 3, rid
            assert result.response.choices[0].message.content == "done at 2"  # type: ignore[union-attr]
        r = redis.Redis.from_url(lane.redis_url)
        runs = [
            int(r.get(f"{lane.prefix}:ran:step:L{i}:{n}") or 0) for i in range(N) for n in (1, 2)
        ]
        assert min(runs) == 1, "every call ran"
        reruns = sum(count - 1 for count in runs)
        recorded_reruns = int(r.get(f"{lane.prefix}:ran_recorded") or 0)
        r.close()
        figures(
            "tool loop kill -9",
            loops=N,
            calls=len(runs),
            done_at_executor_kill=at_executor_kill,
            done_at_worker_kill=at_worker_kill,
            reruns=reruns,
            reruns_of_recorded_calls=recorded_reruns,
        )
        assert recorded_reruns == 0, (
            f"{recorded_reruns} calls ran though their outcome was recorded"
        )
        assert reruns <= MAX_BATCH, (
            f"{reruns} calls ran again: more than one unrecorded poll ({MAX_BATCH}) can explain"
        )
    finally:
        for proc in procs:
            stop_worker(proc)
