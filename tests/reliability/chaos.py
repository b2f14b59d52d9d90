"""The chaos soak's fault schedule: drawn from a seed, so a failing run can be replayed.

Pure (no sockets, no clock): `schedule(seed, duration_s, ...)` returns the faults, each
with when it starts and how long it holds before the harness undoes it. The rules keep
every fault inside what the deployment promises to survive, so an invariant that breaks
is a bug, not an impossible ask:

* one Kafka broker down at a time (replication 3, `min.insync.replicas` 2: a second one
  down would stop every `acks=all` write by design), and a broker comes back before the
  next one goes;
* one Redis fault at a time (a master down, stalled, slow, busy with a script or refusing
  writes), and the next one waits for the failover and the node's return;
* at least one worker always runs (a paused worker counts as down);
* every kind appears at least once when the run is long enough (the CI run covers them
  all), in an order the seed shuffles.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum


class FaultKind(StrEnum):
    worker_kill = "worker_kill"
    """kill -9 a worker; start a new one after `hold_s` (same group, same worker id)."""
    worker_stop = "worker_stop"
    """SIGSTOP a worker past the session timeout; SIGCONT after `hold_s` (a zombie)."""
    broker_kill = "broker_kill"
    """kill -9 a Kafka broker; restart it. Target 0 is whichever broker leads the requests
    topic's partition 0 at that moment (the first broker fault of a run always is)."""
    redis_master_kill = "redis_master_kill"
    """kill -9 a Redis Cluster master: its replica takes over; restart it (a replica now)."""
    redis_stall = "redis_stall"
    """Every command to one Redis master stalls for `hold_s` (CLIENT PAUSE): the server
    itself holds every client's commands, unexecuted, until the pause ends."""
    redis_slow = "redis_slow"
    """The workers' (and the CLI's) link to one Redis master, or to every node (target
    `ALL_NODES`), gains `delay_s` each way for `hold_s` (the delaying TCP proxy they reach
    Redis through): each command executes at once but its reply comes late."""
    redis_busy = "redis_busy"
    """Another client runs a script on one Redis master for `hold_s`, past its
    busy-reply-threshold (lowered for the fault): every other command is answered BUSY."""
    redis_misconf = "redis_misconf"
    """One Redis master's RDB save fails (its directory is gone): it answers every write
    (and PING) MISCONF for `hold_s`, until a save succeeds again; reads still work."""


WORKER_KINDS = (FaultKind.worker_kill, FaultKind.worker_stop)
REDIS_KINDS = (
    FaultKind.redis_master_kill,
    FaultKind.redis_stall,
    FaultKind.redis_slow,
    FaultKind.redis_busy,
    FaultKind.redis_misconf,
)
ALL_NODES = -1
"""A `redis_slow` target: every node's proxy."""


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: FaultKind
    target: int
    """Worker index, broker node (1-based; 0: the requests topic's partition-0 leader,
    resolved at run time) or Redis master index (0-based, resolved to a node at run time:
    masters move after a failover; `ALL_NODES` for a `redis_slow` on every node)."""
    hold_s: float
    delay_s: float = 0.0
    """`redis_slow`: seconds added each way."""

    @property
    def end_s(self) -> float:
        return self.at_s + self.hold_s

    def describe(self) -> str:
        text = f"t={self.at_s:.1f}s {self.kind} target={self.target} hold={self.hold_s:.1f}s"
        return text + (f" delay={self.delay_s:.2f}s" if self.delay_s else "")


@dataclass(frozen=True)
class Limits:
    """How long each kind holds (seconds) and how long a Redis fault keeps the next one
    away (the failover takes the cluster's node timeout plus the node's return)."""

    session_timeout_s: float = 8.0
    worker_kill_hold: tuple[float, float] = (2.0, 6.0)
    broker_hold: tuple[float, float] = (4.0, 10.0)
    redis_kill_hold: tuple[float, float] = (8.0, 12.0)
    redis_stall_hold: tuple[float, float] = (1.0, 3.0)
    redis_slow_hold: tuple[float, float] = (4.0, 10.0)
    redis_slow_delay: tuple[float, float] = (0.2, 0.8)
    """Seconds added each way: a round trip costs 0.4-1.6 s more, under the workers'
    5 s socket timeout (a slow Redis, not a dead one)."""
    redis_busy_hold: tuple[float, float] = (1.0, 3.0)
    """Under the cluster's node timeout: a node running a script answers no gossip."""
    redis_misconf_hold: tuple[float, float] = (3.0, 8.0)
    redis_slow_all: float = 0.3
    """The share of `redis_slow` faults on every node rather than one master."""
    redis_settle_s: float = 12.0
    broker_settle_s: float = 8.0
    gap: tuple[float, float] = (3.0, 8.0)


