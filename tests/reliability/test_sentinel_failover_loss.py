"""How many results a planned Sentinel switchover loses, by `--redis-wait-replicas`
setting (slow; `QBATCH_FAILOVER_ROUNDS`, default 5, rounds a setting;
`QBATCH_FAILOVER_LOAD` `fast` (default) or `slow`, below).

The set of `stack.sh up --redis-sentinel` has `min-replicas-to-write 2` and
`min-replicas-max-lag 10` on every node. Each round: requests to an echo worker,
`SENTINEL FAILOVER` after a tenth of them are answered, every result read back on the new
master once the old one rejoined (tests/integration/sentinel_failover.py).

Asserted: with WAIT on every replica (`2`) no round loses a result. Measured, not
asserted: what the settings that do not close the window (none, `1`) lose, so the docs'
advice rests on a figure rather than on a reading of Redis' replication.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.integration.sentinel_failover import SLOW, failover_under_load
from tests.reliability.conftest import figures

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("QBATCH_FAILOVER_ROUNDS", "5"))
LOADS = {
    # CI's test: ~80 answers a second, so a promotion rarely lands on a write in flight
    "slow": {"n": 400, "after": 40, "worker_flags": SLOW},
    # the echo engine at full speed: results written continuously through the switchover
    "fast": {"n": 20_000, "after": 2_000, "worker_flags": ()},
}
LOAD = os.environ.get("QBATCH_FAILOVER_LOAD", "fast")


@pytest.mark.parametrize("wait_replicas", [None, 1, 2], ids=["no-wait", "wait-1", "wait-2"])
def test_results_lost_per_switchover(
    sentinel_url: str, stack: Any, tmp_path: Path, wait_replicas: int | None
) -> None:
    lost: list[int] = []
    paused = 0
    for i in range(ROUNDS):
        log = tmp_path / f"worker-{i}.log"
        rnd = failover_under_load(
            sentinel_url, stack.kafka_bootstrap, log, wait_replicas=wait_replicas, **LOADS[LOAD]
        )
        lost.append(len(rnd.lost))
        paused += "redis_unavailable" in rnd.events
    figures(
        "sentinel_switchover",
        wait_replicas=wait_replicas if wait_replicas is not None else "none",
        load=LOAD,
        rounds=ROUNDS,
        requests_per_round=LOADS[LOAD]["n"],
        lost_per_round=",".join(map(str, lost)),
        lost_total=sum(lost),
        rounds_with_loss=sum(x > 0 for x in lost),
        rounds_paused=paused,
    )
    if wait_replicas == 2:
        assert sum(lost) == 0, f"WAIT 2 lost results: {lost} per round"
