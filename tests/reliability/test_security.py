"""Scenario 8: security.

(a) Redis with `requirepass` and an ACL user limited to `~qbatch:*` and the commands the
    worker needs: requests succeed under the default prefix; under a prefix outside the
    ACL every write is refused, the worker keeps running, reports the Redis error (not
    ready), and commits nothing.
(b) Kafka SASL/PLAIN (`stack.sh up --sasl`, a private stack): a round trip through the
    worker with the printed credentials; a client with a wrong password is refused.
(c) No request can make the worker write outside its key prefix: hostile request_id /
    job_id values are rejected; SCAN over the whole (private) DB shows only prefix keys.
(d) Size limits: oversize envelope, too many messages / tools / stop sequences, huge
    metadata, custom_id, tool schema -> failed results naming the field.
"""

from __future__ import annotations

import collections
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import SecretStr

from producer.client import QBatchClient
from schemas import ConnectionSettings
from tests.reliability.conftest import (
    EnvLane,
    chat,
    committed_vs_end,
    dlq_count,
    dlq_sources,
    figures,
    free_port,
    log_events,
    make_lane,
    private_redis,
    private_stack,
    produce,
    produce_envelopes,
    scrape,
    stop_process,
    stop_worker,
    tail,
    wait_committed,
    wait_http,
    wait_results,
)

WORKER_COMMANDS = [
    # found by running the worker under the ACL: connection set-up, admission, the write
    "ping", "evalsha", "eval", "script|load", "script|exists",
    # called from the Lua scripts (checked against the ACL too)
    "exists", "set", "rpush", "expire", "ttl", "hincrby", "hset", "hmget", "xadd",
    "type", "get", "hsetnx", "getrange", "sadd", "sismember",
    # poison-pill strikes (read at start, written after a thread fault)
    "hgetall",
]  # fmt: skip


@pytest.fixture
def acl_redis(tmp_path: Path) -> Any:
    port = free_port()
    rules = " ".join(f"+{c}" for c in WORKER_COMMANDS)
    acl = tmp_path / "users.acl"
    acl.write_text(
        "user default off\n"
        "user admin on >admin-pw ~* &* +@all\n"
        f"user qbw on >qbw-pw resetkeys ~qbatch:* resetchannels -@all {rules}\n"
    )
    server = private_redis(port, tmp_path / "redis", "--aclfile", str(acl))
    yield port
    stop_process(server)


