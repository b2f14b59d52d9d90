"""Results that count as stored only once Redis replicas acknowledge them (`WAIT`).

Redis replicates asynchronously: a master answers a write before its replicas have it.
When the master then dies and a replica takes over (Redis Cluster, Sentinel), the writes
the replica had not received are gone, though the worker saw them succeed and committed
its Kafka offsets past their requests: lost for good. The long chaos soak (seed
459465639) lost 23 results that way, every one in the slots of the master killed at
t=115.5 s.

`WAIT numreplicas timeout` blocks until that many replicas acknowledge every write made
*on the same connection* so far. So the writes and their WAIT go out in one pipeline (one
connection, one round trip); on a cluster one pipeline per master. A write retried after
an outage finds its result already there and writes nothing, which would leave its WAIT
nothing of its own to wait for; so each pipeline also sets a short-lived key in its slot
(`RedisKeys.ack`), whose replication offset is past every earlier write on that master.
Fewer replicas within the timeout raise `ReplicasBehind`, an outage (a `redis.TimeoutError`):
the worker pauses, writes the chunk again later (every result script is idempotent) and
commits nothing past it meanwhile.

WAIT narrows the window, it is not consensus: with two replicas per master and
`replicas=1`, a failover may still promote the replica that missed a write (Redis's
own caveat). `replicas` = every replica of a master closes it, at the price of writes
stalling while any replica is down.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import AskError, MovedError, RedisClusterException, TryAgainError

from schemas.keys import RedisKeys
from schemas.redis_conn import is_cluster, waiting_out_failover

__all__ = [
    "ACK_KEY_TTL_MS",
    "PRODUCER_ACK_WAIT_S",
    "Call",
    "ReplicaAck",
    "ReplicasBehind",
    "eval_acked",
]

ACK_KEY_TTL_MS = 10_000
"""The ack key only has to outlive its own WAIT."""
PRODUCER_ACK_WAIT_S = 120.0
"""How long producer-side clients (the CLI, `qbatch serve`) retry writes the replicas did
not acknowledge, or that a failover interrupted, before they fail."""

Call = tuple[str, Sequence[Any], Sequence[Any]]
"""(script body, keys, args) of one EVAL; its keys in one slot."""

_REDIRECTS = (MovedError, AskError, TryAgainError, redis.exceptions.ReadOnlyError)
"""Replies that mean the slot is served elsewhere now (a failover, a demoted master)."""
_ROUNDS = 3
DEFAULT_WAIT_TIMEOUT_MS = 1000
"""One WAIT's bound: a replica that is up acknowledges in milliseconds, so a second means
it is not keeping up (QBATCH_REDIS_WAIT_TIMEOUT_MS's default too)."""


@dataclass(frozen=True, slots=True)
class ReplicaAck:
    """How many replicas must hold a result before it counts as written (0: do not wait)."""

    replicas: int = 0
    timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS

    @property
    def enabled(self) -> bool:
        return self.replicas > 0


class ReplicasBehind(redis.TimeoutError):
    """Fewer replicas than asked acknowledged the writes in time (or WAIT was refused):
    the writes may be on the master only. An outage, never a refusal of the results."""


def eval_acked(client: Any, keys: RedisKeys, ack: ReplicaAck, calls: Sequence[Call]) -> list[Any]:
    """EVAL each call, then WAIT for `ack.replicas` on the connection(s) that ran them.

    The replies in order, an error reply in place (not raised), as `eval_many` returns
    them; raises `ReplicasBehind` when the replicas did not acknowledge in time."""
    if not calls:
        return []

    def run() -> list[Any]:
        if is_cluster(client):
            return _acked_on_cluster(client, keys, ack, calls)
        return _acked_pipeline(client, ack, calls, keys.ack())

    # Producer-side clients wait out a failover here too (a pipeline bypasses the
    # clients' own execute_command), and longer than for a failover alone: after a
    # master dies its promoted replica has no replica of its own until the dead node is
    # back (the long chaos soak: up to ~40 s), and a CLI that gave up there left a
    # cancelled job half-answered. The worker's sink client waits 0 and pauses instead.
    return waiting_out_failover(client, run, at_least_s=PRODUCER_ACK_WAIT_S)


def _acked_pipeline(node: Any, ack: ReplicaAck, calls: Sequence[Call], ack_key: str) -> list[Any]:
    """One connection: the calls, the ack key, WAIT."""
    pipe = node.pipeline(transaction=False)
    for body, call_keys, args in calls:
        pipe.execute_command("EVAL", body, len(call_keys), *call_keys, *args)
    pipe.set(ack_key, 1, px=ACK_KEY_TTL_MS)
    pipe.execute_command("WAIT", ack.replicas, ack.timeout_ms)
    raw = list(pipe.execute(raise_on_error=False))
    replies, stored, acked = raw[:-2], raw[-2], raw[-1]
    if isinstance(stored, Exception):
        raise stored
    if isinstance(acked, Exception):
        # e.g. "WAIT cannot be used with replica instances": a demoted master
        raise ReplicasBehind(f"WAIT failed: {acked}") from acked
    if int(acked) < ack.replicas:
        raise ReplicasBehind(
            f"{int(acked)} of {ack.replicas} Redis replicas acknowledged the results "
            f"within {ack.timeout_ms} ms"
        )
    return replies


def _acked_on_cluster(
    client: Any, keys: RedisKeys, ack: ReplicaAck, calls: Sequence[Call]
) -> list[Any]:
    """One pipeline per master that owns a call's slot (redis-py's cluster pipeline would
    re-send a redirected command on another connection, out of its WAIT's reach). A call
    redirected (MOVED after a failover) runs again on the new owner after the slot map is
    re-read; connection errors re-read it too, so the next try finds the promoted master.
    An ASK (the slot is migrating, the keys are not on the old master) is not followed:
    a result script's keys are new, and the importing master, asked with ASKING, answers
    a multi-key script whose keys it lacks TRYAGAIN until the slot is stable, so the
    chunk waits as in an outage (test_a_migrating_slot_pauses_its_writes_until_the_slot_is_stable).
    """
    replies: list[Any] = [None] * len(calls)
    pending = list(range(len(calls)))
    for _ in range(_ROUNDS):
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i in pending:
            node = client.get_node_from_key(calls[i][1][0])
            groups.setdefault(node.name, (node, []))[1].append(i)
        redirected: list[int] = []
        for node, where in groups.values():
            try:
                raw = _acked_pipeline(
                    client.get_redis_connection(node),
                    ack,
                    [calls[i] for i in where],
                    keys.ack(calls[where[0]][1][0]),
                )
            except _REDIRECTS:
                redirected += where
                continue
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if not isinstance(exc, ReplicasBehind):
                    _reload_slots(client)
                raise
            for i, reply in zip(where, raw, strict=True):
                replies[i] = reply
                if isinstance(reply, _REDIRECTS):
                    redirected.append(i)
        if not redirected:
            return replies
        pending = sorted(redirected)
        _reload_slots(client)
    raise TryAgainError(f"{len(pending)} writes still redirected after {_ROUNDS} slot-map reloads")


def _reload_slots(client: Any) -> None:
    """Re-read the slot map so the next try finds a promoted master; a cluster that cannot
    answer now (every seed down mid-failover) keeps the old map and the caller's error."""
    with contextlib.suppress(redis.RedisError, RedisClusterException):
        client.nodes_manager.initialize()
