"""Tool loops under kill -9: the executor and then the worker die mid-stream.

300 loops of three model turns each (the `step` tool scripts the echo model). The
executor kills itself with SIGKILL inside the 200th `step` call it runs (a third of the 600)
and kills the worker inside the 400th; the test restarts each when it sees it die. Fired
from inside a call, each kill lands mid-stream (that call's loop is not done) and mid-poll,
however slow the machine: kills the test timed itself once landed after the last loop.
Every loop must finish with its full transcript, and a tool may run twice only
for calls whose record was not written yet when the executor died (at most one poll's
worth, `--max-batch`): a recorded call never runs again, whoever redelivers it (the
executor's own uncommitted poll, or the worker re-running a turn, whose call ids are
derived from request and turn). The `step` tool's permission hook checks the ledger just
before each run and counts runs of calls already recorded: that count must be 0.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import redis

from schemas import Status
from tests.integration.workers import Lane, start_executor, start_worker, stop_worker
from tests.reliability.conftest import figures
from tests.tool_fixtures import call_block, registry

N = 300
MAX_BATCH = 16
CALLS = 2 * N  # `step` n=1 and n=2 per loop
# Four answers at a time, 20 ms each, so the worker is mid-batch when it is killed.
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


def _killed(proc: object, what: str) -> None:
    try:
        code = proc.wait(120)  # type: ignore[attr-defined]
    except Exception as exc:
        raise AssertionError(f"the {what} was never killed by its chaos trigger") from exc
    assert code == -signal.SIGKILL, f"the {what} exited {code}, not by SIGKILL"


@pytest.mark.usefixtures("stack")
def test_loops_finish_and_recorded_calls_never_rerun_across_kill_9(
    lane: Lane, tmp_path: Path
) -> None:
    worker = start_worker(lane, *ECHO, log=tmp_path / "worker1.log")
    chaos = redis.Redis.from_url(lane.redis_url)
    chaos.hset(
        f"{lane.prefix}:chaos",
        mapping={"executor_at": CALLS // 3, "worker_at": 2 * CALLS // 3, "worker_pid": worker.pid},
    )
    chaos.close()
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
            _killed(executor, "executor")
            at_executor_kill = _done(client, ids)
            executor = start_executor(
                lane, "tests.tool_fixtures:registry", "--max-batch", str(MAX_BATCH),
                log=tmp_path / "executor2.log",
            )  # fmt: skip
            procs.append(executor)
            _killed(worker, "worker")
            at_worker_kill = _done(client, ids)
            worker = start_worker(lane, *ECHO, log=tmp_path / "worker2.log")
            procs.append(worker)
            results = client.wait_many(ids, timeout=180)
        assert at_executor_kill < N and at_worker_kill < N, (
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