def test_redis_acl_user_limited_to_prefix(
    lane: EnvLane, spawn: Any, acl_redis: int, tmp_path: Path
) -> None:
    port = acl_redis
    admin = redis.Redis(port=port, username="admin", password="admin-pw", decode_responses=True)
    url = f"redis://qbw:qbw-pw@127.0.0.1:{port}/0"
    # 1. default prefix, inside the ACL: works
    ok_lane = make_lane("qbacl", lane.bootstrap, url)
    ok_lane.prefix = "qbatch"
    ok_lane.create_topics(partitions=2)
    try:
        envs = [chat(f"acl{i}", f"acl {i}", job_id="job-acl") for i in range(50)]
        produce_envelopes(ok_lane, envs)
        spawn(ok_lane, name="acl-ok")
        results = wait_results(admin, "qbatch", [e["request_id"] for e in envs], 60)
        assert wait_committed(ok_lane, 30)
    finally:
        ok_lane.delete_topics()
    assert len(results) == 50 and all(r["status"] == "succeeded" for r in results.values())
    assert int(admin.hget("qbatch:job:job-acl", "succeeded")) == 50
    # the worker's user really is confined
    confined = redis.Redis(port=port, username="qbw", password="qbw-pw")
    with pytest.raises(redis.exceptions.NoPermissionError):
        confined.set("elsewhere:x", "1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        confined.keys("*")

    # 2. a prefix outside the ACL: every write refused, nothing committed, worker alive
    bad_lane = make_lane("qbacl2", lane.bootstrap, url)
    bad_lane.prefix = "elsewhere"
    bad_lane.create_topics(partitions=2)
    mport = free_port()
    try:
        envs = [chat(f"deny{i}", f"deny {i}") for i in range(30)]
        produce_envelopes(bad_lane, envs)
        worker = spawn(bad_lane, "--drain-timeout-s", "5", name="acl-deny", metrics_port=mport)
        wait_http(mport)
        time.sleep(8)
        committed, end = committed_vs_end(bad_lane)
        alive = worker.poll() is None
        redis_up = scrape(mport, "qbatch_redis_up")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{mport}/readyz", timeout=2)
            ready = True
        except urllib.error.HTTPError:
            ready = False
        denied_keys = admin.keys("elsewhere:*")
    finally:
        bad_lane.delete_topics()
    log = tmp_path / "acl-deny.log"
    refused = log_events(log, "redis_unavailable") + log_events(log, "redis_command_refused")
    figures(
        "redis_acl",
        inside_prefix_results=len(results),
        outside_prefix_keys_written=len(denied_keys),
        outside_prefix_committed=committed,
        outside_prefix_log_end=end,
        worker_alive=alive,
        redis_up_metric=redis_up,
        ready=ready,
        redis_error_logged=bool(refused),
    )
    assert denied_keys == []
    assert committed == 0 and end == 30, "committed records whose results were refused"
    assert alive, f"the worker died:\n{tail(log)}"
    assert refused, f"the worker did not report the refused writes:\n{tail(log)}"
    assert redis_up == 0 and not ready


def test_kafka_sasl_round_trip_and_wrong_password(spawn: Any, tmp_path: Path) -> None:
    with private_stack("sasl", sasl=True) as ps:
        env = ps.env_vars
        assert env["QBATCH_KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT"
        assert env["QBATCH_KAFKA_SASL_MECHANISM"] == "PLAIN"
        creds = {k: v for k, v in env.items() if k.startswith("QBATCH_KAFKA_S")}
        lane = make_lane("qbsasl", ps.bootstrap, ps.redis_url, **creds)
        lane.topic, lane.dlq_topic = env["QBATCH_TOPIC"], env["QBATCH_DLQ_TOPIC"]
        lane.bulk_topic = env["QBATCH_BULK_TOPIC"]
        settings = ConnectionSettings(
            kafka_bootstrap=ps.bootstrap,
            redis_url=ps.redis_url,
            topic=lane.topic,
            prefix=lane.prefix,
            kafka_security_protocol="SASL_PLAINTEXT",
            kafka_sasl_mechanism="PLAIN",
            kafka_sasl_username=env["QBATCH_KAFKA_SASL_USERNAME"],
            kafka_sasl_password=env["QBATCH_KAFKA_SASL_PASSWORD"],
        )
        worker = spawn(lane, name="sasl-worker")
        t0 = time.monotonic()
        with QBatchClient(settings) as client:
            rids = [
                client.submit({"messages": [{"role": "user", "content": f"sasl {i}"}]})
                for i in range(10)
            ]
            results = client.wait_many(rids, timeout=60)
        round_trip_s = time.monotonic() - t0
        assert all(res is not None and res.status == "succeeded" for res in results.values())
        sasl_kwargs = settings.kafka_kwargs()
        del sasl_kwargs["bootstrap_servers"]
        assert wait_committed(lane, 30, **sasl_kwargs)

        # the broker's own word for a wrong password (a PLAINTEXT client fails otherwise)
        bad_password = "Authentication failed: Invalid username or password"
        bad_before = ps.server_log().count(bad_password)
        wrong = settings.model_copy(update={"kafka_sasl_password": SecretStr("not-the-password")})
        refused: Exception | None = None
        client = QBatchClient(
            wrong,
            producer_config={"max_block_ms": 5_000, "bootstrap_timeout_ms": 5_000},
            send_timeout_s=10,
        )
        try:
            client.submit({"messages": [{"role": "user", "content": "intruder"}]})
        except Exception as exc:
            refused = exc
        finally:
            client._closed = True  # nothing to flush: the producer never connected
        bad_after = ps.server_log().count(bad_password)
        plaintext: Exception | None = None
        try:
            from kafka import KafkaProducer

            KafkaProducer(
                bootstrap_servers=ps.bootstrap, max_block_ms=5_000, bootstrap_timeout_ms=5_000
            ).send(lane.topic, b"x").get(timeout=10)
        except Exception as exc:
            plaintext = exc
        auth_failures = ps.server_log().count("Failed authentication")
        stop_worker(worker)  # while its broker is still up
        sasl_rc = worker.returncode
        figures(
            "kafka_sasl",
            round_trip_results=sum(1 for r in results.values() if r is not None),
            round_trip_s=round_trip_s,
            wrong_password=repr(refused)[:80] if refused else "ACCEPTED",
            plaintext_client=type(plaintext).__name__ if plaintext else "ACCEPTED",
            broker_auth_failures_logged=auth_failures,
            broker_wrong_password_logged=bad_after - bad_before,
            worker_exit_rc=sasl_rc,
        )
        assert refused is not None, "a client with a wrong password was accepted"
        assert not isinstance(refused, AttributeError | TypeError), refused
        # kafka-python reports only "Unable to bootstrap": the broker's log says why
        assert bad_before == 0, "the right credentials were refused as a wrong password"
        assert bad_after > bad_before, "the broker did not refuse the wrong password"
        assert plaintext is not None, "a PLAINTEXT client was accepted"
        assert auth_failures >= 1
        assert sasl_rc == 0


BAD_IDS = ["a*b", "a/b", "a b", "a{b}", "a\nb", "x" * 200, "", "é", "a\x00b", "*", "a?b[c]"]


def test_no_key_outside_the_prefix_and_size_limits(
    lane: EnvLane, spawn: Any, tmp_path: Path
) -> None:
    port = free_port()
    server = private_redis(port, tmp_path / "redis")
    try:
        r = redis.Redis(port=port, decode_responses=True)
        assert r.dbsize() == 0
        plane = make_lane("qbkeys", lane.bootstrap, f"redis://127.0.0.1:{port}/0")
        plane.topic, plane.dlq_topic, plane.group = lane.topic, lane.dlq_topic, lane.group
        records: list[tuple[bytes | None, bytes]] = []
        answered: dict[str, str] = {}  # rid -> expected param
        id_less = 0
        for i, bad in enumerate(BAD_IDS):
            # as request_id: no recoverable id -> dead letter only
            records.append((None, json.dumps(chat(bad, "x")).encode()))
            records.append((bad.encode(), json.dumps(chat(bad, "x")).encode()))
            id_less += 2
            # as job_id of a good request_id -> a failed result naming job_id
            rid = f"jid{i}"
            records.append((rid.encode(), json.dumps(chat(rid, "x", job_id=bad)).encode()))
            answered[rid] = "job_id"
        tool = {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
        }
        big_schema = {
            "type": "object",
            "properties": {
                f"p{i}": {"type": "string", "description": "d" * 60} for i in range(1000)
            },
        }
        sized = {
            "sz-envelope": (chat("sz-envelope", "x" * 1_000_500), "(envelope)"),
            "sz-messages": ({"request_id": "sz-messages", "body": {"messages": [{"role": "user", "content": "x"}] * 1025}}, "body.messages"),
            "sz-tools": (chat("sz-tools", "x", body={"tools": [{"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object", "properties": {}}}} for i in range(129)]}), "body.tools"),
            "sz-tool-schema": (chat("sz-tool-schema", "x", body={"tools": [{"type": "function", "function": {"name": "f", "parameters": big_schema}}]}), "body.tools[0].function.parameters"),
            "sz-metadata": ({**chat("sz-metadata", "x"), "metadata": {"blob": "m" * 17_000}}, "metadata"),
            "sz-custom-id": ({**chat("sz-custom-id", "x"), "custom_id": "c" * 513}, "custom_id"),
            "sz-stop": (chat("sz-stop", "x", body={"stop": [f"s{i}" for i in range(17)], "tools": [tool]}), "body.stop"),
            "sz-ttl": ({**chat("sz-ttl", "x"), "result_ttl_s": 10**9}, "result_ttl_s"),
        }  # fmt: skip
        for rid, (env, param) in sized.items():
            records.append((rid.encode(), json.dumps(env).encode()))
            answered[rid] = param
        good = [chat(f"ok{i}", "fine") for i in range(20)]
        records += [(e["request_id"].encode(), json.dumps(e).encode()) for e in good]
        produce(plane, records)
        spawn(plane, name="keys-worker")
        results = wait_results(
            r, plane.prefix, list(answered) + [e["request_id"] for e in good], 60
        )
        assert wait_committed(plane, 30)
        dead = dlq_count(plane, timeout=20)
        keys = list(r.scan_iter(match="*", count=1000))
        outside = [k for k in keys if not k.startswith(f"{plane.prefix}:")]
        params = {rid: (res.get("error") or {}).get("param") for rid, res in results.items()}
        figures(
            "key_prefix_and_limits",
            hostile_ids=len(BAD_IDS),
            records=len(records),
            answered=sum(1 for rid in answered if rid in results),
            dlq=len(dead),
            keys_in_db=len(keys),
            keys_outside_prefix=len(outside),
            size_params={rid: params.get(rid) for rid in sized},
            codes=dict(collections.Counter((res.get("error") or {}).get("code", "ok") for res in results.values())),
        )  # fmt: skip
        assert outside == [], outside[:10]
        for e in good:
            assert results[e["request_id"]]["status"] == "succeeded"
        for rid, param in answered.items():
            res = results.get(rid)
            assert res is not None, rid
            assert res["status"] == "failed" and res["error"]["code"] == "invalid_request"
            assert res["error"]["param"].startswith(param), (rid, res["error"])
            assert res["error"]["message"].startswith(param), (rid, res["error"])
        assert len(dlq_sources(dead)) == id_less + len(answered)
    finally:
        stop_process(server)
