"""Priority lanes: which lanes' partitions a worker fetches from, decided by a rule.

Requests travel on one topic per lane (interactive, bulk, ...), best lane first. Kafka
orders records only within a partition, so an interactive request on its own topic is
never behind a nightly job in the log; this rule keeps it from waiting behind one in
the worker too. Each turn of the main loop, for every lane below the best:

* **yield**: while a better lane has records waiting in Kafka, or more than
  `yield_above` requests in flight, the lane stops fetching, but only down to its
  `min_inflight`: that floor is the lane's guaranteed share, so a steady interactive
  trickle cannot starve a bulk job;
* **cap**: a lane never has more than its `max_inflight` records in flight (bulk's
  default cap leaves a quarter of `max_inflight` free, so interactive requests always
  find room); a lane at its cap resumes below `resume_ratio` of it.

Inside the engine the lanes keep their order too (worker.dispatch maps a lane's rank to
a vLLM priority above every request priority). Global backpressure (`max_inflight`
overall, a sink down) pauses every lane, as before; offsets, at-least-once and the
commit rule hold per partition, whatever lane it belongs to.

Pure: loads in, the set of lanes to keep paused out; the worker applies it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["LaneGate", "LaneLoad", "LanePolicy"]


@dataclass(frozen=True, slots=True)
class LanePolicy:
    name: str
    topic: str
    rank: int
    """0 for the best lane."""
    max_inflight: int
    min_inflight: int = 0


@dataclass(frozen=True, slots=True)
class LaneLoad:
    in_flight: int = 0
    """Records of the lane taken from Kafka and not yet answered."""
    waiting: int = 0
    """Records of the lane known to be in Kafka and not yet taken (consumer lag)."""


@dataclass
class LaneGate:
    lanes: Sequence[LanePolicy]
    yield_above: int = 0
    """A better lane with more than this many in flight makes worse lanes yield."""
    resume_ratio: float = 0.75
    _capped: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        ranks = [lane.rank for lane in self.lanes]
        if ranks != sorted(ranks) or len(set(ranks)) != len(ranks):
            raise ValueError("lanes must be given best first, one rank each")

    def paused(self, loads: Mapping[str, LaneLoad]) -> frozenset[str]:
        """The lanes that must not fetch now."""
        out: set[str] = set()
        demand_above = False
        for lane in self.lanes:
            load = loads.get(lane.name, LaneLoad())
            if self._at_cap(lane, load.in_flight) or (
                demand_above and load.in_flight >= lane.min_inflight
            ):
                out.add(lane.name)
            demand_above = demand_above or load.waiting > 0 or load.in_flight > self.yield_above
        return frozenset(out)

    def poll_room(self, loads: Mapping[str, LaneLoad], held: frozenset[str], room: int) -> int:
        """How many records the next poll may take: `room` (what `max_inflight` leaves),
        but no more than any lane that is fetching has left under its cap. One poll
        returns records of every fetching lane, so without this a single poll could carry
        a lane far past its cap before the rule sees it."""
        for lane in self.lanes:
            if lane.name not in held:
                in_flight = loads.get(lane.name, LaneLoad()).in_flight
                room = min(room, lane.max_inflight - in_flight)
        return max(room, 1)

    def _at_cap(self, lane: LanePolicy, in_flight: int) -> bool:
        if lane.name in self._capped:
            if in_flight <= int(lane.max_inflight * self.resume_ratio):
                self._capped.discard(lane.name)
                return False
            return True
        if in_flight >= lane.max_inflight:
            self._capped.add(lane.name)
            return True
        return False
