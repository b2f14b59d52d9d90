"""qbatch behind Redis Sentinel (`stack.sh up --redis-sentinel`: a master and two
replicas on 127.0.0.1:16479-16481 with `min-replicas-to-write 2`, three sentinels on
26479-26481, down-after 1 s): the worker and the client reach the master through a
`redis+sentinel://` URL, and through a master killed mid-stream and a `SENTINEL FAILOVER`
under load every request still gets exactly one result.

The module fixture starts the set itself (idempotent), so a clean clone runs this file.
Each test leaves the set whole (a killed node comes back as the new master's replica);
which port is the master is not fixed.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.sentinel import SentinelConnectionPool

from schemas import RedisKeys
from schemas.redis_conn import FailoverRedis, connect, parse_sentinel_url
from tests.integration.cluster_stack import run_stack
from tests.integration.sentinel_failover import (
    SLOW,
    bodies,
    failover_under_load,
    log_events,
    master_port,
    sentinel_fields,
)
from tests.integration.workers import Lane, echo_worker, qbatch, wait_for

pytestmark = pytest.mark.integration


def assert_paused_and_resumed(log: Path) -> None:
    events = log_events(log)
    assert "redis_unavailable" in events, "the worker never saw the failover"
    assert "redis_recovered" in events[events.index("redis_unavailable") :], events


def counters(client: Any, keys: RedisKeys, job: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(keys.job(job)).items()}


def test_worker_and_client_through_the_sentinels(
    sentinel_url: str, stack: Any, tmp_path: Path
) -> None:
    client = connect(sentinel_url)
    assert isinstance(client, FailoverRedis)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.get_master_address()[1] == master_port(sentinel_url)
    lane = Lane.on(stack.kafka_bootstrap, sentinel_url, "qbrs")
    lane.create_topics(2)
    try:
        with echo_worker(lane, log=tmp_path / "worker.log"), lane.client() as qb:
            ids = qb.submit_many(bodies("s", 30))
            got = qb.wait_many(ids, timeout=60)
            assert all(r is not None and r.ok for r in got.values()), got
        # the standalone layout, no hash tags
        assert RedisKeys(lane.prefix).result(ids[0]) == f"{lane.prefix}:result:{ids[0]}"
        assert client.get(f"{lane.prefix}:result:{ids[0]}") is not None
    finally:
        lane.clean_redis()
        lane.delete_topics()
        client.close()


def test_a_master_killed_mid_stream_is_failed_over_without_loss(
    sentinel_url: str, stack: Any, tmp_path: Path
) -> None:
    """kill -9 of the master while a bulk job and interactive requests are answered: the
    sentinels promote a replica within seconds, the worker pauses (`redis_unavailable`)
    and resumes (`redis_recovered`), a producer-side command issued during the failover
    waits it out, and every request has exactly one result, the job's counters exact."""
    lane = Lane.on(stack.kafka_bootstrap, sentinel_url, "qbrs")
    lane.create_topics(4)
    keys = RedisKeys(lane.prefix)
    lines = 300
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with src.open("w") as fh:
        for i, body in enumerate(bodies("b", lines)):
            line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions"}
            fh.write(json.dumps({**line, "body": body}) + "\n")
    client = connect(sentinel_url)
    log = tmp_path / "worker.log"
    old = master_port(sentinel_url)
    done: dict[str, Any] = {}

    def run_bulk() -> None:
        done["bulk"] = qbatch(
            lane, "-q", "bulk", "run", str(src), "--out", str(out), "--job", "sj",
            "--timeout", "120", timeout=180,
        )  # fmt: skip

    def probe() -> None:
        t0 = time.monotonic()
        client.set(f"{lane.prefix}:probe", "1")  # waits out the failover
        done["probe_s"] = time.monotonic() - t0

    try:
        # WAIT for both replicas after each chunk too (`--redis-wait-replicas 2`): its
        # pipeline through the sentinel-managed client, across the failover. 1 would leave
        # a result only the replica not promoted had (the sentinels choose by replication
        # offsets that may be stale); 2 costs nothing more here: min-replicas-to-write 2
        # already stops writes until the killed node is back
        with (
            echo_worker(lane, *SLOW, "--redis-wait-replicas", "2", log=log),
            lane.client() as qb,
        ):
            runner = threading.Thread(target=run_bulk)
            runner.start()
            interactive = bodies("n", 100)
            ids = qb.submit_many(interactive[:50])
            wait_for(
                "40 results of the job",
                lambda: int(client.hget(keys.job("sj"), "succeeded") or 0) >= 40,
                timeout=60,
            )
            before = int(client.hget(keys.job("sj"), "succeeded") or 0)
            run_stack("kill-redis", str(old), timeout=60)
            prober = threading.Thread(target=probe)
            prober.start()
            ids += qb.submit_many(interactive[50:])  # published while Redis fails over
            wait_for("a new master", lambda: master_port(sentinel_url) not in (None, old), 60)
            new = master_port(sentinel_url)
            # back as the new master's replica: with min-replicas-to-write 2 the new
            # master takes writes once it has both replicas again
            run_stack("start-redis", str(old), timeout=60)
            got = qb.wait_many(ids, timeout=120)
            runner.join(timeout=180)
            prober.join(timeout=90)
        assert before < lines, "the job was done before the kill: nothing was tested"
        missing = [rid for rid, r in got.items() if r is None]
        assert not missing, f"{len(missing)} requests without a result: {missing[:5]}"
        assert all(r is not None and r.ok for r in got.values())
        proc = done["bulk"]
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert [x["custom_id"] for x in rows] == [f"c{i}" for i in range(lines)]
        assert all(x["error"] is None for x in rows)
        h = counters(client, keys, "sj")
        assert (h["status"], h["total"], h["succeeded"]) == ("completed", "300", "300"), h
        assert "failed" not in h or h["failed"] == "0", h
        assert client.xlen(keys.job_stream("sj")) == lines  # each counted exactly once
        assert_paused_and_resumed(log)
        assert done.get("probe_s", 0) > 0.5, f"the probe did not wait: {done}"
        print(f"kill {old} -> {new} at {before}/{lines}: the probe waited {done['probe_s']:.1f}s")
    finally:
        # restarts a node still down (as the master's replica) and waits until the set is ok
        run_stack("up", "--redis-sentinel", timeout=300)
        lane.clean_redis()
        lane.delete_topics()
        client.close()


