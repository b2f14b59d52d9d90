"""Scenario 15: a zombie worker. A is SIGSTOPped with work in flight, past its session
timeout; B takes A's partitions and answers everything; then A is SIGCONTed.

A wakes up with a stale micro-batch (answers due, offsets done but not committed) for
partitions that are now B's. The promise (issue 19): A must not commit offsets for
partitions it lost, must not overwrite a result B wrote, must not count a job counter
twice, and must come back as a healthy member of the group.

How each is shown:
- every accepted offset commit of the group is read back from the broker's own log of
  them (`__consumer_offsets`, the partition the group hashes to): per partition the
  committed offset never goes backwards, before or after A wakes (a stale commit of
  A's would move it back below what B committed); `KafkaAdminClient.list_group_offsets` before
  SIGCONT and at the end agrees;
- A's log names every commit it tried after waking and why it was refused (the broker's
  UNKNOWN_MEMBER_ID, or kafka-python's "not part of an active group"), and the
  `partitions_lost` line with the done offsets it did not commit;
- A does not fetch from below the group's committed offsets when its partitions come
  back (it once sought back to its stale first unanswered offset: it re-read ~40 records
  B had answered, and its next commit could move the group's offset backwards);
- the stored value of every result is byte-identical before and after SIGCONT (results
  carry `worker.id`, so B's answers to A's stale records stay B's);
- the job hash counts exactly N and the job stream holds N entries; every wake-up list
  holds one element;
- A's `qbatch_duplicates_skipped_total` shows it did try to write (or run) its stale work;
- after waking, A owns partitions again and answers new requests.

Figures (2 cores, shared): 8 partitions, 600 requests of one job + 40 after the wake; A
stopped ~9 s (session timeout 6 s) with 32 in flight; 19-24 s in all.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from pathlib import Path
from typing import Any

import redis
from kafka import KafkaAdminClient, KafkaConsumer
from kafka.structs import TopicPartition

from tests.integration.workers import wait_for
from tests.reliability.conftest import (
    EnvLane,
    chat,
    done_lengths,
    figures,
    free_port,
    job_finished,
    new_job,
    produce_envelopes,
    scrape,
    wait_committed,
    wait_http,
    wait_job,
    wait_results,
)

JOB = "job-zombie"
N = 600
EXTRA = 40
SESSION_MS = 6_000  # the broker's group.min.session.timeout.ms; heartbeats every 3 s
FLAGS = (
    "--session-timeout-ms", str(SESSION_MS),
    "--echo-delay-ms", "400",
    "--max-inflight", "32",
    "--batch-max-size", "8",
    "--drain-timeout-s", "10",
)  # fmt: skip
A_FLAGS = ("--commit-interval-ms", "3000", "--echo-concurrency", "8")
"""A holds answered-but-uncommitted records (commits every 3 s) and records still running
(8 at a time, 400 ms each: 32 in flight take 1.6 s) at any moment: when it wakes it has
a commit to attempt at once and stale records finishing over the next second."""
OFFSETS_TOPIC = "__consumer_offsets"
FENCED_EVENTS = ("revoke_commit_failed", "commit_failed_rebalance", "commit_failed")
"""A's commit refused: by the broker (UNKNOWN_MEMBER_ID, its session expired) or by
kafka-python (no active generation)."""


# ---------------------------------------------------------------------------- the group's commits


def _java_hash(text: str) -> int:
    h = 0
    for unit in struct.unpack(f"<{len(text.encode('utf-16-le')) // 2}H", text.encode("utf-16-le")):
        h = (31 * h + unit) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def _read_str(buf: bytes, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from(">h", buf, pos)
    return buf[pos + 2 : pos + 2 + n].decode(), pos + 2 + n


class CommitLog:
    """Every offset commit the broker accepted for one group, read from the internal
    `__consumer_offsets` partition the group maps to (Kafka: abs(hashCode) % partitions).

    Record key: int16 version (0/1: an offset commit), group, topic, partition; value:
    int16 version, int64 offset, ... (None: a tombstone)."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        self.group, self.topic = group, topic
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False
        )
        count = len(self._consumer.partitions_for_topic(OFFSETS_TOPIC) or ())
        assert count, "no __consumer_offsets metadata"
        h = _java_hash(group)
        index = 0 if h == -(1 << 31) else abs(h) % count
        self.tp = TopicPartition(OFFSETS_TOPIC, index)
        self._consumer.assign([self.tp])
        self._consumer.seek(self.tp, self._consumer.end_offsets([self.tp])[self.tp])
        self.commits: list[tuple[int, int, int]] = []
        """(broker append time ms, partition, offset) in log order."""

    def read(self, settle_s: float = 1.0) -> list[tuple[int, int, int]]:
        end = self._consumer.end_offsets([self.tp])[self.tp]
        deadline = time.monotonic() + 30
        while self._consumer.position(self.tp) < end and time.monotonic() < deadline:
            for batch in self._consumer.poll(timeout_ms=500).values():
                for rec in batch:
                    self._add(rec)
        time.sleep(settle_s)
        for batch in self._consumer.poll(timeout_ms=200).values():
            for rec in batch:
                self._add(rec)
        return self.commits

    def _add(self, rec: Any) -> None:
        if rec.key is None or rec.value is None:
            return
        (kver,) = struct.unpack_from(">h", rec.key, 0)
        if kver not in (0, 1):
            return
        group, pos = _read_str(rec.key, 2)
        topic, pos = _read_str(rec.key, pos)
        (partition,) = struct.unpack_from(">i", rec.key, pos)
        if group != self.group or topic != self.topic:
            return
        (offset,) = struct.unpack_from(">q", rec.value, 2)
        self.commits.append((rec.timestamp, partition, offset))

    def close(self) -> None:
        self._consumer.close()


