"""The Grafana dashboard and the alert rules against a real Prometheus scraping a real worker.

An echo-engine worker and `qbatch serve` run on a private lane; Debian's `prometheus`
scrapes both every second with deploy/prometheus/alerts.yaml loaded (the jobs named as in
deploy/prometheus/prometheus.yml). Two waves of traffic (successes on both priority lanes,
a duplicate, an expired deadline, records that are dead-lettered, chat completions through
`qbatch serve`) make the counters and histograms move. Then, through the HTTP API:

* every `expr` of every panel of deploy/grafana/qbatch.json, with the Grafana variables
  filled in for this worker, is valid PromQL and returns data (a panel that is allowed to
  be empty must be listed in ALLOWED_EMPTY with the reason, so a panel that queries a
  metric nobody exports fails here);
* every template variable's `label_values(...)` finds this worker / server;
* every alert rule's expr evaluates, every metric an alert reads exists in the scraped
  data, and /api/v1/rules shows every group of alerts.yaml loaded with every rule healthy.

Whether the alerts fire when they should is tested by `promtool test rules`
(tests/unit/test_prometheus_rules.py). Skipped, with the reason, when `prometheus` is not
installed; under CI (CI=true) that fails instead (`.ci/run` installs it).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from kafka import KafkaProducer

from schemas.keys import RedisKeys
from schemas.redis_conn import connect, is_cluster, mget
from tests.integration.workers import REPO, Lane, start_worker, stop_worker
from tests.prometheus_fixtures import require_binary
from tests.serve_fixtures import Server, free_port, keys_file

pytestmark = pytest.mark.integration

DASHBOARD = REPO / "deploy" / "grafana" / "qbatch.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
WORKER_JOB, SERVE_JOB = "qbatch-worker", "qbatch-serve"  # as in deploy/prometheus/prometheus.yml
TENANT, MODEL = "team-a", "echo"  # tests.serve_fixtures: KEY_A's tenant, the echo model
RATE_INTERVAL = "1m"  # $__rate_interval: the whole test fits in it
RANGE = "5m"  # $__range

# Panel queries that may return no series on this setup, keyed by (panel title, refId),
# each with the reason. Everything else must return data. An entry whose query does
# return data fails the test too (remove it then), so this list cannot go stale.
# The GPU-engine gauges (KV cache, engine running/waiting, tokens/s) are unlabelled
# gauges the worker always exports (0 under the echo engine): they are not here.
ALLOWED_EMPTY: dict[tuple[str, str], str] = {}


def _values(result: list[dict[str, Any]]) -> list[float]:
    return [float(s["value"][1]) for s in result]


def _labels(result: list[dict[str, Any]], label: str) -> set[str]:
    return {s["metric"].get(label, "") for s in result}


# What some panels must show for this traffic, beyond "some data": (what, check).
EXPECTED: dict[tuple[str, str], tuple[str, Callable[[list[dict[str, Any]]], bool]]] = {
    ("Workers up", "A"): ("1", lambda r: _values(r) == [1.0]),
    ("Redis up (min over workers)", "A"): ("1", lambda r: _values(r) == [1.0]),
    ("Redis up by worker", "A"): ("1", lambda r: _values(r) == [1.0]),
    ("Requests/s", "A"): ("> 0", lambda r: _values(r)[0] > 0),
    ("Requests by status", "A"): (
        "succeeded, failed and expired",
        lambda r: {"succeeded", "failed", "expired"} <= _labels(r, "status"),
    ),
    ("Errors by code", "A"): (
        "unknown_model, context_length_exceeded and deadline_exceeded",
        lambda r: (
            {"unknown_model", "context_length_exceeded", "deadline_exceeded"} <= _labels(r, "code")
        ),
    ),
    ("End-to-end latency by lane (p50 / p99)", "B"): (
        "both lanes",
        lambda r: {"interactive", "bulk"} <= _labels(r, "lane"),
    ),
    ("Serve: tokens/s by tenant, model and kind", "A"): (
        f"{TENANT}'s prompt and completion tokens",
        lambda r: (
            _labels(r, "tenant") == {TENANT} and {"prompt", "completion"} <= _labels(r, "kind")
        ),
    ),
}

# Alerts that this test's traffic may legitimately set pending (none can fire: every rule
# has a `for` longer than the test). Every other alert must be inactive on a healthy worker.
ALLOWED_ACTIVE = {
    "QbatchErrorRateHigh": "about 5% of the test's requests fail on purpose "
    "(unknown model, context too long)",
}


# --------------------------------------------------------------------------- helpers


def wait_until(what: str, check: Callable[[], Any], timeout: float = 60, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, OSError):
            last = check()
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Prom:
    """The HTTP API of the Prometheus under test."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        resp = httpx.get(f"{self.base}{path}", params=params, timeout=10)
        body: dict[str, Any] = resp.json()  # errors (HTTP 400/422) are JSON too
        return body

    def query(self, expr: str) -> dict[str, Any]:
        return self.get("/api/v1/query", query=expr)

    def scalar(self, expr: str) -> float:
        """The value of a one-series query, 0 when it returns nothing."""
        body = self.query(expr)
        assert body["status"] == "success", (expr, body)
        result = body["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0


@contextlib.contextmanager
def prometheus(tmp: Path, targets: dict[str, str]) -> Iterator[Prom]:
    """`prometheus` on a free loopback port scraping `targets` ({job: host:port}) every
    second, with deploy/prometheus/alerts.yaml loaded and evaluated every second."""
    binary = require_binary("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": job, "metrics_path": "/metrics", "static_configs": [{"targets": [t]}]}
            for job, t in targets.items()
        ],
    }
    config_file = tmp / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    log = tmp / "prometheus.log"
    cmd = [
        binary,
        f"--config.file={config_file}",
        f"--storage.tsdb.path={tmp / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1h",
        "--log.level=warn",
    ]
    with log.open("ab") as sink:
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=sink, stderr=sink)
    prom = Prom(port)
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"prometheus exited:\n{log.read_text()[-3000:]}"
            return httpx.get(f"{prom.base}/-/ready", timeout=2).status_code == 200

        wait_until("prometheus to be ready", ready)
        yield prom
    finally:
        stop_worker(proc)  # SIGTERM, then SIGKILL after 30 s
        print(f"---- prometheus.log (tail) ----\n{log.read_text(errors='replace')[-3000:]}")


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    def up() -> bool:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        return httpx.get(url, timeout=2).status_code == 200

    wait_until(url, up)


