"""The Redis key layout is unambiguous: no id the contract allows names a key of another
kind or of another job (issue: a job called `vic:done` was job `vic`'s stream)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import ContractError, RedisKeys, decode_request, limits
from schemas.decode import valid_id

# ids built from the pieces keys are made of, so collisions are likely if they can happen
PIECES = [":", "done", "cancel", "result", "job", "strikes", "a", "vic", "-", ".", "_", "1"]
PIECES += ["serve", "usage", "counted", "tenant", "batches", "2026-01-02", "2026-01-20"]
ids = (
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=6)
    .map("".join)
    .filter(lambda s: valid_id(s) is not None)
)
DAYS = ["2026-01-02", "2026-01-20"]
prefixes = st.sampled_from(["qbatch", "q", "qbatch.job", "a-b_c.d"])


def allowed_job(job_id: str) -> bool:
    """What the envelope accepts as job_id."""
    return valid_id(job_id) is not None and not job_id.endswith(limits.RESERVED_JOB_SUFFIXES)


def all_keys(
    keys: RedisKeys, request_ids: list[str], job_ids: list[str]
) -> list[tuple[str, str, str]]:
    out = []
    for rid in request_ids:
        out += [("result", rid, keys.result(rid)), ("done", rid, keys.done(rid))]
    for job in job_ids:
        out += [
            ("job", job, keys.job(job)),
            ("job_stream", job, keys.job_stream(job)),
            ("job_cancel", job, keys.job_cancel(job)),
            ("job_counted", job, keys.job_counted(job)),
            ("job_lines", job, keys.job_lines(job)),
            ("strikes", job, keys.strikes(job)),
            # qbatch serve: batch ids and tenant names come from the same id alphabet
            ("serve_batch", job, keys.serve_batch(job)),
            ("serve_tenant_batches", job, keys.serve_tenant_batches(job)),
            ("serve_tenant_active", job, keys.serve_tenant_active(job)),
            ("serve_file", job, keys.serve_file(job)),
            ("serve_file_gone", job, keys.serve_file_gone(job)),
            ("serve_tenant_files", job, keys.serve_tenant_files(job)),
            ("serve_tenant_files_batch", job, keys.serve_tenant_files(job, "batch")),
        ]
        for day in DAYS:  # usage: a tenant and a day, both parts of the key
            out += [
                ("serve_usage", f"{job}|{day}", keys.serve_usage(job, day)),
                ("serve_usage_counted", f"{job}|{day}", keys.serve_usage_counted(job, day)),
            ]
    out.append(("serve_active", "", keys.serve_active()))
    for name in ("serve_storage_bytes", "serve_files_expiring", "serve_files_imported"):
        out.append((name, "", getattr(keys, name)()))
    out += [("serve_lease", "", keys.serve_lease()), ("serve_epoch", "", keys.serve_lease_epoch())]
    return out


@settings(max_examples=400, deadline=None, database=None)
@given(
    prefixes,
    st.lists(ids, max_size=12, unique=True),
    st.lists(ids, max_size=12, unique=True),
    st.booleans(),
)
def test_every_key_function_is_injective_across_kinds(
    prefix: str, request_ids: list[str], job_ids: list[str], cluster: bool
) -> None:
    keys = RedisKeys(prefix, cluster=cluster)
    job_ids = [j for j in job_ids if allowed_job(j)]
    seen: dict[str, tuple[str, str]] = {}
    for kind, ident, key in all_keys(keys, request_ids, job_ids):
        assert key.startswith(prefix + ":")
        other = seen.setdefault(key, (kind, ident))
        assert other == (kind, ident), f"{key!r} is both {other} and {(kind, ident)}"


def test_the_reported_collisions_are_gone() -> None:
    keys = RedisKeys()
    # what a job may be called no longer names job vic's stream or cancel flag
    assert keys.job("vic:done") == keys.job_stream("vic")
    assert not allowed_job("vic:done") and not allowed_job("vic:cancel")
    assert allowed_job("vic:done:x") and allowed_job("vic.done") and allowed_job("done")


@pytest.mark.parametrize("job_id", ["vic:done", "vic:cancel", "a:b:cancel"])
def test_a_reserved_job_suffix_is_refused_naming_job_id(job_id: str) -> None:
    envelope = {
        "request_id": "r1",
        "job_id": job_id,
        "body": {"messages": [{"role": "user", "content": "hi"}]},
    }
    raw = json.dumps(envelope).encode()
    with pytest.raises(ContractError) as info:
        decode_request(raw, b"r1")
    assert info.value.param == "job_id"
    assert ":done" in info.value.message and info.value.request_id == "r1"


def crc16_slot(key: str) -> int:
    """Redis Cluster's slot of a key (CRC16/XMODEM of its hash tag, mod 16384)."""
    start = key.find("{")
    if start != -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    crc = 0
    for byte in key.encode():
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc % 16384


@settings(max_examples=200, deadline=None, database=None)
@given(prefixes, ids, ids)
def test_cluster_keys_a_script_touches_together_share_a_slot(
    prefix: str, rid: str, job: str
) -> None:
    keys = RedisKeys(prefix, cluster=True)
    assert crc16_slot(keys.result(rid)) == crc16_slot(keys.done(rid))
    job_keys = (keys.job, keys.job_stream, keys.job_cancel, keys.job_counted, keys.job_lines)
    assert len({crc16_slot(k(job)) for k in job_keys}) == 1
    serve = [keys.serve_batch(job), keys.serve_tenant_batches(rid), keys.serve_active()]
    serve.append(keys.serve_tenant_active(rid))
    assert len({crc16_slot(k) for k in serve}) == 1
    day = "2026-12-05"
    assert crc16_slot(keys.serve_usage(rid, day)) == crc16_slot(keys.serve_usage_counted(rid, day))
    # the standalone layout is the v1 contract, unchanged
    assert RedisKeys(prefix).result(rid) == f"{prefix}:result:{rid}"
    # the ack key set before a WAIT lives in the slot of the writes it follows
    for key in (keys.result(rid), keys.job_counted(job), keys.serve_active()):
        assert crc16_slot(keys.ack(key)) == crc16_slot(key)
        assert keys.ack(key).startswith(f"{prefix}:ack:{{")


def test_the_ack_key() -> None:
    assert RedisKeys("q").ack() == "q:ack"  # one server: one key, whatever was written
    cluster = RedisKeys("q", cluster=True)
    assert cluster.ack("q:result:{r1}") == "q:ack:{r1}"
    # a key without a tag is hashed whole: the ack key tags it whole (keys built here
    # never hold a brace outside their tag: ids cannot)
    assert cluster.ack("plain") == "q:ack:{plain}"
    assert crc16_slot(cluster.ack("plain")) == crc16_slot("plain")


@pytest.mark.parametrize("cluster", [False, True])
def test_usage_keys_parse_back(cluster: bool) -> None:
    keys = RedisKeys("qb", cluster=cluster)
    key = keys.serve_usage("team-a.x", "2026-12-05")
    assert keys.serve_usage_of(key) == ("team-a.x", "2026-12-05")
    assert keys.serve_usage_of(keys.serve_usage_counted("t", "2026-12-05")) is None
    assert keys.serve_usage_of(keys.result("r")) is None
