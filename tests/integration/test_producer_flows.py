"""Producer end to end: real Kafka + Redis + an echo worker subprocess.

Each test gets a private lane (topic, DLQ topic, group, Redis prefix) from
`tests/integration/workers.py`, so tests never see each other's records or keys.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.client import Request
from schemas import Status
from schemas.keys import RedisKeys
from schemas.redis_conn import connect, is_cluster_url

try:  # tests/integration is a rootdir-relative folder, or a package once it has __init__.py
    from tests.integration.workers import Lane, echo_worker, qbatch, qbatch_popen
except ModuleNotFoundError:
    from workers import Lane, echo_worker, qbatch, qbatch_popen  # type: ignore[no-redef]

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def _stack(stack: Any) -> None:
    """The local Kafka + Redis, or the cluster under QBATCH_TEST_STACK=cluster (conftest's
    `stack` starts it or fails loudly: nothing here is skipped for want of a stack)."""


@pytest.fixture
def lane() -> Iterator[Lane]:
    lane = Lane.new("qbp")
    lane.create_topics()
    yield lane
    lane.delete_topics()
    lane.clean_redis()


@pytest.fixture
def worker_log(tmp_path: Path) -> Path:
    return tmp_path / "worker.log"


def write_openai(path: Path, n: int, *, body_for=None) -> Path:  # type: ignore[no-untyped-def]
    with path.open("w") as fh:
        for i in range(n):
            body = body_for(i) if body_for else {"messages": [{"role": "user", "content": f"m{i}"}]}
            line = {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body,
            }
            fh.write(json.dumps(line) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def job_hash(lane: Lane, job: str) -> dict[str, str]:
    r = connect(lane.redis_url, decode_responses=True)
    try:
        key = RedisKeys(lane.prefix, cluster=is_cluster_url(lane.redis_url)).job(job)
        return r.hgetall(key)  # type: ignore[no-any-return]
    finally:
        r.close()


def topic_records(lane: Lane, *topics: str) -> int:
    """Records published to `topics` (default: both lanes' requests topics)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=lane.bootstrap.split(","))
    try:
        parts = [
            TopicPartition(topic, p)
            for topic in topics or (lane.topic, lane.bulk_topic)
            for p in consumer.partitions_for_topic(topic)
        ]
        return sum(consumer.end_offsets(parts).values())
    finally:
        consumer.close()


# ---------------------------------------------------------------- single requests


def test_submit_get_wait_round_trips(lane: Lane, worker_log: Path) -> None:
    with echo_worker(lane, log=worker_log), lane.client() as qb:
        rid = qb.submit(
            {"messages": [{"role": "user", "content": "ping"}]},
            metadata={"trace": "t1"},
            custom_id="cid",
        )
        result = qb.wait(rid, timeout=60)
        assert result is not None and result.status is Status.succeeded, result
        assert result.metadata == {"trace": "t1"} and result.custom_id == "cid"
        assert result.response is not None
        assert result.response.choices[0].message.content == "ping"  # type: ignore[union-attr]
        assert qb.get(rid) == result
        # completions + several at once
        ids = qb.submit_many([Request({"prompt": f"p{i}"}) for i in range(20)])
        found = qb.wait_many(ids, timeout=60)
        assert all(r is not None and r.ok for r in found.values())
        assert found[ids[3]].response.choices[0].text == "p3"  # type: ignore[union-attr]
        # a result that never comes times out with None
        assert qb.wait("never-submitted", timeout=0.3) is None
    assert qb.get  # closed cleanly


def test_cli_submit_wait_get(lane: Lane, worker_log: Path) -> None:
    with echo_worker(lane, log=worker_log):
        body = json.dumps({"messages": [{"role": "user", "content": "cli"}]})
        done = qbatch(
            lane, "submit", "--body", body, "--request-id", "cli-1", "--wait", "--timeout", "60"
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["response"]["choices"][0]["message"]["content"] == "cli"
        got = qbatch(lane, "get", "cli-1")
        assert got.returncode == 0 and json.loads(got.stdout)["request_id"] == "cli-1"
        waited = qbatch(lane, "wait", "cli-1", "missing-1", "--timeout", "0.5")
        assert waited.returncode == 3 and len(waited.stdout.splitlines()) == 1
        bad = qbatch(lane, "submit", "--body", '{"messages": []}')
        assert bad.returncode == 2 and "body.messages" in bad.stderr


# ---------------------------------------------------------------- bulk


def test_bulk_run_10000_lines(lane: Lane, tmp_path: Path, worker_log: Path) -> None:
    src = write_openai(tmp_path / "in.jsonl", 10_000)
    out = tmp_path / "out.jsonl"
    with echo_worker(lane, log=worker_log):
        run = qbatch(
            lane,
            "-q",
            "--json",
            "bulk",
            "run",
            str(src),
            "--out",
            str(out),
            "--job",
            "big",
            "--timeout",
            "240",
        )
    assert run.returncode == 0, run.stderr
    lines = read_jsonl(out)
    assert len(lines) == 10_000
    assert [line["custom_id"] for line in lines] == [f"c{i}" for i in range(10_000)]  # input order
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in lines)
    assert lines[42]["response"]["body"]["choices"][0]["message"]["content"] == "m42"
    h = job_hash(lane, "big")
    assert h["status"] == "completed" and h["succeeded"] == "10000" and h["total"] == "10000"
    summary = [json.loads(x) for x in run.stdout.splitlines()]
    assert summary[-1]["collect"]["all_succeeded"] is True
    # a second run is a no-op that rewrites the same output
    again = qbatch(
        lane, "-q", "bulk", "run", str(src), "--out", str(out), "--job", "big", "--timeout", "30"
    )
    assert again.returncode == 0, again.stderr
    assert len(read_jsonl(out)) == 10_000
    assert topic_records(lane) == 10_000
    # a bulk job travels on the bulk lane: nothing of it is queued ahead of interactive work
    assert topic_records(lane, lane.bulk_topic) == 10_000


def test_killed_submit_resumes_without_duplicates(
    lane: Lane, tmp_path: Path, worker_log: Path
) -> None:
    n, chunk = 20_000, 500
    src = write_openai(tmp_path / "in.jsonl", n)
    out = tmp_path / "out.jsonl"
    with echo_worker(lane, log=worker_log):
        proc = qbatch_popen(
            lane, "-q", "bulk", "submit", str(src), "--job", "kill", "--chunk", str(chunk)
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sent = int(job_hash(lane, "kill").get("submitted", 0))
            if sent >= 2 * chunk:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        h = job_hash(lane, "kill")
        assert h["status"] == "submitting" and 0 < int(h["submitted"]) < n, h
        first_run = topic_records(lane)
        rerun = qbatch(
            lane, "-q", "--json", "bulk", "submit", str(src), "--job", "kill", "--chunk", str(chunk)
        )
        assert rerun.returncode == 0, rerun.stderr
        report = json.loads(rerun.stdout)["submit"]
        assert report["resumed_from"] == int(h["submitted"])
        collect = qbatch(
            lane, "-q", "bulk", "collect", "kill", "--out", str(out), "--timeout", "120"
        )
        assert collect.returncode == 0, collect.stderr
    # at most the un-acknowledged chunk was published twice
    assert topic_records(lane) <= n + chunk, (first_run, topic_records(lane))
    lines = read_jsonl(out)
    assert len(lines) == n and len({line["custom_id"] for line in lines}) == n
    h = job_hash(lane, "kill")
    assert h["succeeded"] == str(n) and h["status"] == "completed"
    assert int(h.get("failed", 0)) == 0 and int(h.get("cancelled", 0)) == 0


def test_killed_collect_reruns_to_the_same_output(
    lane: Lane, tmp_path: Path, worker_log: Path
) -> None:
    src = write_openai(tmp_path / "in.jsonl", 3_000)
    out = tmp_path / "out.jsonl"
    with echo_worker(lane, "--echo-delay-ms", "300", "--max-inflight", "256", log=worker_log):
        assert qbatch(lane, "-q", "bulk", "submit", str(src), "--job", "col").returncode == 0
        proc = qbatch_popen(lane, "-q", "bulk", "collect", "col", "--out", str(out))
        deadline = time.monotonic() + 60
        while int(job_hash(lane, "col").get("succeeded", 0)) < 300:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        # the kill landed mid-job (answers are counted before collect can see them), and
        # collect writes only at the end, atomically: no output, no temp file left
        assert int(job_hash(lane, "col")["succeeded"]) < 3_000
        assert not out.exists() and not list(tmp_path.glob(".out.jsonl.*"))
        again = qbatch(lane, "-q", "bulk", "collect", "col", "--out", str(out), "--timeout", "120")
        assert again.returncode == 0, again.stderr
    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == [f"c{i}" for i in range(3_000)]


def test_collect_timeout_writes_what_finished(lane: Lane, tmp_path: Path, worker_log: Path) -> None:
    src = write_openai(tmp_path / "in.jsonl", 2_000)
    out = tmp_path / "out.jsonl"
    with echo_worker(lane, "--echo-delay-ms", "500", "--max-inflight", "32", log=worker_log):
        assert qbatch(lane, "-q", "bulk", "submit", str(src), "--job", "slow").returncode == 0
        col = qbatch(
            lane, "-q", "--json", "bulk", "collect", "slow", "--out", str(out), "--timeout", "3"
        )
        assert col.returncode == 3, col.stderr
        report = json.loads(col.stdout)["collect"]
        assert not report["complete"] and 0 < report["written"] < 2_000
        assert len(read_jsonl(out)) == report["written"]
        status = qbatch(lane, "bulk", "status", "slow", "--json")
        view = json.loads(status.stdout)
        assert view["progress_pct"] < 100 and view["status"] in ("running", "submitting")
        qbatch(lane, "-q", "bulk", "cancel", "slow")


def submit_and_wait_for(lane: Lane, src: Path, job: str, *, succeeded: int) -> None:
    """`bulk submit` the file as `job`, then poll until that many lines succeeded."""
    assert qbatch(lane, "-q", "bulk", "submit", str(src), "--job", job).returncode == 0
    deadline = time.monotonic() + 60
    while int(job_hash(lane, job).get("succeeded", 0)) < succeeded:
        assert time.monotonic() < deadline, job_hash(lane, job)
        time.sleep(0.05)


def test_bulk_cancel_mid_job(lane: Lane, tmp_path: Path, worker_log: Path) -> None:
    n = 2_000
    src = write_openai(tmp_path / "in.jsonl", n)
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    with echo_worker(
        lane,
        "--echo-delay-ms",
        "500",
        "--max-inflight",
        "32",
        "--batch-max-size",
        "16",
        log=worker_log,
    ):
        submit_and_wait_for(lane, src, "cx", succeeded=50)
        cancel = qbatch(lane, "--json", "bulk", "cancel", "cx")
        assert cancel.returncode == 0, cancel.stderr
        assert json.loads(cancel.stdout)["status"] in ("cancelling", "cancelled")
        col = qbatch(
            lane,
            "-q",
            "bulk",
            "collect",
            "cx",
            "--out",
            str(out),
            "--errors",
            str(errors),
            "--timeout",
            "120",
        )
        assert col.returncode == 1, col.stderr
    ok, bad = read_jsonl(out), read_jsonl(errors)
    assert len(ok) + len(bad) == n
    assert all(line["error"]["code"] == "cancelled" for line in bad)
    assert all(line["response"]["status_code"] == 499 for line in bad)
    h = job_hash(lane, "cx")
    assert h["status"] == "cancelled"
    assert int(h["succeeded"]) == len(ok) and int(h["cancelled"]) == len(bad)
    assert len(bad) > n // 2  # most of it never ran


def test_a_cancel_stops_the_job_within_seconds(
    lane: Lane, tmp_path: Path, worker_log: Path
) -> None:
    """Every line the worker holds (up to its bulk cap: all 600 here) is answered
    `cancelled` within seconds of the cancel, and the engine's waiting ones are aborted:
    only the 8 "generating" in the echo engine (concurrency 8, 1 s each) may finish. Before,
    only admission looked at the cancel mark, so all ~580 taken lines ran: ~73 s."""
    n = 600
    src = write_openai(tmp_path / "in.jsonl", n)
    with echo_worker(
        lane,
        "--echo-delay-ms",
        "1000",
        "--echo-concurrency",
        "8",
        "--batch-max-size",
        "16",
        log=worker_log,
    ):
        submit_and_wait_for(lane, src, "cq", succeeded=16)
        before = int(job_hash(lane, "cq").get("succeeded", 0))
        cancelled_at = time.monotonic()
        assert qbatch(lane, "-q", "bulk", "cancel", "cq").returncode == 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            h = job_hash(lane, "cq")
            if sum(int(h.get(k, 0)) for k in ("succeeded", "failed", "cancelled")) == n:
                break
            time.sleep(0.05)
        took = time.monotonic() - cancelled_at
    h = job_hash(lane, "cq")
    ran_after = int(h["succeeded"]) - before
    assert int(h["succeeded"]) + int(h.get("cancelled", 0)) == n, h
    assert ran_after <= 16, (ran_after, h)  # the 8 generating, and 8 finishing as it came
    assert took < 15, took  # every line answered; before the fix ~73 s


def test_bad_lines_dry_run_and_real_run(lane: Lane, tmp_path: Path, worker_log: Path) -> None:
    def body(i: int) -> dict:  # type: ignore[type-arg]
        if i % 10 == 3:
            return {"messages": [{"role": "user", "content": "x"}], "temperature": 9}
        if i % 10 == 7:
            return {"messages": []}
        return {"messages": [{"role": "user", "content": f"m{i}"}]}

    src = write_openai(tmp_path / "in.jsonl", 100, body_for=body)
    with src.open("a") as fh:
        fh.write("this is not json\n")
    out = tmp_path / "out.jsonl"
    dry = qbatch(lane, "--json", "bulk", "submit", str(src), "--job", "bad", "--dry-run")
    assert dry.returncode == 1
    report = json.loads(dry.stdout)
    expected = [i + 1 for i in range(100) if i % 10 in (3, 7)] + [101]
    assert [b["line"] for b in report["bad"]] == expected
    assert report["bad"][0]["param"] == "body.temperature"
    for b in report["bad"]:
        assert f"line {b['line']}: " in dry.stderr
    assert job_hash(lane, "bad") == {}  # nothing published or recorded
    with echo_worker(lane, log=worker_log):
        run = qbatch(
            lane,
            "-q",
            "bulk",
            "run",
            str(src),
            "--out",
            str(out),
            "--job",
            "bad",
            "--timeout",
            "120",
        )
    assert run.returncode == 1, run.stderr
    lines = read_jsonl(out)
    assert len(lines) == 101
    errs = [line for line in lines if line["error"] is not None]
    assert len(errs) == 21
    assert all(
        e["response"]["status_code"] == 400 and e["error"]["code"] == "invalid_request"
        for e in errs
    )
    assert errs[0]["custom_id"] == "c3" and "body.temperature" in errs[0]["error"]["message"]
    assert topic_records(lane) == 80
    h = job_hash(lane, "bad")
    assert h["status"] == "completed_with_errors" and h["failed"] == "21" and h["succeeded"] == "80"


def test_retry_failed_lines(lane: Lane, tmp_path: Path, worker_log: Path) -> None:
    def body(i: int) -> dict:  # type: ignore[type-arg]
        model = {"model": "no-such-model"} if i % 4 == 0 else {}
        return {"messages": [{"role": "user", "content": f"m{i}"}], **model}

    src = write_openai(tmp_path / "in.jsonl", 40, body_for=body)
    out = tmp_path / "out.jsonl"
    with echo_worker(lane, log=worker_log):
        run = qbatch(
            lane, "-q", "bulk", "run", str(src), "--out", str(out), "--job", "rt", "--timeout", "60"
        )
        assert run.returncode == 1, run.stderr
        retry = qbatch(lane, "--json", "bulk", "retry", "rt", "--failed")
        assert retry.returncode == 0, retry.stderr
        assert json.loads(retry.stdout.splitlines()[-1])["retry"]["retried"] == 10
        col = qbatch(lane, "-q", "bulk", "collect", "rt", "--out", str(out), "--timeout", "60")
        assert col.returncode == 1, col.stderr
    lines = read_jsonl(out)
    assert len(lines) == 40
    failed = [line for line in lines if line["error"]]
    assert len(failed) == 10 and all(line["id"].endswith(".r1") for line in failed)
    assert all(line["error"]["code"] == "unknown_model" for line in failed)
    h = job_hash(lane, "rt")
    assert h["failed"] == "10" and h["succeeded"] == "30" and h["status"] == "completed_with_errors"