def submitted_at() -> str:
    """The envelope's submit time (QBatchClient sets it): the end-to-end and queue
    latencies are measured from it."""
    return datetime.now(UTC).isoformat()


def chat(rid: str, text: str, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 16}
    body.update(extra.pop("body", {}))
    return {"request_id": rid, "body": body, "submitted_at": submitted_at(), **extra}


def send_wave(lane: Lane, tag: str) -> tuple[list[str], int]:
    """One wave of traffic: (request ids that get a result, records dead-lettered)."""
    good = [chat(f"{tag}-g{i}", f"hello {i}") for i in range(20)]
    good += [
        {"request_id": f"{tag}-c{i}", "endpoint": "/v1/completions",
         "body": {"prompt": f"count {i}", "max_tokens": 8}, "submitted_at": submitted_at()}
        for i in range(5)
    ]  # fmt: skip
    bulk = [chat(f"{tag}-b{i}", f"bulk {i}") for i in range(10)]
    answered_bad = [  # a result (failed / expired) and, except the expired one, the DLQ
        chat(f"{tag}-model", "x", body={"model": "gpt-17"}),  # failed: unknown_model
        chat(f"{tag}-ctx", " ".join(["word"] * 300), body={"max_tokens": 100}),  # context
        chat(f"{tag}-expired", "x", deadline="2020-01-01T00:00:00Z"),  # expired
    ]
    garbage = [(None, b"{not json"), (b"bad key!", b"{}")]  # no request id: the DLQ only
    producer = KafkaProducer(bootstrap_servers=lane.bootstrap, linger_ms=5, acks="all")
    try:
        for env in [*good, *answered_bad, good[0]]:  # good[0] twice: a duplicate
            producer.send(
                lane.topic, key=env["request_id"].encode(), value=json.dumps(env).encode()
            )
        for env in bulk:
            producer.send(
                lane.bulk_topic, key=env["request_id"].encode(), value=json.dumps(env).encode()
            )
        for key, value in garbage:
            producer.send(lane.topic, key=key, value=value)
        producer.flush()
    finally:
        producer.close()
    rids = [e["request_id"] for e in [*good, *bulk, *answered_bad]]
    return rids, len(answered_bad) - 1 + len(garbage)