def test_a_sentinel_failover_under_load_loses_no_result(
    sentinel_url: str, stack: Any, tmp_path: Path
) -> None:
    """`SENTINEL FAILOVER` while the worker writes: the old master stays a master for
    seconds after its replica is promoted. With Redis' defaults most writes taken there
    were acknowledged and then dropped; `min-replicas-to-write 2` (checked below) makes it
    refuse them once the promoted replica left it. What remains is replication's tail: a
    result the promoted replica had not yet applied when it was promoted (the likely cause
    of a CI run losing 4 of 400). `--redis-wait-replicas 2` (every replica) closes that
    for one failover of a healthy set: a result counts as stored only once both replicas
    have it, so whichever is promoted has it, and no result is lost."""
    rnd = failover_under_load(
        sentinel_url, stack.kafka_bootstrap, tmp_path / "worker.log", wait_replicas=2
    )
    assert not rnd.lost, f"{len(rnd.lost)} of {rnd.submitted} results lost: {rnd.lost[:5]}"
    assert_paused_and_resumed(tmp_path / "worker.log")
    print(f"SENTINEL FAILOVER {rnd.old} -> {rnd.new}: 0 of {rnd.submitted} lost")


def test_every_data_node_refuses_writes_without_both_replicas(sentinel_url: str) -> None:
    """The set the docs describe: `min-replicas-to-write 2` on the master and on both
    replicas (a replica keeps it for when it is promoted). The failover tests above wait
    for both replicas themselves, so without this check the setting could go and CI would
    not notice, though it alone keeps the old master from taking writes after a
    `SENTINEL FAILOVER`."""
    target = parse_sentinel_url(sentinel_url)
    host, port = target.sentinels[0]
    with redis.Redis(host=host, port=port, socket_timeout=5, decode_responses=True) as sentinel:
        master = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", target.service)
        replicas = sentinel.execute_command("SENTINEL", "REPLICAS", target.service)
    nodes = [(master[0], int(master[1]))]
    nodes += [(f["ip"], int(f["port"])) for f in map(sentinel_fields, replicas)]
    assert len(nodes) == 3, nodes
    for ip, node_port in nodes:
        with redis.Redis(host=ip, port=node_port, socket_timeout=5, decode_responses=True) as node:
            assert node.config_get("min-replicas-to-write") == {"min-replicas-to-write": "2"}, (
                ip,
                node_port,
            )