def backwards(commits: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """(time, partition, from, to) of every accepted commit below the one before it."""
    last: dict[int, int] = {}
    out = []
    for t, p, off in commits:
        if p in last and off < last[p]:
            out.append((t, p, last[p], off))
        last[p] = max(last.get(p, off), off)
    return out


def group_offsets(lane: EnvLane) -> dict[int, int]:
    admin = KafkaAdminClient(bootstrap_servers=lane.bootstrap.split(","))
    try:
        got = admin.list_group_offsets(lane.group)[lane.group]  # kafka-python 3
    finally:
        admin.close()
    return {tp.partition: meta.offset for tp, meta in got.items() if tp.topic == lane.topic}


# ---------------------------------------------------------------------------- worker logs


def events(path: Path, names: tuple[str, ...], start: int = 0) -> list[dict[str, Any]]:
    """The worker's JSON log lines whose event is in `names`, from byte `start` on."""
    out = []
    with path.open("rb") as fh:
        fh.seek(start)
        for line in fh.read().decode(errors="replace").splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and obj.get("event") in names:
                out.append(obj)
    return out


def assigned(path: Path, start: int = 0) -> set[int]:
    """The partitions held after the latest assignment logged from byte `start` on (empty
    when none was logged since, or they were revoked or lost after it)."""
    got = events(path, ("partitions_assigned", "partitions_revoked", "partitions_lost"), start)
    latest: set[int] | None = None
    for ev in got:
        parts = {int(name.rsplit("/", 1)[1]) for name in ev.get("partitions", [])}
        if ev["event"] == "partitions_assigned":
            latest = parts
        elif latest is not None:
            latest -= parts
    return latest or set()


# ---------------------------------------------------------------------------- the scenario


def test_zombie_worker_is_fenced(
    lane: EnvLane, redis_client: redis.Redis, spawn: Any, tmp_path: Path
) -> None:
    r: Any = redis_client  # redis-py's stubs type every reply as maybe-awaitable
    prefix = lane.prefix
    partitions = 8  # the `lane` fixture's topic
    log_a, log_b = tmp_path / "A.log", tmp_path / "B.log"
    commit_log = CommitLog(lane.bootstrap, lane.group, lane.topic)
    port_a, port_b = free_port(), free_port()
    t_start = time.monotonic()
    a = spawn(lane, *FLAGS, *A_FLAGS, "--worker-id", "zombie-A",
              name="A", metrics_port=port_a)  # fmt: skip
    b = spawn(lane, *FLAGS, "--worker-id", "zombie-B", name="B", metrics_port=port_b)
    wait_http(port_a, 60)
    wait_http(port_b, 60)

    def split() -> bool:  # both members hold partitions, together all of them
        pa = assigned(log_a)
        pb = assigned(log_b)
        return bool(pa) and bool(pb) and pa | pb == set(range(partitions)) and not pa & pb

    wait_for("A and B to share the partitions", split, 60)
    owned_a = assigned(log_a)

    new_job(r, prefix, JOB, N)
    envelopes = [chat(f"z{i}", f"zombie {i}", job_id=JOB) for i in range(N)]
    rids = [e["request_id"] for e in envelopes]
    produce_envelopes(lane, envelopes)

    # --- stop A while it holds work
    wait_for("a quarter of the job", lambda: job_finished(r, prefix, JOB) >= N // 4, 60)
    in_flight_a = 0.0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        in_flight_a = scrape(port_a, "qbatch_in_flight_requests")
        if in_flight_a > 0:
            break
        time.sleep(0.02)
    os.kill(a.pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    done_at_stop = job_finished(r, prefix, JOB)
    offsets_at_stop = group_offsets(lane)
    assert in_flight_a > 0, "A had nothing in flight when stopped"
    assert done_at_stop < N, "the job finished before A was stopped: slow the engine down"

    # --- B takes over A's partitions and answers everything
    b_mark = log_b.stat().st_size

    def b_owns_all() -> bool:
        pb = assigned(log_b, b_mark)
        return pb == set(range(partitions))

    takeover_s = wait_for("B to take A's partitions", b_owns_all, SESSION_MS / 1000 + 30)
    assert wait_job(r, prefix, JOB, N, 90) == N, "B did not answer the whole job"
    assert wait_committed(lane, 30), "B did not commit to the log end"
    before_results = dict(zip(rids, r.mget([f"{prefix}:result:{x}" for x in rids]), strict=True))
    by_writer: dict[str, int] = {}
    for raw in before_results.values():
        assert raw is not None
        wid = json.loads(raw)["worker"]["id"]
        by_writer[wid] = by_writer.get(wid, 0) + 1
    offsets_before = group_offsets(lane)
    job_before = r.hgetall(f"{prefix}:job:{JOB}")

    # --- wake A
    a_mark = log_a.stat().st_size
    dup_b_before = scrape(port_b, "qbatch_duplicates_skipped_total")
    os.kill(a.pid, signal.SIGCONT)
    t_cont = time.monotonic()
    stopped_s = t_cont - t_stop
    wall_cont_ms = int(time.time() * 1000)
    # A's count of records fetched, read at once: its partitions come back only after a
    # rebalance round with B (B hears of it at its next heartbeat, 1.3-1.9 s here)
    consumed_a = scrape(port_a, "qbatch_records_consumed_total")

    def a_back() -> bool:
        pa = assigned(log_a, a_mark)
        pb = assigned(log_b, b_mark)
        return bool(pa) and bool(pb) and pa | pb == set(range(partitions)) and not pa & pb

    rejoin_s = wait_for("A to rejoin the group", a_back, 60)
    wait_http(port_a, 10)
    time.sleep(2)  # A finishes what it held (writes refused, commits refused)
    dup_a = scrape(port_a, "qbatch_duplicates_skipped_total")
    # nothing was produced since B committed the log end: whatever A fetched since it
    # got partitions back, it fetched from below the group's committed offset
    reread_a = int(scrape(port_a, "qbatch_records_consumed_total") - consumed_a)
    assert a.poll() is None, f"A exited with {a.returncode} after waking"

    # --- A is a healthy member: new requests on every partition are answered, some by A
    extra = [chat(f"zx{i}", f"after {i}") for i in range(EXTRA)]
    produce_envelopes(lane, extra)
    extra_results = wait_results(r, prefix, [e["request_id"] for e in extra], 60)
    extra_by_a = sum(1 for res in extra_results.values() if res["worker"]["id"] == "zombie-A")
    assert wait_committed(lane, 30), "offsets did not reach the log end after A woke"
    offsets_after = group_offsets(lane)

    after_results = dict(zip(rids, r.mget([f"{prefix}:result:{x}" for x in rids]), strict=True))
    overwritten = [rid for rid in rids if after_results[rid] != before_results[rid]]
    lengths = done_lengths(r, prefix, rids)
    job = r.hgetall(f"{prefix}:job:{JOB}")
    stream_len = r.xlen(f"{prefix}:job:{JOB}:done")
    counted = sum(int(job.get(k, 0)) for k in ("succeeded", "failed", "expired", "cancelled"))
    commits = commit_log.read()
    commit_log.close()
    back = backwards(commits)
    commits_after_wake = [c for c in commits if c[0] >= wall_cont_ms]
    fenced = events(log_a, FENCED_EVENTS, a_mark)
    lost = events(log_a, ("partitions_lost",), a_mark)
    a_alive = a.poll() is None
    a.send_signal(signal.SIGTERM)
    rc_a = a.wait(30)
    elapsed = time.monotonic() - t_start

    figures(
        "zombie",
        partitions=partitions,
        sent=N,
        extra=EXTRA,
        A_partitions=sorted(owned_a),
        A_in_flight_at_stop=int(in_flight_a),
        done_at_stop=done_at_stop,
        stopped_s=stopped_s,
        takeover_s=takeover_s,
        rejoin_s=rejoin_s,
        results_by_writer=by_writer,
        committed_at_stop={str(k): v for k, v in sorted(offsets_at_stop.items())},
        committed_before_cont={str(k): v for k, v in sorted(offsets_before.items())},
        committed_after={str(k): v for k, v in sorted(offsets_after.items())},
        commits_accepted=len(commits),
        commits_accepted_after_wake=len(commits_after_wake),
        commits_backwards=len(back),
        A_fenced_attempts=[(e["event"], e.get("error", "")[:60]) for e in fenced],
        A_lost_not_committed=[e.get("not_committed") for e in lost],
        A_duplicates_skipped=int(dup_a),
        A_reread_after_wake=reread_a,
        B_duplicates_skipped_during_wake=int(scrape(port_b, "qbatch_duplicates_skipped_total")
                                             - dup_b_before),
        extra_answered_by_A=extra_by_a,
        overwritten=len(overwritten),
        job={k: job.get(k) for k in ("total", "succeeded", "failed", "status")},
        stream_len=stream_len,
        A_exit_rc=rc_a,
        total_s=elapsed,
    )  # fmt: skip

    # A's partitions went to B while A slept; B answered A's unfinished records
    assert by_writer.get("zombie-B", 0) > N // 2, by_writer
    # no result overwritten, none written twice, counters exact
    assert not overwritten, f"{len(overwritten)} results changed after A woke: {overwritten[:5]}"
    assert all(x == 1 for x in lengths), "a wake-up list holds more (or less) than one element"
    assert job == job_before, "the job hash changed after A woke"
    assert counted == N and int(job["succeeded"]) == N and stream_len == N
    assert job["status"] == "completed"
    # A woke with stale work: it tried to write it (refused: answered already) and to commit
    # its offsets (refused by the group)
    assert dup_a > 0, "A held no stale work when it woke"
    # its stale offsets were behind B's commits, so an accepted stale commit would show as
    # a backward move below
    assert any(offsets_before[p] > offsets_at_stop.get(p, 0) for p in owned_a)
    assert reread_a == 0, f"A woke and re-read {reread_a} records from below the group's commit"
    assert lost, "A did not notice it had lost its partitions"
    # A held done offsets it had not committed: its attempt was refused (by the broker or
    # by kafka-python), or it saw the loss first and did not attempt
    assert fenced or any(e.get("not_committed") for e in lost), (fenced, lost)
    # no accepted commit moved an offset backwards; the end state is the log end
    assert not back, f"offsets committed backwards: {back[:5]}"
    assert all(offsets_after[p] >= off for p, off in offsets_before.items())
    assert commits, "the commit log read nothing: wrong __consumer_offsets partition?"
    # A is a healthy member again
    assert len(extra_results) == EXTRA
    assert extra_by_a > 0, "A answered none of the new requests"
    assert a_alive and rc_a == 0
    assert b.poll() is None
