"""Tools the tool-loop tests and benchmark run (`--registry tests.tool_fixtures:registry`).

With the echo engine a tool scripts the "model": echo answers a tool turn with the tool's
result, so a result holding a `<tool_call>` block makes the next turn call again (`step`).
Side effects are counted in Redis (`{QBATCH_PREFIX}:ran:{key}`) so tests can see how
often a tool really ran.
"""

from __future__ import annotations

import json
import os
import signal
import time

import redis

from producer.tools import ToolCallContext, ToolRegistry
from schemas.keys import RedisKeys
from schemas.redis_conn import connect
from worker.tool_loop.continuation import fingerprint
from worker.tool_loop.runner import PendingCall


def _approve_small(call: ToolCallContext) -> bool | str:
    """Sensitive calls: payments up to 100 approved, others refused with a reason.

    `step` is sensitive only so this hook sees its context just before it runs: a run of a
    call whose outcome is already recorded in the executor's ledger is counted in
    `{prefix}:ran_recorded` (the kill -9 test asserts it stays 0)."""
    if call.name == "step":
        _count_if_recorded(call)
        return True
    amount = call.arguments.get("amount", 0)
    return True if isinstance(amount, int) and amount <= 100 else "payments over 100 need a human"


registry = ToolRegistry(permission=_approve_small)
_redis: redis.Redis | None = None


def _client() -> redis.Redis:
    global _redis
    if _redis is None:
        _redis = connect(os.environ.get("QBATCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return _redis


def _count(key: str) -> None:
    _client().incr(f"{os.environ.get('QBATCH_PREFIX', 'qbatch')}:ran:{key}")


def ledger_key(call: ToolCallContext, prefix: str) -> str:
    """The executor's ledger key of this call (`worker.tool_loop.ledger.CallLedger.key`),
    rebuilt from the hook's context: the worker writes a call's arguments as
    `json.dumps(arguments, ensure_ascii=False)` (tests/unit/test_tool_loop_logic.py holds
    the two equal). One GET per call: a SCAN of the keyspace per call, on CI's Redis full of
    other tests' keys, once slowed the executor to a crawl."""
    arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
    pending = PendingCall(call.request_id, call.turn, call.call_id, call.name, arguments)
    return RedisKeys(prefix).tool_call(call.request_id, call.turn, fingerprint(pending))


def _count_if_recorded(call: ToolCallContext) -> None:
    prefix = os.environ.get("QBATCH_PREFIX", "qbatch")
    client = _client()
    if client.get(ledger_key(call, prefix)) is not None:
        client.incr(f"{prefix}:ran_recorded")


def _chaos() -> None:
    """The kill -9 test's trigger: `{prefix}:chaos` (a hash) names the `step` run at which the
    executor kills itself (`executor_at`) and the one at which it kills the worker
    (`worker_at`, `worker_pid`). Killing from inside a loop's call makes each kill land
    mid-stream however slow the machine: the loop of the call that fires it is not done."""
    prefix = os.environ.get("QBATCH_PREFIX", "qbatch")
    client = _client()
    plan = client.hgetall(f"{prefix}:chaos")
    if not plan:
        return
    run = int(client.incr(f"{prefix}:chaos:runs"))
    if run == int(plan.get(b"worker_at", 0)):
        os.kill(int(plan[b"worker_pid"]), signal.SIGKILL)
    if run == int(plan.get(b"executor_at", 0)):
        os.kill(os.getpid(), signal.SIGKILL)


def call_block(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@registry.tool
def get_weather(city: str, unit: str = "c") -> dict[str, object]:
    """Current weather for a city."""
    _count(f"get_weather:{city}")
    return {"city": city, "temp": 21 if unit == "c" else 70, "unit": unit}


@registry.tool(sensitive=True)
def step(n: int, until: int = 2, tag: str = "") -> str:
    """Count up; until `until` is reached, the result asks the echo model to call again."""
    _count(f"step:{tag}:{n}")
    _chaos()
    if n < until:
        return call_block("step", n=n + 1, until=until, tag=tag)
    return f"done at {n}"


@registry.tool
def hop(n: int, until: int = 2) -> str:
    """`step` without side effects or checks: what the benchmark loops through."""
    return call_block("hop", n=n + 1, until=until) if n < until else f"done at {n}"


@registry.tool(timeout_s=0.5)
def slow(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "woke"


@registry.tool(timeout_s=60)
def nap(seconds: float, tag: str = "") -> str:
    """Sleeps up to a minute (longer than a short `max.poll.interval.ms`); counted."""
    time.sleep(seconds)
    _count(f"nap:{tag}")
    return "rested"


@registry.tool
def boom() -> str:
    """Always fails."""
    raise RuntimeError("the tool broke")


@registry.tool(max_result_bytes=1_000)
def big(size: int) -> str:
    """Returns `size` bytes."""
    return "x" * size


@registry.tool(sensitive=True)
def pay(amount: int, to: str) -> str:
    """Pays someone."""
    _count(f"pay:{to}")
    return f"paid {amount} to {to}"
