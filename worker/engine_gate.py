"""Which engine requests go into the engine now and which wait in the worker, so a
request of the best lane always finds room in the engine.

Why: vLLM's priority scheduling orders its *waiting* queue, but a waiting request never
preempts a running one. When a bulk job starts, its first wave of requests takes every
KV-cache block (or every `max_num_seqs` slot) at once; an interactive request then
waits at the head of the queue until a bulk request finishes, which for the first wave
is a whole bulk generation (5-12 s measured on an H100). So requests of worse lanes may
hold at most the engine's capacity less a reserve, counted in slots and in KV-cache
tokens (a request's prompt plus its `max_tokens` for each choice: what it can grow to);
past it they wait here, best priority first, and go in as engine requests finish.
Requests of the best lane are never held.

The reserve idles when no best-lane request comes (a night of bulk alone), so it holds
only while the best lane was seen within `Reserve.hold_s`; otherwise worse lanes may fill
the engine's whole capacity. After a quiet spell the first best-lane request may wait for
one bulk request to finish; from then on the reserve is back (bulk drains down to it as
its requests finish). Pure bookkeeping, time injected, thread-safe: the dispatcher
offers, engine threads report what finished, the cancel watch drops.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from worker.engines.base import EngineRequest


@dataclass(frozen=True, slots=True)
class Capacity:
    """What the engine can run at once: `slots` requests (vLLM's `max_num_seqs`) and
    `tokens` KV-cache tokens (None: not bounded that way)."""

    slots: int | None = None
    tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Reserve:
    """What worse lanes leave free for the best lane: `slots` (at most a 32nd of the
    engine's, at least one), and `fraction` of the KV-cache tokens, while the best lane
    was seen within `hold_s`."""

    slots: int = 8
    fraction: float = 0.02
    hold_s: float = 300.0


@dataclass(order=True, slots=True)
class _Held:
    priority: int
    seq: int
    request: EngineRequest = field(compare=False)
    cost: int = field(compare=False)


class EngineGate:
    """See the module docstring. `cost(request)`: the KV tokens it may hold."""

    def __init__(
        self, capacity: Capacity, reserve: Reserve, clock: Callable[[], float] = time.monotonic
    ) -> None:
        slots, tokens = capacity.slots, capacity.tokens
        self._full = (slots, tokens)
        kept = None if slots is None else min(reserve.slots, max(1, slots // 32))
        self._reserved = (
            None if slots is None or kept is None else max(1, slots - kept),
            None if tokens is None else max(1, int(tokens * (1 - reserve.fraction))),
        )
        self._hold_s = reserve.hold_s
        self._clock = clock
        self._best_seen: float | None = None
        self._lock = threading.Lock()
        self._inside: dict[str, int] = {}
        """Keys of worse-lane requests in the engine -> their cost."""
        self._inside_tokens = 0
        self._held: list[_Held] = []
        self._seq = itertools.count()

    @property
    def bounded(self) -> bool:
        return self._full != (None, None)

    def _limits(self) -> tuple[int | None, int | None]:
        seen = self._best_seen
        recent = seen is not None and self._clock() - seen < self._hold_s
        return self._reserved if recent else self._full

    def _fits(self, cost: int) -> bool:
        slots, tokens = self._limits()
        if slots is not None and len(self._inside) >= slots:
            return False
        # (an empty engine takes one request whatever its cost)
        return tokens is None or not self._inside or self._inside_tokens + cost <= tokens

    def offer(self, requests: Iterable[tuple[EngineRequest, bool, int]]) -> list[EngineRequest]:
        """(request, best lane?, cost) for each: those that go in now (the best lane's
        always; the others while they fit and nothing better waits); the rest are held."""
        now: list[EngineRequest] = []
        with self._lock:
            for request, best, cost in requests:
                if best:
                    self._best_seen = self._clock()
                if best or not self.bounded:
                    now.append(request)
                    continue
                heapq.heappush(self._held, _Held(request.priority, next(self._seq), request, cost))
            now += self._release()
        return now

    def done(self, key: str) -> list[EngineRequest]:
        """`key` left the engine; returns the held requests that go in now."""
        with self._lock:
            cost = self._inside.pop(key, None)
            if cost is None:
                return []
            self._inside_tokens -= cost
            return self._release()

    def drop(self, wanted: Callable[[EngineRequest], bool]) -> list[EngineRequest]:
        """Take the held requests `wanted` says to drop (a cancelled job's) out."""
        with self._lock:
            gone = [h.request for h in self._held if wanted(h.request)]
            if gone:
                self._held = [h for h in self._held if not wanted(h.request)]
                heapq.heapify(self._held)
            return gone

    def held(self) -> list[EngineRequest]:
        """The requests waiting here, in the order they would go in."""
        with self._lock:
            return [h.request for h in sorted(self._held)]

    @property
    def inside(self) -> int:
        return len(self._inside)

    def _release(self) -> list[EngineRequest]:
        out = []
        while self._held and self._fits(self._held[0].cost):
            item = heapq.heappop(self._held)
            self._inside[item.request.key] = item.cost
            self._inside_tokens += item.cost
            out.append(item.request)
        return out


__all__ = ["Capacity", "EngineGate", "Reserve"]