def caught_up(prom: Prom, requests: int, dead_letters: int, serve_requests: int) -> bool:
    """Whether Prometheus has scraped this many finished requests and dead letters from
    the worker, and this many usage-counted requests from `qbatch serve`."""
    return (
        prom.scalar(f'sum(qbatch_requests_total{{job="{WORKER_JOB}"}})') >= requests
        and prom.scalar(f'sum(qbatch_dead_lettered_total{{job="{WORKER_JOB}"}})') >= dead_letters
        and prom.scalar(f'sum(qbatch_serve_usage_requests_total{{job="{SERVE_JOB}"}})')
        >= serve_requests
    )


def wait_results(r: redis.Redis, prefix: str, rids: list[str], timeout: float = 60) -> None:
    def done() -> bool:
        layout = RedisKeys(prefix, cluster=is_cluster(r))
        found = mget(r, [layout.result(x) for x in rids])
        return all(v is not None for v in found)

    wait_until(f"results of {len(rids)} requests", done, timeout=timeout, every=0.2)


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # collapsed rows keep theirs inside


def fill(expr: str, values: dict[str, str]) -> str:
    """Grafana's $var / ${var} / ${var:format} substitution."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"no value for the Grafana variable ${name} in {expr}"
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", sub, expr)


# --------------------------------------------------------------------------- the test


@pytest.fixture
def lane(stack: Any, tmp_path: Path) -> Iterator[Lane]:
    lane = Lane.new("qbprom")
    lane.create_topics(partitions=2)
    yield lane
    for name in ("worker.log", "serve.log"):
        log = tmp_path / name
        if log.exists():  # shown by pytest only when the test failed
            print(f"---- {name} (tail) ----\n{log.read_text(errors='replace')[-3000:]}")
    lane.clean_redis()
    lane.delete_topics()


def test_dashboard_queries_and_alert_rules_on_live_worker_metrics(
    lane: Lane, tmp_path: Path
) -> None:
    require_binary("prometheus")
    metrics_port = free_port()
    worker_log = tmp_path / "worker.log"
    worker = start_worker(lane, "--max-model-len", "256", log=worker_log, metrics_port=metrics_port)
    server = Server(
        lane, tmp_path / "files", keys_file(tmp_path / "keys.json"), tmp_path / "serve.log"
    )
    r = connect(lane.redis_url)
    try:
        wait_http(f"http://127.0.0.1:{metrics_port}/metrics", worker, worker_log)
        server.start()
        instance = f"127.0.0.1:{metrics_port}"
        targets = {WORKER_JOB: instance, SERVE_JOB: f"127.0.0.1:{server.port}"}
        with prometheus(tmp_path, targets) as prom:
            wait_until(
                "both targets scraped",
                lambda: prom.scalar(f'sum(up{{job=~"{WORKER_JOB}|{SERVE_JOB}"}})') == 2,
            )
            # two waves, so that rate() sees the labelled series (which appear with their
            # first increment) grow, and the histograms have buckets that moved
            requests = dead_letters = serve_requests = 0
            for wave in ("w1", "w2"):
                rids, dead = send_wave(lane, f"{wave}-{uuid.uuid4().hex[:6]}")
                for i in range(2):
                    server.client().chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"{wave} {i}"}]
                    )
                # the serve requests are the worker's too
                requests, dead_letters = requests + len(rids) + 2, dead_letters + dead
                serve_requests += 2
                wait_results(r, lane.prefix, rids)
                wait_until(
                    f"prometheus to see {requests} finished requests, {dead_letters} dead "
                    f"letters and {serve_requests} serve requests",
                    functools.partial(caught_up, prom, requests, dead_letters, serve_requests),
                )
            time.sleep(3)  # a few more scrapes after the last increment

            check_dashboard(prom, instance)
            check_alert_rules(prom)
    finally:
        server.stop()
        stop_worker(worker)
        r.close()


def check_dashboard(prom: Prom, instance: str) -> None:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    values = {
        "job": WORKER_JOB,
        "instance": instance,
        "serve_job": SERVE_JOB,
        "tenant": TENANT,
        "model": MODEL,
        "datasource": "prometheus",
        "__rate_interval": RATE_INTERVAL,
        "__interval": "1s",
        "__range": RANGE,
    }
    # the template variables' own queries: label_values(selector, label)
    expected_label = {"job": WORKER_JOB, "instance": instance, "serve_job": SERVE_JOB,
                      "tenant": TENANT, "model": MODEL}  # fmt: skip
    problems: list[str] = []
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", fill(q, values).strip())
        assert m, f"variable {var['name']}: not a label_values(selector, label) query: {q}"
        body = prom.get(f"/api/v1/label/{m.group(2)}/values", **{"match[]": m.group(1)})
        if body["status"] != "success" or expected_label[var["name"]] not in body["data"]:
            problems.append(f"variable ${var['name']}: {q} -> {body}")

    seen: set[tuple[str, str]] = set()
    empty: dict[tuple[str, str], str] = {}
    nan_only: list[str] = []
    for panel in panels(dash):
        for target in panel.get("targets", []):
            if "expr" not in target:
                continue
            key = (panel["title"], target["refId"])
            seen.add(key)
            expr = fill(target["expr"], values)
            body = prom.query(expr)
            if body["status"] != "success":
                problems.append(f"{key}: invalid query {expr}: {body.get('error')}")
                continue
            result = body["data"]["result"]
            if not result:
                empty[key] = expr
            elif all(math.isnan(float(s["value"][1])) for s in result):
                nan_only.append(f"{key}: {expr}")
            if key in EXPECTED and not EXPECTED[key][1](result):
                problems.append(f"{key}: expected {EXPECTED[key][0]}, got {result}")
    for key, expr in empty.items():
        if key not in ALLOWED_EMPTY:
            problems.append(f"{key}: no data (a metric or label nobody exports?): {expr}")
    for key in [*ALLOWED_EMPTY, *EXPECTED]:
        if key not in seen:
            problems.append(f"ALLOWED_EMPTY / EXPECTED name no panel query: {key}")
    for key in ALLOWED_EMPTY:
        if key in seen and key not in empty:
            problems.append(f"ALLOWED_EMPTY entry returns data now, remove it: {key}")
    print(f"{len(seen)} panel queries checked; NaN only (no observations in range): {nan_only}")
    assert len(seen) >= 40, f"only {len(seen)} panel queries found in {DASHBOARD}"
    assert not problems, "dashboard queries failed on live data:\n" + "\n".join(problems)


def check_alert_rules(prom: Prom) -> None:
    groups = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    rules = {r["alert"]: r for g in groups for r in g["rules"]}
    problems: list[str] = []
    for name, rule in rules.items():
        body = prom.query(rule["expr"])
        if body["status"] != "success":
            problems.append(f"{name}: invalid expr: {body.get('error')}")
        # every metric the rule reads is in the scraped data (a renamed metric makes a
        # rule that silently never fires)
        metrics = set(re.findall(r"\bqbatch_\w+", rule["expr"]))
        if re.search(r"\bup\{", rule["expr"]):
            metrics.add("up")
        for metric in sorted(metrics):
            if not prom.query(f'count({{__name__="{metric}", job="{WORKER_JOB}"}})')["data"][
                "result"
            ]:
                problems.append(f"{name}: reads {metric}, which the worker does not export")

    def loaded() -> list[dict[str, Any]] | None:
        body = prom.get("/api/v1/rules", type="alert")
        live = body["data"]["groups"]
        evaluated = all(r["health"] != "unknown" for g in live for r in g["rules"])
        return live if live and evaluated else None

    live = wait_until("every rule group evaluated", loaded, timeout=30)
    assert sorted(g["name"] for g in live) == sorted(g["name"] for g in groups)
    live_rules = {r["name"]: r for g in live for r in g["rules"]}
    assert sorted(live_rules) == sorted(rules)
    for name, rule in live_rules.items():
        if rule["health"] != "ok" or rule.get("lastError"):
            problems.append(f"{name}: health {rule['health']}: {rule.get('lastError')}")
    states = {name: rule["state"] for name, rule in live_rules.items()}
    print(f"alert states on live data: {states}")
    for name, state in states.items():
        if state != "inactive" and name not in ALLOWED_ACTIVE:
            problems.append(f"{name} is {state} on a healthy worker: {live_rules[name]['alerts']}")
    assert not problems, "alert rules failed on live data:\n" + "\n".join(problems)