def schedule(
    seed: int,
    duration_s: float,
    *,
    workers: int = 3,
    brokers: int = 3,
    redis_masters: int = 3,
    start_s: float = 5.0,
    limits: Limits | None = None,
) -> list[Fault]:
    """The faults of one run, in start order; the last one ends before `duration_s`."""
    lim = limits or Limits()
    rng = random.Random(seed)
    kinds = list(FaultKind)
    rng.shuffle(kinds)  # the first round: every kind once, in the seed's order
    faults: list[Fault] = []
    t = start_s
    broker_free = redis_free = start_s
    while t < duration_s:
        kind = kinds.pop(0) if kinds else rng.choice(list(FaultKind))
        leader_killed = any(f.kind is FaultKind.broker_kill for f in faults)
        drawn = _draw(rng, kind, t, lim, workers, brokers, redis_masters, leader_killed)
        if kind is FaultKind.broker_kill:
            drawn = _later(drawn, broker_free)
        if kind in REDIS_KINDS:
            drawn = _later(drawn, redis_free)
        fault = _free_worker(drawn, faults, workers) if kind in WORKER_KINDS else drawn
        if fault is None:  # every other worker is down now: try again a little later
            t += rng.uniform(*lim.gap)
            continue
        if fault.end_s + _settle(fault, lim) > duration_s:
            if not kinds:
                break
            continue
        faults.append(fault)
        if kind is FaultKind.broker_kill:
            broker_free = fault.end_s + lim.broker_settle_s
        if kind in REDIS_KINDS:
            settle = lim.redis_settle_s if kind is FaultKind.redis_master_kill else 1.0
            redis_free = fault.end_s + settle
        t = fault.at_s + rng.uniform(*lim.gap)
    return sorted(faults, key=lambda f: f.at_s)


def _draw(
    rng: random.Random,
    kind: FaultKind,
    t: float,
    lim: Limits,
    workers: int,
    brokers: int,
    masters: int,
    leader_killed: bool = True,
) -> Fault:
    if kind is FaultKind.worker_kill:
        return Fault(t, kind, rng.randrange(workers), rng.uniform(*lim.worker_kill_hold))
    if kind is FaultKind.worker_stop:  # past the session timeout: the group moves on
        hold = lim.session_timeout_s * rng.uniform(1.3, 1.8)
        return Fault(t, kind, rng.randrange(workers), hold)
    if kind is FaultKind.broker_kill:  # 0: the leader (always, the first time)
        target = rng.randrange(brokers + 1) if leader_killed else 0
        return Fault(t, kind, target, rng.uniform(*lim.broker_hold))
    if kind is FaultKind.redis_master_kill:
        return Fault(t, kind, rng.randrange(masters), rng.uniform(*lim.redis_kill_hold))
    if kind is FaultKind.redis_stall:
        return Fault(t, kind, rng.randrange(masters), rng.uniform(*lim.redis_stall_hold))
    if kind is FaultKind.redis_busy:
        return Fault(t, kind, rng.randrange(masters), rng.uniform(*lim.redis_busy_hold))
    if kind is FaultKind.redis_misconf:
        return Fault(t, kind, rng.randrange(masters), rng.uniform(*lim.redis_misconf_hold))
    target = ALL_NODES if rng.random() < lim.redis_slow_all else rng.randrange(masters)
    hold = rng.uniform(*lim.redis_slow_hold)
    return Fault(t, kind, target, hold, round(rng.uniform(*lim.redis_slow_delay), 3))


def _later(fault: Fault, free_at: float) -> Fault:
    if fault.at_s >= free_at:
        return fault
    return Fault(free_at, fault.kind, fault.target, fault.hold_s, fault.delay_s)


def _free_worker(fault: Fault, earlier: list[Fault], workers: int) -> Fault | None:
    """The fault on a worker that is up for its whole span, leaving one up; else None."""
    busy = {
        f.target
        for f in earlier
        if f.kind in WORKER_KINDS and f.at_s < fault.end_s + 1 and fault.at_s < f.end_s + 1
    }
    if len(busy) >= workers - 1:
        return None
    if fault.target not in busy:
        return fault
    target = min(set(range(workers)) - busy)
    return Fault(fault.at_s, fault.kind, target, fault.hold_s, fault.delay_s)


def _settle(fault: Fault, lim: Limits) -> float:
    if fault.kind is FaultKind.redis_master_kill:
        return lim.redis_settle_s
    if fault.kind is FaultKind.broker_kill:
        return lim.broker_settle_s
    return 2.0


__all__ = ["ALL_NODES", "REDIS_KINDS", "WORKER_KINDS", "Fault", "FaultKind", "Limits", "schedule"]
