"""Retrying a call to a reply sink while it is unavailable: one rule for the dispatcher's
admission and the writer's writes.

What waiting cures (`SinkUnavailable`: Redis down, BUSY, LOADING, MISCONF, a failover) is
retried with capped backoff, for as long as it lasts, while intake pauses. Two ways out:

- `GiveUp`: the worker is stopping and `give_up_after_s` has passed since it asked (what
  is not written is then handed back by not committing it);
- `Stalled`: the call has only *timed out* for `stall_s` (the server takes the connection
  but does not answer: a script of ours running for seconds, as admission once did on
  results of 22 MB each, retried for ever while every other client got BUSY). That is a
  fault of the thread making the call: it stops the worker (exit 70, liveness false) and
  the records it held get a strike, so one that causes it runs alone next time and is
  quarantined the time after (worker.supervision). A server that cannot be reached at all
  has its strikes go unrecorded, so an outage never quarantines anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from worker.sinks.base import ReplySink, SinkHealth, SinkUnavailable

T = TypeVar("T")


class GiveUp(Exception):
    """Stopping, and the drain deadline passed while a sink was unavailable."""


class Stalled(Exception):
    """A sink call that did nothing but time out for the stall limit."""


def retrying(
    sink: ReplySink,
    call: Callable[[], T],
    *,
    health: SinkHealth,
    stopping: Callable[[], bool],
    give_up_after_s: float,
    stall_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`call()`, retried with capped exponential backoff while `sink` is unavailable."""
    delay = 0.05
    give_up_at: float | None = None
    timing_out_since: float | None = None
    while True:
        try:
            value = call()
        except SinkUnavailable as exc:
            health.failed(sink, exc)
            now = clock()
            if exc.timed_out:
                timing_out_since = now if timing_out_since is None else timing_out_since
                if now - timing_out_since >= stall_s:
                    raise Stalled(
                        f"{sink.name}: every try timed out for {now - timing_out_since:.0f}s "
                        f"(the call, not the server: {exc})"
                    ) from exc
            else:
                timing_out_since = None
            if stopping():
                give_up_at = now + give_up_after_s if give_up_at is None else give_up_at
                if now >= give_up_at:
                    raise GiveUp from exc
            sleep(delay)
            delay = min(delay * 2, 2.0)
            continue
        health.recovered(sink)
        return value


__all__ = ["GiveUp", "Stalled", "retrying"]
