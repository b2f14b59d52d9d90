"""One `SENTINEL FAILOVER` under load against the local Sentinel set
(`stack.sh up --redis-sentinel`), shared by the integration test (one round, the
guarantee) and the reliability measurement (many rounds, every setting).

What a switchover can lose: `SENTINEL FAILOVER` promotes a replica while the old master
is still up. With `min-replicas-to-write 2` the old master refuses writes once the
promoted replica has left it, so what remains is replication's tail: a result the old
master acknowledged that the replica promoted had not yet applied.
`--redis-wait-replicas N` with N = every replica closes it for one failover of a healthy
set (a result counts as stored once both replicas have it, so whichever is promoted has
it); not consensus: a second failure can still lose a counted result.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.sentinel import Sentinel

from schemas import RedisKeys
from schemas.redis_conn import connect, mget, parse_sentinel_url, reply_text
from tests.integration.cluster_stack import run_stack
from tests.integration.workers import Lane, echo_worker, wait_for

SLOW = ("--echo-delay-ms", "50", "--echo-concurrency", "4")  # ~80 answers a second


def master_port(url: str) -> int | None:
    """The master's port as the sentinels name it now (None while they name none)."""
    target = parse_sentinel_url(url)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs={"socket_timeout": 2})
    try:
        return int(sentinel.discover_master(target.service)[1])
    except redis.ConnectionError:  # MasterNotFoundError: the master is down, not yet replaced
        return None
    finally:
        for node in sentinel.sentinels:
            node.close()


def sentinel_fields(reply: list[Any]) -> dict[str, str]:
    """A flat [k, v, k, v, ...] reply of SENTINEL MASTER / REPLICAS as a dict."""
    items = [reply_text(x) for x in reply]
    return dict(zip(items[::2], items[1::2], strict=True))


def wait_settled(timeout: float = 90) -> None:
    """Waits until `stack.sh status --sentinel` says the set is ok: every sentinel names
    the same master with no failover under way and sees both replicas with their links
    up, and the master has them online. A switchover sent before the sentinels' view has
    caught up can pick a replica still syncing, which they then abort
    (`-failover-abort-slave-timeout`)."""
    last = ""

    def check() -> bool:
        nonlocal last
        try:
            run_stack("status", "--sentinel", timeout=30)
        except RuntimeError as exc:  # exit 3: a node down, or the set's state not ok yet
            text = str(exc)
            down = [line for line in text.splitlines() if "not running" in line]
            last = "; ".join(down) or text.rsplit("state=", 1)[-1].strip()
            return False
        except subprocess.TimeoutExpired:  # redis-cli against a stalled node: poll again
            last = "stack.sh status --sentinel took over 30 s"
            return False
        return True

    try:
        wait_for("the sentinel set settled", check, timeout)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}: {last}") from None


def log_events(path: Path) -> list[str]:
    """The `event` of every JSON line of a worker's log, in order."""
    events = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line).get("event") if line.startswith("{") else None
            if event:
                events.append(str(event))
    return events


def bodies(tag: str, n: int) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": f"{tag}{i}"}]} for i in range(n)]


@dataclass(frozen=True)
class FailoverRound:
    """What one switchover under load left behind."""

    old: int
    new: int
    submitted: int
    lost: list[str]
    """Request ids the client saw answered (all of them were) whose result is not on the
    new master once the old one rejoined as its replica (read while the worker runs)."""
    events: list[str]


def _missing_on_master(url: str, keys: list[str], timeout: float) -> set[str]:
    """The keys the master does not hold, read through a fresh connection (found by asking
    the sentinels anew) until none is missing or `timeout` has passed."""
    missing = sorted(keys)
    deadline = time.monotonic() + timeout
    while True:
        fresh = connect(url)
        try:
            missing = [k for k, v in zip(missing, mget(fresh, missing), strict=True) if v is None]
        finally:
            fresh.close()
        if not missing or time.monotonic() > deadline:
            return set(missing)
        time.sleep(0.5)


def failover_under_load(
    sentinel_url: str,
    bootstrap: str,
    log: Path,
    *,
    wait_replicas: int | None,
    n: int = 400,
    after: int = 40,
    worker_flags: Sequence[str] = SLOW,
) -> FailoverRound:
    """Submits `n` requests to an echo worker (slow by default), fails the master over once
    `after` are answered, waits for every result, then reads them again through a fresh
    connection once the set is whole (a client still on the old master would read what it
    took), the worker still running. Leaves the set whole and the lane's topics and keys
    deleted."""
    wait_settled()
    old = master_port(sentinel_url)
    if old is None:
        raise RuntimeError("the sentinels name no master")
    target = parse_sentinel_url(sentinel_url)
    host, port = target.sentinels[0]
    flags = () if wait_replicas is None else ("--redis-wait-replicas", str(wait_replicas))
    lane = Lane.on(bootstrap, sentinel_url, "qbrs")
    keys = RedisKeys(lane.prefix)
    try:
        lane.create_topics(4)
        with echo_worker(lane, *worker_flags, *flags, log=log), lane.client() as qb:
            ids = qb.submit_many(bodies("g", n))
            wait_for(
                f"{after} results",
                lambda: sum(r is not None for r in qb.get_many(ids).values()) >= after,
                timeout=60,
            )
            with redis.Redis(host=host, port=port, socket_timeout=5) as sentinel:
                if not sentinel.execute_command("SENTINEL", "FAILOVER", target.service):
                    raise RuntimeError("SENTINEL FAILOVER refused")
            wait_for("a new master", lambda: master_port(sentinel_url) not in (None, old), 60)
            got = qb.wait_many(ids, timeout=120 + n / 100)
            unanswered = [rid for rid, r in got.items() if r is None or not r.ok]
            if unanswered:
                raise AssertionError(f"{len(unanswered)} of {n} not answered: {unanswered[:5]}")
            # The client may have read a result off the old master that the worker never
            # counted (its WAIT failed) and will write again: read back on the new master,
            # once the old one rejoined as its replica, while the worker still runs.
            run_stack("up", "--redis-sentinel", timeout=300)
            lost = _missing_on_master(sentinel_url, [keys.result(rid) for rid in ids], 30)
        return FailoverRound(
            old=old,
            new=master_port(sentinel_url) or 0,
            submitted=n,
            lost=[rid for rid in ids if keys.result(rid) in lost],
            events=log_events(log),
        )
    finally:
        run_stack("up", "--redis-sentinel", timeout=300)
        lane.clean_redis()
        lane.delete_topics()
