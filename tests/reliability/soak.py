"""The randomized chaos soak: three echo workers on the three-broker Kafka and the Redis
Cluster (`stack.sh up --brokers 3 --redis-cluster`), a traffic mix, and the faults of
`chaos.schedule(seed)`; at the end, the invariants of the contract.

Traffic (drawn from the seed too): plain requests, requests with tools, requests with a
deadline a few seconds either side of their publication (so some expire), envelopes
that fail validation but name a request_id (a `failed` result and a dead letter), bytes
that are not JSON at all (a dead letter only), and two bulk jobs through the CLI, one of
them cancelled while it is being published. The other one's results live
`SHORT_RESULT_TTL_S` only, so records a killed worker left uncommitted come back after
their results expired: its counters must stay exact all the same (issue 39), and it is
checked through its job's stream and counted set instead of its (gone) results.

The workers and the CLI reach every Redis node through a delaying TCP proxy the test
owns (tests/reliability/tcp_proxy.py; `QBATCH_REDIS_ADDRESS_MAP` maps each node's
announced address to its proxy's), so a `redis_slow` fault can add latency to their link
to one master or to every node. The harness's own observers connect directly: what they
measure is not slowed by the fault they measure.

While it runs, an observer polls every expected result (the first value seen of each is
hashed, to prove later that none was overwritten) and samples the group's committed
offsets: every record below a committed offset must have its result at that moment.
A sampler tracks each worker's RSS. Faults are applied and undone on a thread of their
own, following the schedule's clock.

The report (a dict, also the table row of tests/reliability/README.md) counts faults by
kind, requests, lost and duplicated results, the jobs' counters against their results,
recovery times (how long after a fault ended every request published before it started
had its answer), and peak RSS. `SoakFailure` carries the seed so a failure replays.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition

from schemas import RedisKeys
from schemas.redis_conn import connect, mget
from tests.integration.cluster_stack import ClusterStack
from tests.integration.workers import Lane, qbatch, qbatch_popen, start_worker, stop_worker
from tests.reliability import redis_faults
from tests.reliability.chaos import ALL_NODES, Fault, FaultKind, schedule
from tests.reliability.soak_report import job_verdict, recovery_times, statuses_of
from tests.reliability.tcp_proxy import DelayProxy, address_map, proxies_for

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


SHORT_RESULT_TTL_S = 3
APPLY_TRIES = 5  # a fault the harness could not make (its node busy) is tried again
UNDO_TRIES = 20  # a fault's undo is tried this often, a second apart, before the run fails
"""The first bulk job's result_ttl_s: shorter than a killed worker's records take to come
back (the session timeout), so redelivered ones find their results expired."""


class SoakFailure(AssertionError):
    pass


@dataclass(frozen=True)
class SoakConfig:
    seed: int
    duration_s: float = 90.0
    requests: int = 4_000
    job_lines: tuple[int, int] = (1_500, 1_500)
    workers: int = 3
    partitions: int = 12
    session_timeout_ms: int = 8_000
    rss_limit_mb: float = 1_024.0
    drain_timeout_s: float = 180.0


@dataclass
class Expected:
    """What one request must end as: its allowed statuses, and when it was published."""

    statuses: frozenset[str]
    published: float = 0.0


@dataclass
class Observed:
    first_seen: dict[str, float] = field(default_factory=dict)
    digest: dict[str, str] = field(default_factory=dict)
    commit_samples: int = 0
    commit_violations: list[str] = field(default_factory=list)
    rss_peak_kb: dict[int, int] = field(default_factory=dict)


def _digest(raw: bytes) -> str:
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


class Soak:
    def __init__(self, cfg: SoakConfig, cluster: ClusterStack, tmp: Path) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.tmp = tmp
        self.lane = Lane.on(cluster.kafka_bootstrap, cluster.redis_url, f"soak{cfg.seed}")
        # every result held by a replica before anyone commits past it: without this a
        # master killed before its replica had a result lost it (seed 459465639, 23 lost)
        self.lane.extra_env["QBATCH_REDIS_WAIT_REPLICAS"] = "1"
        self.keys = RedisKeys(self.lane.prefix, cluster=True)
        self.rng = random.Random(cfg.seed)
        self.faults = schedule(cfg.seed, cfg.duration_s, workers=cfg.workers, limits=None)
        self.expected: dict[str, Expected] = {}
        self.bad_keys: set[str] = set()
        self.jobs = {f"j{cfg.seed}a": cfg.job_lines[0], f"j{cfg.seed}b": cfg.job_lines[1]}
        self.cancelled_job = f"j{cfg.seed}b"
        self.short_ttl_job = f"j{cfg.seed}a"
        self.obs = Observed()
        self.workers: list[subprocess.Popen[bytes] | None] = [None] * cfg.workers
        self.leaders_killed = 0
        self.resent = 0
        self.skipped_faults: list[str] = []
        self.undo_failures: list[str] = []  # faults that stayed: the run is not valid
        """Faults the harness could not apply (reported, not counted as applied)."""
        """Requests the brokers refused while a broker was down, published again."""
        self.started: list[subprocess.Popen[bytes]] = []
        """Every worker process this run started: all are stopped at the end."""
        self.killed: set[int] = set()
        """Workers the schedule has killed and not yet restarted."""
        self.unexpected_exits: list[str] = []
        """Workers that exited on their own (a bug): restarted, as a supervisor would."""
        self.applied: list[list[Any]] = []
        """[fault, start_s, end_s] (end -1 until undone), seconds since the start."""
        self.proxies: dict[int, DelayProxy] = {}
        """The delaying proxy in front of each Redis node, by the node's port."""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.t0 = 0.0

    # ------------------------------------------------------------ processes

    def start_worker(self, i: int) -> None:
        proc = start_worker(
            self.lane,
            "--session-timeout-ms",
            str(self.cfg.session_timeout_ms),
            "--worker-id",
            f"soak-w{i}",
            log=self.tmp / f"worker-{i}.log",
        )
        self.workers[i] = proc
        self.started.append(proc)

    # ------------------------------------------------------------ traffic

    def _traffic(self) -> None:
        """Publishes the interactive mix over the first two thirds of the run; a send the
        brokers refused (a broker killed mid-request) is sent again, as a client would."""
        span = self.cfg.duration_s * 2 / 3
        n = self.cfg.requests
        failed: list[tuple[str, bytes]] = []
        producer = self._producer()
        try:
            for i in range(n):
                if self._stop.is_set():
                    return
                target = self.t0 + span * i / n
                if (delay := target - time.monotonic()) > 0:
                    time.sleep(delay)
                self._send(producer, *self._draw(i), failed)
            producer.flush(timeout=300)
            deadline = time.monotonic() + 300
            while failed and time.monotonic() < deadline:
                again, failed[:] = list(failed), []
                self.resent += len(again)
                producer.close(timeout=5)
                producer = self._producer()
                for key, value in again:
                    self._send(producer, key, value, failed)
                producer.flush(timeout=300)
            if failed:
                raise SoakFailure(f"{len(failed)} requests could not be published in 5 minutes")
        finally:
            producer.close(timeout=30)

    def _producer(self) -> KafkaProducer:
        return KafkaProducer(
            bootstrap_servers=self.lane.bootstrap.split(","),
            acks="all",
            linger_ms=5,
            enable_idempotence=True,
            max_in_flight_requests_per_connection=5,
        )

    def _send(
        self, producer: KafkaProducer, key: str, value: bytes, failed: list[tuple[str, bytes]]
    ) -> None:
        try:
            future = producer.send(self.lane.topic, key=key.encode(), value=value)
        except Exception:  # the buffer full / metadata unavailable: send it again later
            failed.append((key, value))
            return
        future.add_errback(lambda _exc: failed.append((key, value)))

    def _draw(self, i: int) -> tuple[str, bytes]:
        kind = self.rng.choices(
            ["plain", "tools", "deadline", "bad_envelope", "bad_bytes"], [70, 12, 10, 4, 4]
        )[0]
        rid = f"s{i}"
        now = time.time()
        body: dict[str, Any] = {"messages": [{"role": "user", "content": f"r{i}"}]}
        env: dict[str, Any] = {"request_id": rid, "body": body}
        allowed = frozenset({"succeeded"})
        if kind == "bad_bytes":
            key = f"bad-{i}"
            self.bad_keys.add(key)
            return key, b"\xff\xfe not json " + str(i).encode()
        if kind == "tools":
            body["tools"] = TOOLS
        elif kind == "deadline":
            when = now + self.rng.uniform(-5, 5)
            env["deadline"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + (
                f".{int(when % 1 * 1000):03d}Z"
            )
            allowed = frozenset({"succeeded", "expired"})
        elif kind == "bad_envelope":
            body["temperature"] = 99  # out of range: refused naming the field
            allowed = frozenset({"failed"})
            self.bad_keys.add(rid)
        with self._lock:
            self.expected[rid] = Expected(allowed, time.monotonic())
        return rid, json.dumps(env).encode()

    def _bulk(self) -> None:
        """Two bulk jobs through the CLI; the second is cancelled while it is published."""
        for n, (job, lines) in enumerate(self.jobs.items()):
            if self._stop.wait(8 + 10 * n):
                return
            src = self.tmp / f"{job}.jsonl"
            with src.open("w") as fh:
                for i in range(lines):
                    line: dict[str, Any] = {"custom_id": f"c{i}", "method": "POST"}
                    line["url"] = "/v1/chat/completions"
                    line["body"] = {"messages": [{"role": "user", "content": f"{job} {i}"}]}
                    fh.write(json.dumps(line) + "\n")
            allowed = frozenset({"succeeded"})
            if job == self.cancelled_job:
                allowed = frozenset({"succeeded", "cancelled"})
            with self._lock:  # the short-TTL job's results are gone by the end: see _check
                for i in range(1, lines + 1):
                    if job != self.short_ttl_job:
                        self.expected[f"{job}.{i}"] = Expected(allowed, time.monotonic())
            if job == self.cancelled_job:
                submit = qbatch_popen(
                    self.lane, "-q", "bulk", "submit", str(src), "--job", job, "--chunk", "10"
                )
                self._wait_submitting(job, submit)
                cancel = qbatch(self.lane, "-q", "bulk", "cancel", job)
                if cancel.returncode != 0:
                    raise SoakFailure(f"bulk cancel failed: {cancel.stderr[-2000:]}")
                _out, err = submit.communicate(timeout=600)
                if submit.returncode not in (0, 3):  # 3: stopped by the cancel (if it says so)
                    raise SoakFailure(
                        f"cancelled bulk submit: rc {submit.returncode}: {err[-2000:]}"
                    )
            else:
                ttl = ["--result-ttl", str(SHORT_RESULT_TTL_S)] if job == self.short_ttl_job else []
                done = qbatch(self.lane, "-q", "bulk", "submit", str(src), "--job", job, *ttl)
                if done.returncode != 0:
                    raise SoakFailure(f"bulk submit failed: {done.stderr[-2000:]}")

    def _wait_submitting(self, job: str, submit: subprocess.Popen[str]) -> None:
        """Until the job has published its first chunk (so the cancel meets a running job
        with requests on the topic and more to come), at most a minute."""
        client = connect(self.lane.redis_url)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and submit.poll() is None:
                with contextlib.suppress(Exception):  # a master failing over
                    if int(client.hget(self.keys.job(job), "submitted") or 0) > 0:
                        return
                time.sleep(0.05)
        finally:
            client.close()

    # ------------------------------------------------------------ observers

    def _observe(self) -> None:
        client = connect(self.lane.redis_url)
        try:
            while not self._stop.is_set():
                with self._lock:
                    todo = [r for r in self.expected if r not in self.obs.first_seen]
                for start in range(0, len(todo), 2_000):
                    chunk = todo[start : start + 2_000]
                    try:
                        values = mget(client, [self.keys.result(r) for r in chunk])
                    except Exception:  # a master failing over: the next round sees it
                        break
                    now = time.monotonic()
                    for rid, raw in zip(chunk, values, strict=True):
                        if raw is not None:
                            self.obs.first_seen[rid] = now
                            self.obs.digest[rid] = _digest(raw)
                self._rss()
                self._stop.wait(0.5)
        finally:
            client.close()

    def _rss(self) -> None:
        for i, proc in enumerate(self.workers):
            if proc is None:
                continue
            if proc.poll() is not None:
                with self._lock:
                    if i not in self.killed and self.workers[i] is proc:
                        at = time.monotonic() - self.t0
                        self.unexpected_exits.append(
                            f"worker {i} exited {proc.returncode} at {at:.0f}s"
                        )
                        self.start_worker(i)
                continue
            try:
                text = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("VmRSS:"):
                    kb = int(line.split()[1])
                    self.obs.rss_peak_kb[proc.pid] = max(self.obs.rss_peak_kb.get(proc.pid, 0), kb)

    def _commits(self) -> None:
        """Every record below a committed offset has its result when the commit is seen."""
        client = connect(self.lane.redis_url)
        reader = KafkaConsumer(
            bootstrap_servers=self.lane.bootstrap.split(","),
            group_id=None,
            enable_auto_commit=False,
            consumer_timeout_ms=2000,
        )
        checked: dict[TopicPartition, int] = {}
        try:
            while not self._stop.wait(2.0):
                try:
                    admin = KafkaAdminClient(bootstrap_servers=self.lane.bootstrap.split(","))
                    try:
                        offsets = admin.list_group_offsets(self.lane.group)[self.lane.group]
                    finally:
                        admin.close()
                except Exception:
                    continue  # a broker down: sample again later
                for tp, meta in offsets.items():
                    if tp.topic not in (self.lane.topic, self.lane.bulk_topic):
                        continue
                    start = checked.get(tp, 0)
                    if meta.offset <= start:
                        continue
                    try:
                        keys = self._keys_between(reader, tp, start, meta.offset)
                        rids = [k for k in keys if k not in self.bad_keys]
                        short = f"{self.short_ttl_job}."
                        values = mget(client, [self.keys.result(r) for r in rids])
                        # a short-TTL job's result may have expired: it must be counted
                        counted_key = self.keys.job_counted(self.short_ttl_job)
                        counted = [
                            bool(client.sismember(counted_key, r)) if r.startswith(short) else True
                            for r in rids
                        ]
                    except Exception:
                        continue
                    missing = [
                        r
                        for r, v, c in zip(rids, values, counted, strict=True)
                        if (v is None and not r.startswith(short)) or not c
                    ]
                    self.obs.commit_samples += 1
                    if missing:
                        self.obs.commit_violations.append(
                            f"{tp.topic}[{tp.partition}] committed {meta.offset}: "
                            f"no result yet for {missing[:5]}"
                        )
                    checked[tp] = meta.offset
        finally:
            reader.close()
            client.close()

    @staticmethod
    def _keys_between(reader: KafkaConsumer, tp: TopicPartition, start: int, end: int) -> list[str]:
        reader.assign([tp])
        reader.seek(tp, start)
        keys: list[str] = []
        deadline = time.monotonic() + 20
        while reader.position(tp) < end and time.monotonic() < deadline:
            for records in reader.poll(timeout_ms=500).values():
                keys += [r.key.decode() for r in records if r.offset < end and r.key]
        if reader.position(tp) < end:
            raise TimeoutError(f"could not read {tp} up to {end}")
        return keys

    # ------------------------------------------------------------ faults

    def _faults(self) -> None:
        pending = [(f.at_s, f, 0) for f in self.faults]  # (due, fault, tries)
        undo: list[tuple[float, list[Any], Callable[[], None]]] = []
        while (pending or undo) and not self._stop.is_set():
            now = time.monotonic() - self.t0
            if undo and undo[0][0] <= now:
                _, entry, action = undo.pop(0)
                try:
                    action()
                except Exception as exc:  # e.g. a restart racing a failover: try again
                    entry.append(repr(exc))
                    if len(entry) < 3 + UNDO_TRIES:
                        undo.append((now + 1.0, entry, action))
                        undo.sort(key=lambda u: u[0])
                    else:
                        self.undo_failures.append(f"{entry[0].describe()}: {entry[3:]}")
                    continue
                entry[2] = time.monotonic() - self.t0
                continue
            if pending and pending[0][0] <= now:
                _, fault, tries = pending.pop(0)
                try:
                    action = self._apply(fault)
                except Exception as exc:  # a harness call during an outage: not the system
                    if tries + 1 < APPLY_TRIES:  # e.g. its node still BUSY from a late fault
                        pending.append((now + 1.0, fault, tries + 1))
                        pending.sort(key=lambda p: p[0])
                    else:
                        self.skipped_faults.append(f"{fault.describe()}: {exc!r}")
                    continue
                entry = [fault, now, -1.0]
                self.applied.append(entry)
                undo.append((now + fault.hold_s, entry, action))
                undo.sort(key=lambda u: u[0])
                continue
            self._stop.wait(0.05)

    def _apply(self, fault: Fault) -> Callable[[], None]:
        if fault.kind is FaultKind.worker_kill:
            with self._lock:
                proc = self.workers[fault.target]
                assert proc is not None
                self.killed.add(fault.target)
                proc.kill()
            proc.wait()
            return lambda: self._restart(fault.target)
        if fault.kind is FaultKind.worker_stop:
            proc = self.workers[fault.target]
            assert proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, 19)  # SIGSTOP

            def resume() -> None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, 18)  # SIGCONT

            return resume
        if fault.kind is FaultKind.broker_kill:
            node = fault.target or self._leader_node()
            self.cluster.kill_broker(node)
            self.leaders_killed += fault.target == 0
            return lambda: self.cluster.start_broker(node)
        if fault.kind is FaultKind.redis_slow:
            if fault.target == ALL_NODES:
                slowed = list(self.proxies.values())
            else:
                slowed = [self.proxies[self._master_port(fault.target)]]
            for proxy in slowed:
                proxy.set_delay(fault.delay_s)

            def fast() -> None:
                for proxy in slowed:
                    proxy.set_delay(0)

            return fast
        port = self._master_port(fault.target)
        if fault.kind is FaultKind.redis_master_kill:
            self.cluster.kill_redis(port)
            return lambda: self.cluster.start_redis(port)
        if fault.kind is FaultKind.redis_busy:
            return redis_faults.busy(port, fault.hold_s)
        if fault.kind is FaultKind.redis_misconf:
            return redis_faults.misconf(port)
        import redis  # redis_stall: the server holds every client's commands (also ours)

        paused = redis.Redis(port=port)
        paused.execute_command("CLIENT", "PAUSE", int(fault.hold_s * 1000), "ALL")
        paused.close()
        return lambda: None

    def _leader_node(self) -> int:
        """The broker (1-3) leading the requests topic's partition 0 right now."""
        admin = KafkaAdminClient(bootstrap_servers=self.lane.bootstrap.split(","))
        try:
            [topic] = admin.describe_topics([self.lane.topic])
        finally:
            admin.close()
        leader = next(p["leader_id"] for p in topic["partitions"] if p["partition_index"] == 0)
        return int(leader)

    def _restart(self, i: int) -> None:
        with self._lock:
            self.start_worker(i)
            self.killed.discard(i)

    def _master_port(self, index: int) -> int:
        client = connect(self.lane.redis_url)
        try:
            ports = sorted(int(n.port) for n in client.get_primaries())
        finally:
            client.close()
        return ports[index % len(ports)]

    # ------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        self.lane.create_topics(self.cfg.partitions, replication=3)
        self.proxies = proxies_for(self.cluster.redis_nodes)
        self.lane.extra_env["QBATCH_REDIS_ADDRESS_MAP"] = json.dumps(address_map(self.proxies))
        try:
            for i in range(self.cfg.workers):
                self.start_worker(i)
            time.sleep(3)
        except BaseException:
            self._restore()
            raise
        self.t0 = time.monotonic()
        errors: list[BaseException] = []

        def guarded(fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                try:
                    fn()
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)

            return run

        threads = [
            threading.Thread(target=guarded(fn), name=fn.__name__, daemon=True)
            for fn in (self._traffic, self._bulk, self._faults, self._observe, self._commits)
        ]
        for t in threads:
            t.start()
        try:
            for t in threads[:3]:  # traffic, bulk jobs, faults
                t.join(timeout=self.cfg.duration_s + 600)
            self._drain()
        finally:
            self._stop.set()
            for t in threads[3:]:
                t.join(timeout=60)
            self._restore()
        return self._check([f"a soak thread failed: {e!r}" for e in errors])

    def _drain(self) -> None:
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                left = [r for r in self.expected if r not in self.obs.first_seen]
            if not left and self._short_ttl_counted() >= self.jobs[self.short_ttl_job]:
                return
            time.sleep(1)

    def _short_ttl_counted(self) -> int:
        client = connect(self.lane.redis_url)
        try:
            return int(client.scard(self.keys.job_counted(self.short_ttl_job)))
        except Exception:  # a master failing over: ask again
            return 0
        finally:
            client.close()

    def _restore(self) -> None:
        """Leave the shared cluster as found: every worker stopped, every node running."""
        for proc in self.started:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, 18)
                stop_worker(proc)
        for proxy in self.proxies.values():
            proxy.close()
        for node in range(1, 4):
            if self.cluster.broker_pid(node) is None:
                self.cluster.start_broker(node)
        for port in self.cluster.redis_ports:
            if self.cluster.redis_pid(port) is None:
                self.cluster.start_redis(port)
        self.cluster.wait_redis_ok()

    # ------------------------------------------------------------ invariants

    def _check(self, problems: list[str]) -> dict[str, Any]:
        client = connect(self.lane.redis_url)
        try:
            rids = list(self.expected)
            values: dict[str, bytes | None] = {}
            for start in range(0, len(rids), 2_000):
                chunk = rids[start : start + 2_000]
                values.update(
                    zip(chunk, mget(client, [self.keys.result(r) for r in chunk]), strict=True)
                )
            lost = [r for r, v in values.items() if v is None]
            overwritten = [
                r
                for r, v in values.items()
                if v is not None and r in self.obs.digest and _digest(v) != self.obs.digest[r]
            ]
            statuses: dict[str, int] = {}
            wrong: list[str] = []
            for rid, raw in values.items():
                if raw is None:
                    continue
                status = json.loads(raw)["status"]
                statuses[status] = statuses.get(status, 0) + 1
                if status not in self.expected[rid].statuses:
                    wrong.append(f"{rid}: {status}")
            jobs: dict[str, dict[str, Any]] = {}
            for job, lines in self.jobs.items():
                job_hash = {
                    k.decode(): v.decode() for k, v in client.hgetall(self.keys.job(job)).items()
                }
                stream_len = client.xlen(self.keys.job_stream(job))
                answers = statuses_of(values)
                if job == self.short_ttl_job:  # its results expired: its stream says
                    answers, repeated = self._stream_statuses(client, job)
                    lost_lines = [
                        f"{job}.{i}" for i in range(1, lines + 1) if f"{job}.{i}" not in answers
                    ]
                    lost += lost_lines
                    if repeated:
                        problems.append(f"job {job}: counted twice: {repeated[:5]}")
                jobs[job], wrong_job = job_verdict(job, lines, job_hash, stream_len, answers)
                problems += wrong_job
        finally:
            client.close()
        dlq = self._dlq()
        dlq_keys = [key for key, _ in dlq]
        sources = {src for _, src in dlq}
        if lost:
            problems.append(f"{len(lost)} requests without a result, e.g. {lost[:5]}")
        if overwritten:
            problems.append(f"{len(overwritten)} results overwritten, e.g. {overwritten[:5]}")
        if wrong:
            problems.append(f"{len(wrong)} results of an unexpected status, e.g. {wrong[:5]}")
        problems += self.obs.commit_violations[:5]
        problems += [f"{e} (restarted)" for e in self.unexpected_exits]
        problems += [f"a fault could not be undone: {u}" for u in self.undo_failures]
        if set(dlq_keys) != self.bad_keys:
            extra = set(dlq_keys) - self.bad_keys
            missed = self.bad_keys - set(dlq_keys)
            problems.append(f"DLQ differs: {len(missed)} bad records missing, {len(extra)} others")
        peak_mb = max(self.obs.rss_peak_kb.values(), default=0) / 1024
        if peak_mb > self.cfg.rss_limit_mb:
            problems.append(f"a worker's RSS reached {peak_mb:.0f} MB")
        recovery = self._recovery()
        report = {
            "seed": self.cfg.seed,
            "duration_s": self.cfg.duration_s,
            "faults": dict(Counter(f.kind.value for f, _, _ in self.applied)),
            "requests": len(self.expected) + len(self.bad_keys - set(self.expected)),
            "results": len(values) - len(lost),
            "lost": len(lost),
            "overwritten": len(overwritten),
            "statuses": statuses,
            "jobs": jobs,
            "dlq": {
                "bad_records": len(self.bad_keys),
                "records": len(dlq_keys),
                "source_records": len(sources),
                "redelivered_copies": len(dlq_keys) - len(sources),
            },
            "leaders_killed": self.leaders_killed,
            "requests_resent": self.resent,
            "faults_not_applied": self.skipped_faults,
            "faults_not_undone": self.undo_failures,
            "unexpected_exits": self.unexpected_exits,
            "redis_proxies": {
                "connections": sum(p.accepted for p in self.proxies.values()),
                "bytes_to_redis": sum(p.bytes["to_server"] for p in self.proxies.values()),
                "bytes_from_redis": sum(p.bytes["to_client"] for p in self.proxies.values()),
            },
            "commit_samples": self.obs.commit_samples,
            "commit_violations": len(self.obs.commit_violations),
            "recovery_s": recovery,
            "peak_rss_mb": round(peak_mb, 1),
            "schedule": [f.describe() for f in self.faults],
        }
        (self.tmp / "soak-report.json").write_text(json.dumps(report, indent=2))
        if problems:
            raise SoakFailure(
                f"chaos soak seed {self.cfg.seed} (replay: QBATCH_SOAK_SEED={self.cfg.seed}):\n- "
                + "\n- ".join(problems)
                + f"\nreport: {json.dumps(report)}"
            )
        return report

    def _stream_statuses(self, client: Any, job: str) -> tuple[dict[str, str], list[str]]:
        """request id -> status of every entry of the job's stream, and the ids that have
        more than one entry (counted twice)."""
        statuses: dict[str, str] = {}
        repeated: list[str] = []
        for _id, fields in client.xrange(self.keys.job_stream(job)):
            rid = fields[b"request_id"].decode()
            if rid in statuses:
                repeated.append(rid)
            statuses[rid] = fields[b"status"].decode()
        return statuses, repeated

    def _dlq(self) -> list[tuple[str, tuple[str, ...]]]:
        """(record key, its source topic/partition/offset headers) of every dead letter."""
        consumer = KafkaConsumer(
            self.lane.dlq_topic,
            bootstrap_servers=self.lane.bootstrap.split(","),
            group_id=None,
            auto_offset_reset="earliest",
            consumer_timeout_ms=5000,
        )
        names = ("qbatch.source.topic", "qbatch.source.partition", "qbatch.source.offset")
        try:
            out = []
            for r in consumer:
                headers = {k: v.decode() for k, v in r.headers or []}
                key = r.key.decode() if r.key else ""
                out.append((key, tuple(headers.get(n, "") for n in names)))
            return out
        finally:
            consumer.close()

    def _recovery(self) -> dict[str, dict[str, float]]:
        """soak_report.recovery_times on this run's clock (seconds from its start)."""
        return recovery_times(
            ((f.kind.value, start, end) for f, start, end in self.applied),
            {r: e.published - self.t0 for r, e in self.expected.items()},
            {r: seen - self.t0 for r, seen in self.obs.first_seen.items()},
        )


__all__ = ["Soak", "SoakConfig", "SoakFailure"]
