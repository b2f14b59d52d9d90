"""Static checks of the dashboard, the alert rules and the Prometheus config against the
series the worker and `qbatch serve` really export (a renamed metric fails here); PromQL
syntax is checked when the optional `promql_parser` package is importable."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.unit._deploy_files import (
    ALERTS,
    COMPOSE,
    DASHBOARD,
    DOCKER,
    METRIC_TOKEN,
    PROM_CONFIG,
    WORKER_JOB,
    allowed_metric_names,
    duration_s,
    load_one,
    walk,
)

# --------------------------------------------------------------------------- metric names


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _dashboard_exprs() -> list[str]:
    dash = _dashboard()
    exprs = [n["expr"] for n in walk(dash["panels"]) if isinstance(n, dict) and "expr" in n]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if var["type"] == "query":
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


def _alert_rules() -> list[dict[str, Any]]:
    return [r for g in load_one(ALERTS)["groups"] for r in g["rules"]]


def test_registry_yields_the_expected_series_names() -> None:
    names = allowed_metric_names()
    assert "qbatch_requests_total" in names
    assert "qbatch_requests" not in names  # the bare counter family is not a series
    assert "qbatch_end_to_end_latency_seconds_bucket" in names
    assert "qbatch_consumer_lag" in names


def test_every_metric_in_dashboard_and_alerts_exists() -> None:
    allowed = allowed_metric_names()
    sources = {f"dashboard: {e}": e for e in _dashboard_exprs()}
    sources |= {f"alert {r['alert']}: {r['expr']}": r["expr"] for r in _alert_rules()}
    used: set[str] = set()
    for where, expr in sources.items():
        tokens = set(METRIC_TOKEN.findall(expr))
        unknown = tokens - allowed
        assert not unknown, f"unknown metric(s) {sorted(unknown)} in {where}"
        used |= tokens
    assert len(used) >= 15


def test_dashboard_covers_the_operator_questions() -> None:
    used = {t for e in _dashboard_exprs() for t in METRIC_TOKEN.findall(e)}
    required = {
        "qbatch_requests_total", "qbatch_end_to_end_latency_seconds_bucket",
        "qbatch_queue_latency_seconds_bucket", "qbatch_inference_latency_seconds_bucket",
        "qbatch_batch_size_bucket", "qbatch_batch_wait_seconds_bucket",
        "qbatch_in_flight_requests", "qbatch_pending_result_writes", "qbatch_consumer_lag",
        "qbatch_generation_tokens_per_second", "qbatch_engine_kv_cache_usage_ratio",
        "qbatch_dead_lettered_total", "qbatch_redis_up", "qbatch_partitions_paused",
        "qbatch_serve_usage_requests_total", "qbatch_serve_usage_tokens_total",
    }  # fmt: skip
    assert required <= used, f"dashboard lacks {sorted(required - used)}"
    exprs = " ".join(_dashboard_exprs())
    for hist in ("end_to_end_latency", "queue_latency", "inference_latency"):
        assert re.search(rf"histogram_quantile\(0\.99, .*qbatch_{hist}_seconds_bucket", exprs)


def test_dashboard_structure() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"]
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "job", "instance", "serve_job", "tenant"} <= names
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", (
            f"panel {p['title']} hardcodes a datasource"
        )
        assert p["targets"], f"panel {p['title']} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            # `qbatch serve`'s series by its job and the tenant variable (by tenant)
            if "qbatch_serve_" in t["expr"]:
                assert 'job=~"$serve_job"' in t["expr"], f"{p['title']}: {t['expr']}"
                assert 'tenant=~"$tenant"' in t["expr"], f"{p['title']}: {t['expr']}"
                assert "tenant" in t["legendFormat"], f"{p['title']}: by tenant"
            # every per-worker series is filtered by the dashboard's job/instance variables
            elif "qbatch_" in t["expr"]:
                assert 'job=~"$job"' in t["expr"], f"{p['title']}: {t['expr']}"
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24


def test_alert_rules_are_complete() -> None:
    rules = _alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    required = {
        "QbatchConsumerLagGrowing", "QbatchErrorRateHigh", "QbatchNoProgress", "QbatchRedisDown",
        "QbatchDeadLetterSpike", "QbatchWorkerPausedTooLong",
    }  # fmt: skip
    assert required <= set(names)
    for r in rules:
        assert r["labels"]["severity"] in {"info", "warning", "critical"}, r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        if "for" in r:
            assert duration_s(r["for"]) > 0
        for job in re.findall(r'job="([^"]+)"', r["expr"]):
            assert job == WORKER_JOB


def _promql_ready(expr: str) -> str:
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    expr = expr.replace("$__range", "1h")
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def test_promql_expressions_parse() -> None:
    promql_parser = pytest.importorskip("promql_parser")
    exprs = [r["expr"] for r in _alert_rules()] + _dashboard_exprs()
    assert len(exprs) > 20, "the rules and panels were not read"
    for expr in exprs:
        if expr.startswith("label_values("):
            continue  # Grafana template function, not PromQL
        try:
            promql_parser.parse(_promql_ready(expr))
        except Exception as exc:  # the binding raises a bare ValueError-like error
            raise AssertionError(f"does not parse: {expr}\n{exc}") from exc


def test_prometheus_config_scrapes_the_worker_and_loads_the_rules() -> None:
    cfg = load_one(PROM_CONFIG)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    job = jobs[WORKER_JOB]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    compose = load_one(COMPOSE)
    port = compose["services"]["worker"]["environment"]["QBATCH_METRICS_PORT"]
    assert targets == [f"worker:{port}"]
    mounts = {
        v.split(":")[1]: v.split(":")[0] for v in compose["services"]["prometheus"]["volumes"]
    }
    # `qbatch serve`: its /metrics on the API port compose gives it
    serve_port = compose["services"]["serve"]["environment"]["QBATCH_SERVE_PORT"]
    serve_job = jobs["qbatch-serve"]
    assert serve_job.get("metrics_path", "/metrics") == "/metrics"
    assert [t for sc in serve_job["static_configs"] for t in sc["targets"]] == [
        f"serve:{serve_port}"
    ]
    for rule_file in cfg["rule_files"]:
        src = mounts[rule_file]
        assert (DOCKER / src).resolve() == ALERTS.resolve()
