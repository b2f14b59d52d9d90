"""Static checks of everything under deploy/: container, compose, Kubernetes, dashboards, alerts.

Nothing here starts a container or talks to a cluster. The checks are the ones that catch
real drift: a metric renamed in `worker.metrics` but still used by a dashboard or alert, a
probe on the wrong path or port, a grace period shorter than the drain timeout, a GPU
request that differs from the tensor-parallel size, a KEDA trigger watching another topic
or group than the workers consume, a compose key that does not exist.

Where `kubectl` (or `kustomize`) is installed the Kustomize base and overlay are rendered
and checked as rendered; `docker compose config` is run where a compose plugin exists.
PromQL syntax is checked when the optional `promql_parser` package is importable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from worker.config import WorkerSettings
from worker.metrics import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKER = DEPLOY / "docker"
K8S = DEPLOY / "k8s"
BASE = K8S / "base"
OVERLAY = K8S / "overlays" / "example"
DASHBOARD = DEPLOY / "grafana" / "qbatch.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"

METRIC_TOKEN = re.compile(r"qbatch_[a-z_]+")
WORKER_JOB = "qbatch-worker"


# --------------------------------------------------------------------------- helpers


def _deploy_yaml_files() -> list[Path]:
    files = [
        p
        for p in sorted(DEPLOY.rglob("*"))
        if p.suffix in {".yaml", ".yml"}
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(DEPLOY).parts)
    ]
    return files


def _load_all(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _load_one(path: Path) -> Any:
    docs = _load_all(path)
    assert len(docs) == 1, f"{path}: expected one YAML document, got {len(docs)}"
    return docs[0]


def _serve_registry() -> Any:
    """`qbatch serve`'s own registry (its usage counters; no store is touched)."""
    from producer.serve.metrics import UsageRecorder

    return UsageRecorder(store=None).registry  # type: ignore[arg-type]


@cache
def allowed_metric_names() -> frozenset[str]:
    """Series names the worker and `qbatch serve` can export, from the registries."""
    names: set[str] = set()
    for family in [*REGISTRY.collect(), *_serve_registry().collect()]:
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        elif family.type == "summary":
            names.update(family.name + s for s in ("", "_sum", "_count"))
        else:
            names.add(family.name)
    return frozenset(names)


def _read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {raw!r}"
        env[key.strip()] = value.strip()
    return env


def _duration_s(value: str) -> float:
    """Go/Compose durations like '90s', '1m30s', '2m'."""
    total = 0.0
    matched = ""
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value):
        total += float(num) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
        matched += num + unit
    assert matched == value, f"not a duration: {value!r}"
    return total


_INTERP = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _interp_default(value: str) -> str:
    """Resolve compose `${VAR:-default}` to its default (as with an empty environment)."""
    return _INTERP.sub(lambda m: m.group(2) or "", value)


def _walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _kustomize_cmd() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@cache
def _render(directory: Path) -> tuple[dict[str, Any], ...]:
    cmd = _kustomize_cmd()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    out = subprocess.run(
        [*cmd, str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, f"kustomize failed for {directory}:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


TOOL_EXECUTOR = "tool-executor"
SERVE = "serve"


def _component(doc: dict[str, Any]) -> str | None:
    labels: dict[str, str] = doc.get("metadata", {}).get("labels") or {}
    return labels.get("app.kubernetes.io/component")


def _one(docs: tuple[dict[str, Any], ...] | list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one worker object of `kind` (the tool executor's and the server's objects are
    checked apart)."""
    found = [d for d in docs if d["kind"] == kind and _component(d) not in {TOOL_EXECUTOR, SERVE}]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    workers = [c for c in containers if c["name"] == "worker"]
    assert len(workers) == 1
    return workers[0]


def _resolve_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert named, f"probe port {port!r} is not a named container port"
    return int(named[0])


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --------------------------------------------------------------------------- every YAML


def test_deploy_tree_has_the_expected_files() -> None:
    for path in (
        DOCKERFILE,
        COMPOSE,
        DASHBOARD,
        ALERTS,
        PROM_CONFIG,
        BASE / "kustomization.yaml",
        OVERLAY / "kustomization.yaml",
        DEPLOY / "README.md",
    ):
        assert path.is_file(), f"missing {path.relative_to(ROOT)}"


@pytest.mark.parametrize("path", _deploy_yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_under_deploy_parses(path: Path) -> None:
    docs = _load_all(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: top level is {type(doc).__name__}, not a mapping"


def _k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in _deploy_yaml_files() if K8S in p.parents for d in _load_all(p)]


def test_every_k8s_object_has_api_version_kind_and_name() -> None:
    docs = _k8s_docs()
    assert len(docs) >= 10
    for path, doc in docs:
        where = path.relative_to(ROOT)
        api = doc.get("apiVersion")
        assert isinstance(api, str), f"{where}: no apiVersion"
        assert re.fullmatch(r"([a-z0-9.-]+/)?v\d+((alpha|beta)\d+)?", api), f"{where}: {api}"
        assert isinstance(doc.get("kind"), str) and doc["kind"], f"{where}: no kind"
        if doc["kind"] == "Kustomization":
            continue
        name = doc.get("metadata", {}).get("name")
        assert isinstance(name, str) and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name), (
            f"{where}: metadata.name {name!r} is not a DNS-1123 name"
        )


# --------------------------------------------------------------------------- kustomize


def _kustomization_refs(directory: Path) -> list[str]:
    k = _load_one(directory / "kustomization.yaml")
    refs: list[str] = list(k.get("resources", []))
    refs += [p["path"] for p in k.get("patches", []) if "path" in p]
    refs += list(k.get("patchesStrategicMerge", []))
    for gen in k.get("configMapGenerator", []) + k.get("secretGenerator", []):
        refs += list(gen.get("envs", []))
        refs += [f.split("=", 1)[-1] for f in gen.get("files", [])]
    return refs


@pytest.mark.parametrize("directory", [BASE, OVERLAY], ids=["base", "overlay"])
def test_kustomization_lists_files_that_exist(directory: Path) -> None:
    refs = _kustomization_refs(directory)
    assert refs
    for ref in refs:
        target = (directory / ref).resolve()
        if target.is_dir():
            assert (target / "kustomization.yaml").is_file(), (
                f"{ref}: directory without kustomization"
            )
        else:
            assert target.is_file(), (
                f"{directory.relative_to(ROOT)}/kustomization.yaml: {ref} missing"
            )


def test_base_kustomization_covers_every_manifest_in_base() -> None:
    """A manifest added to base/ but not listed would silently never be applied."""
    listed = {(BASE / r).resolve() for r in _kustomization_refs(BASE)}
    for path in BASE.glob("*.yaml"):
        if path.name in {"kustomization.yaml", "secret.example.yaml"}:
            continue
        assert path.resolve() in listed, f"{path.name} is not in base/kustomization.yaml"


def test_secret_example_is_not_applied() -> None:
    assert "secret.example.yaml" not in _kustomization_refs(BASE)
    assert {d["kind"] for d in _load_all(BASE / "secret.example.yaml")} == {"Secret"}


# --------------------------------------------------------------------------- worker settings


def _overlay_values() -> dict[str, str]:
    """base/worker.env merged with the overlay's configMapGenerator literals."""
    env = _read_env_file(BASE / "worker.env")
    k = _load_one(OVERLAY / "kustomization.yaml")
    gens = [g for g in k.get("configMapGenerator", []) if g["name"] == "qbatch-worker-config"]
    assert gens and gens[0].get("behavior") == "merge"
    for literal in gens[0].get("literals", []):
        key, _, value = literal.partition("=")
        env[key] = value
    return env


def _strategic_patch(kind: str) -> dict[str, Any]:
    k = _load_one(OVERLAY / "kustomization.yaml")
    for p in k.get("patches", []):
        doc = _load_one(OVERLAY / p["path"])
        if doc["kind"] == kind:
            return doc
    raise AssertionError(f"overlay has no {kind} patch")


def test_secrets_stay_out_of_the_config_map() -> None:
    for env in (
        _read_env_file(BASE / "worker.env"),
        _overlay_values(),
        _read_env_file(BASE / "serve.env"),
    ):
        for key, value in env.items():
            assert not re.search(r"PASSWORD|TOKEN|SECRET|KEY_ID", key), (
                f"{key} belongs in the Secret"
            )
            assert not re.search(r"://[^/@]*:[^/@]*@", value), f"{key} embeds credentials"


def _known_setting_env_names() -> set[str]:
    return {f"QBATCH_{name.upper()}" for name in WorkerSettings.model_fields}


def test_every_worker_env_name_is_a_known_setting() -> None:
    known = _known_setting_env_names()
    assert {"QBATCH_TENSOR_PARALLEL_SIZE", "QBATCH_DRAIN_TIMEOUT_S", "QBATCH_METRICS_PORT"} <= known
    compose_env = _load_one(COMPOSE)["services"]["worker"]["environment"]
    deployment = _load_one(BASE / "deployment.yaml")
    pod_env = {e["name"] for e in _container(deployment)["env"]}
    for name in [*_overlay_values(), *compose_env, *pod_env]:
        if name.startswith("QBATCH_"):
            assert name in known, f"{name} is not a setting the worker reads"


def _settings_sets() -> dict[str, dict[str, str]]:
    compose_env = _load_one(COMPOSE)["services"]["worker"]["environment"]
    return {
        "k8s base": _read_env_file(BASE / "worker.env"),
        "k8s overlay": _overlay_values(),
        "compose": {k: _interp_default(str(v)) for k, v in compose_env.items()},
    }


@pytest.mark.parametrize("which", ["k8s base", "k8s overlay", "compose"])
def test_shipped_settings_validate_as_worker_settings(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The values each manifest ships parse as the worker would parse them."""
    for key in list(os.environ):
        if key.startswith("QBATCH_"):
            monkeypatch.delenv(key)
    values = _settings_sets()[which]
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    settings = WorkerSettings()
    assert settings.engine == "vllm" and settings.model
    assert settings.tensor_parallel_size == int(values["QBATCH_TENSOR_PARALLEL_SIZE"])
    assert settings.metrics_port == 9400
    assert settings.max_inflight >= (settings.max_num_seqs or 0), (
        "max_inflight below the engine's max_num_seqs starves the engine"
    )


# --------------------------------------------------------------------------- deployment


def _check_worker_objects(
    docs: list[dict[str, Any]] | tuple[dict[str, Any], ...], env: dict[str, str]
) -> None:
    """Checks shared by the raw base, the rendered base and the rendered overlay."""
    deployment = _one(docs, "Deployment")
    pod = deployment["spec"]["template"]
    container = _container(deployment)
    metrics_port = int(env["QBATCH_METRICS_PORT"])

    assert _matches(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])

    # probes: liveness/startup on /healthz, readiness on /readyz, all on the metrics port
    expected = {
        "livenessProbe": "/healthz",
        "readinessProbe": "/readyz",
        "startupProbe": "/healthz",
    }
    for probe, path in expected.items():
        http = container[probe]["httpGet"]
        assert http["path"] == path, f"{probe} on {http['path']}"
        assert _resolve_port(container, http["port"]) == metrics_port, f"{probe} port"

    # graceful drain fits inside the grace period
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    drain = float(env["QBATCH_DRAIN_TIMEOUT_S"])
    assert grace > drain + 10, f"terminationGracePeriodSeconds {grace} <= drain {drain} + 10"

    # one pod = one tensor-parallel group
    tp = int(env["QBATCH_TENSOR_PARALLEL_SIZE"])
    res = container["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) == tp
    assert int(res["requests"]["nvidia.com/gpu"]) == tp

    # /dev/shm in memory (NCCL), model cache at HF_HOME
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    cache_mount = next(p for p in mounts if env["HF_HOME"].startswith(p + "/"))
    assert mounts[cache_mount] in volumes

    # config from the ConfigMap, secrets from the Secret
    refs = [e["configMapRef"]["name"] for e in container["envFrom"] if "configMapRef" in e]
    assert len(refs) == 1
    secret_env = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert {"QBATCH_KAFKA_SASL_PASSWORD", "QBATCH_REDIS_PASSWORD"} <= set(secret_env)
    for ref in secret_env.values():
        assert ref["name"] == "qbatch-worker-secrets"

    # non-root, matching the image's user
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] != 0

    # Service and ServiceMonitor reach the metrics port; PDB selects the pods
    service = _one(docs, "Service")
    assert _matches(service["spec"]["selector"], pod["metadata"]["labels"])
    svc_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert _resolve_port(container, svc_ports["metrics"]["targetPort"]) == metrics_port
    monitor = _one(docs, "ServiceMonitor")
    assert _matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert service["metadata"]["name"] == WORKER_JOB, "job label in alerts/dashboard"
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [
        ("metrics", "/metrics")
    ]
    pdb = _one(docs, "PodDisruptionBudget")
    assert _matches(pdb["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])

    # KEDA watches what the workers consume and never asks for idle workers
    scaled = _one(docs, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "kafka"
    # total lag over every lane the group consumes (interactive + bulk): no single topic
    assert "topic" not in meta
    assert env["QBATCH_BULK_TOPIC"] != env["QBATCH_TOPIC"]
    assert meta["consumerGroup"] == env["QBATCH_GROUP"]
    assert meta["bootstrapServers"] == env["QBATCH_KAFKA_BOOTSTRAP"]
    assert meta["allowIdleConsumers"] == "false"
    assert int(meta["lagThreshold"]) > 0
    partitions = int(scaled["metadata"]["annotations"]["qbatch.dev/topic-partitions"])
    lo, hi = scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]
    assert 0 <= lo <= hi <= partitions, "replicas beyond the partition count would sit idle"
    if env["QBATCH_KAFKA_SECURITY_PROTOCOL"].startswith("SASL"):
        assert "authenticationRef" in trigger, "KEDA needs credentials for a SASL cluster"
        keda_sasl = {
            "PLAIN": "plaintext",
            "SCRAM-SHA-256": "scram_sha256",
            "SCRAM-SHA-512": "scram_sha512",
        }
        assert meta.get("sasl") == keda_sasl[env["QBATCH_KAFKA_SASL_MECHANISM"]]
        assert (meta.get("tls") == "enable") == env["QBATCH_KAFKA_SECURITY_PROTOCOL"].endswith(
            "SSL"
        )
    if "authenticationRef" in trigger:
        auth = _one(docs, "TriggerAuthentication")
        assert auth["metadata"]["name"] == trigger["authenticationRef"]["name"]


def test_base_manifests_are_consistent() -> None:
    docs = [d for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml" for d in _load_all(p)]
    _check_worker_objects(docs, _read_env_file(BASE / "worker.env"))


def test_overlay_patches_keep_gpu_grace_and_config_consistent() -> None:
    """Without rendering: the overlay's values against its own patches."""
    env = _overlay_values()
    dep = _strategic_patch("Deployment")
    res = _container(dep)["resources"]
    tp = int(env["QBATCH_TENSOR_PARALLEL_SIZE"])
    assert tp > 1, "the example overlay demonstrates tensor parallelism"
    assert int(res["limits"]["nvidia.com/gpu"]) == int(res["requests"]["nvidia.com/gpu"]) == tp
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(env["QBATCH_DRAIN_TIMEOUT_S"]) + 10


@pytest.mark.parametrize("directory", [BASE, OVERLAY], ids=["base", "overlay"])
def test_rendered_kustomization_is_consistent(directory: Path) -> None:
    docs = _render(directory)
    config = _one(docs, "ConfigMap")
    assert config["metadata"]["name"].startswith("qbatch-worker-config-"), "hashed name"
    container = _container(_one(docs, "Deployment"))
    assert container["envFrom"][0]["configMapRef"]["name"] == config["metadata"]["name"]
    assert container["image"] != "qbatch-worker", "images: transformer did not pin a tag"
    env = dict(config["data"])
    if directory == OVERLAY:
        assert env == _overlay_values()
        assert {d["metadata"].get("namespace") for d in docs} == {"qbatch"}
    _check_worker_objects(docs, env)


def test_prometheus_rule_matches_alerts_file() -> None:
    rule = _load_one(BASE / "prometheusrule.yaml")
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == _load_one(ALERTS)["groups"], (
        "deploy/k8s/base/prometheusrule.yaml is out of date: regenerate it from alerts.yaml"
    )


# --------------------------------------------------------------------------- metric names


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _dashboard_exprs() -> list[str]:
    dash = _dashboard()
    exprs = [n["expr"] for n in _walk(dash["panels"]) if isinstance(n, dict) and "expr" in n]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if var["type"] == "query":
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


def _alert_rules() -> list[dict[str, Any]]:
    return [r for g in _load_one(ALERTS)["groups"] for r in g["rules"]]


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
            assert _duration_s(r["for"]) > 0
        for job in re.findall(r'job="([^"]+)"', r["expr"]):
            assert job == WORKER_JOB


def _promql_ready(expr: str) -> str:
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    expr = expr.replace("$__range", "1h")
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def test_promql_expressions_parse() -> None:
    promql_parser = pytest.importorskip("promql_parser")
    exprs = [r["expr"] for r in _alert_rules()] + _dashboard_exprs()
    for expr in exprs:
        if expr.startswith("label_values("):
            continue  # Grafana template function, not PromQL
        try:
            promql_parser.parse(_promql_ready(expr))
        except Exception as exc:  # the binding raises a bare ValueError-like error
            raise AssertionError(f"does not parse: {expr}\n{exc}") from exc


def test_prometheus_config_scrapes_the_worker_and_loads_the_rules() -> None:
    cfg = _load_one(PROM_CONFIG)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    job = jobs[WORKER_JOB]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    compose = _load_one(COMPOSE)
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


# --------------------------------------------------------------------------- compose

# Service keys of the Compose specification that this file may use (a subset of
# compose-spec's service schema; a typo such as `stop_grace_periode` fails here).
_COMPOSE_SERVICE_KEYS = {
    "build", "command", "container_name", "depends_on", "deploy", "entrypoint", "environment",
    "env_file", "expose", "healthcheck", "image", "init", "ipc", "labels", "logging",
    "networks", "ports", "profiles", "restart", "secrets", "shm_size", "stop_grace_period",
    "stop_signal", "ulimits", "user", "volumes", "working_dir",
}  # fmt: skip
_HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period", "start_interval"}


def test_compose_structure() -> None:
    compose = _load_one(COMPOSE)
    services = compose["services"]
    assert {"kafka", "kafka-init", "redis", "worker", "prometheus", "grafana"} <= set(services)
    volumes = set(compose.get("volumes", {}))
    for name, svc in services.items():
        assert set(svc) <= _COMPOSE_SERVICE_KEYS, (
            f"{name}: unknown keys {set(svc) - _COMPOSE_SERVICE_KEYS}"
        )
        if "healthcheck" in svc:
            assert set(svc["healthcheck"]) <= _HEALTHCHECK_KEYS
            assert svc["healthcheck"]["test"][0] in {"CMD", "CMD-SHELL"}
        deps = svc.get("depends_on", {})
        for dep, cond in deps.items() if isinstance(deps, dict) else []:
            assert dep in services
            assert cond["condition"] in {
                "service_started", "service_healthy", "service_completed_successfully",
            }  # fmt: skip
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], (
                    f"{name} waits on {dep}'s missing healthcheck"
                )
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DOCKER / src).exists(), f"{name}: bind source {src} missing"
            else:
                assert src in volumes, f"{name}: volume {src} not declared"
        # every image pinned to an explicit version
        image = _interp_default(svc.get("image", ""))
        if image and "build" not in svc:
            tag = image.rsplit(":", 1)[-1] if ":" in image.split("/")[-1] else ""
            assert tag and tag != "latest" and re.search(r"\d", tag), f"{name}: unpinned {image}"
        for port in svc.get("ports", []):
            assert _interp_default(port).startswith("127.0.0.1:"), f"{name}: {port} not loopback"


def test_compose_kafka_and_topic_init() -> None:
    services = _load_one(COMPOSE)["services"]
    kafka = services["kafka"]
    assert re.fullmatch(r"apache/kafka:4\.\d+\.\d+", kafka["image"])
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", env["CLUSTER_ID"]), "CLUSTER_ID must be a base64 UUID"
    init = services["kafka-init"]
    assert init["image"] == kafka["image"]
    assert init["depends_on"]["kafka"]["condition"] == "service_healthy"
    script = "\n".join(init["command"])
    assert script.count("--create --if-not-exists") == 2  # the lanes' loop and the DLQ
    for name in (
        "QBATCH_TOPIC",
        "QBATCH_BULK_TOPIC",
        "QBATCH_RESULTS_TOPIC_NAME",
        "QBATCH_DLQ_TOPIC",
    ):
        assert f"$${name}" in script
    assert _interp_default(init["environment"]["QBATCH_BULK_TOPIC"]) == "qbatch.requests.bulk"
    assert _interp_default(init["environment"]["QBATCH_TOPIC"]) == "qbatch.requests"
    assert _interp_default(init["environment"]["QBATCH_DLQ_TOPIC"]) == "qbatch.requests.dlq"
    assert int(_interp_default(init["environment"]["QBATCH_PARTITIONS"])) >= 2


def test_compose_gpu_worker() -> None:
    services = _load_one(COMPOSE)["services"]
    worker = services["worker"]
    assert (DOCKER / worker["build"]["context"] / worker["build"]["dockerfile"]).resolve() == (
        DOCKERFILE.resolve()
    )
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert "gpu" in device["capabilities"]
    env = worker["environment"]
    # one knob: the GPUs reserved are the tensor-parallel size
    assert device["count"] == env["QBATCH_TENSOR_PARALLEL_SIZE"]
    assert int(_interp_default(device["count"])) >= 1
    assert env["QBATCH_ENGINE"] == "vllm"
    assert env["QBATCH_KAFKA_BOOTSTRAP"] == "kafka:9092"
    assert env["QBATCH_REDIS_URL"].startswith("redis://redis:6379/")
    drain = float(_interp_default(env["QBATCH_DRAIN_TIMEOUT_S"]))
    assert _duration_s(worker["stop_grace_period"]) > drain + 10
    assert worker["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "shm_size" in worker or worker.get("ipc") == "host"


def test_compose_grafana_is_provisioned() -> None:
    grafana = _load_one(COMPOSE)["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    prov = (DOCKER / mounts["/etc/grafana/provisioning"]).resolve()
    (ds,) = _load_one(prov / "datasources" / "prometheus.yaml")["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    (provider,) = _load_one(prov / "dashboards" / "qbatch.yaml")["providers"]
    dash_dir = provider["options"]["path"]
    dash_mounts = [(t, s) for t, s in mounts.items() if t.startswith(dash_dir + "/")]
    assert [(DOCKER / s).resolve() for _, s in dash_mounts] == [DASHBOARD.resolve()]


def _docker_compose_available() -> bool:
    if not shutil.which("docker"):
        return False
    probe = subprocess.run(
        ["docker", "compose", "version"], capture_output=True, text=True, timeout=30, check=False
    )
    return probe.returncode == 0


def test_docker_compose_config_validates() -> None:
    if not _docker_compose_available():
        pytest.skip("no docker compose plugin on this machine")
    out = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------- Dockerfile


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text(encoding="utf-8")
    text = re.sub(r"<<'?(\w+)'?\n.*?\n\1\n", "<<heredoc\n", text, flags=re.S)  # drop heredocs
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile() -> None:
    ins = _dockerfile_instructions()
    args = {r.split("=", 1)[0]: r.split("=", 1)[1] for w, r in ins if w == "ARG" and "=" in r}
    (base,) = [r for w, r in ins if w == "FROM"]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (vllm_pin,) = [
        d for d in pyproject["project"]["optional-dependencies"]["vllm"] if d.startswith("vllm")
    ]
    version = vllm_pin.split("==")[1]
    assert base == f"vllm/vllm-openai:v{version}", "base image must match the vllm extra's pin"
    assert f"== '{version}'" in DOCKERFILE.read_text(encoding="utf-8"), "build-time version check"

    users = [r for w, r in ins if w == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    (entry,) = [r for w, r in ins if w == "ENTRYPOINT"]
    assert json.loads(entry) == ["qbatch-worker"]
    assert pyproject["project"]["scripts"]["qbatch-worker"]
    assert "9400" in [r for w, r in ins if w == "EXPOSE"]
    (health,) = [r for w, r in ins if w == "HEALTHCHECK"]
    assert "/healthz" in health and "QBATCH_METRICS_PORT" in health

    # never reinstall vLLM: deps are constrained to the base image's versions
    runs = " ".join(r for w, r in ins if w == "RUN")
    assert "-c /tmp/base-constraints.txt" in runs
    assert "--no-deps ." in runs
    assert not re.search(r"install[^;&]*\bvllm\b", runs)


def test_dockerfile_copies_exist_and_are_not_ignored() -> None:
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore, "the .dockerignore is an allow-list"
    copies = [r.split()[:-1] for w, r in _dockerfile_instructions() if w == "COPY"]
    assert copies
    for sources in copies:
        for src in sources:
            if src.startswith("--"):
                continue
            if "*" in src:
                continue  # optional glob (README.md*)
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert src.rstrip("/") in allowed, f"COPY {src}: excluded by Dockerfile.dockerignore"


# --------------------------------------------------------------------------- README


def test_deploy_readme_links_resolve() -> None:
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local
    for link in local:
        assert (DEPLOY / link).exists(), f"deploy/README.md links to missing {link}"


def test_the_tool_executor_is_deployed_with_the_workers_config() -> None:
    """k8s and compose run `qbatch tools serve` on the worker image, with its HTTP tools
    file mounted, the worker's connection settings, and probes on its metrics port."""
    from producer.tools.http import load_http_tools

    docs = [d for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml" for d in _load_all(p)]
    (deployment,) = [
        d for d in docs if d["kind"] == "Deployment" and _component(d) == TOOL_EXECUTOR
    ]
    pod = deployment["spec"]["template"]
    assert _matches(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    command = container["command"]
    assert command[:3] == ["qbatch", "tools", "serve"]
    config_path = command[command.index("--config") + 1]
    mount = next(m for m in container["volumeMounts"] if config_path.startswith(m["mountPath"]))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    generators = _load_one(BASE / "kustomization.yaml")["configMapGenerator"]
    generated = next(g for g in generators if g["name"] == volume["configMap"]["name"])
    assert Path(config_path).name in generated["files"]
    assert load_http_tools(BASE / Path(config_path).name, env={})  # the shipped file loads
    assert container["envFrom"][0]["configMapRef"]["name"] == "qbatch-worker-config"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env["QBATCH_TOOLS_METRICS_PORT"]) == port
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor" and _component(d) == TOOL_EXECUTOR]
    assert _matches(monitor["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    scrape = _load_one(DEPLOY / "prometheus" / "prometheus.yml")["scrape_configs"]
    targets = [t for job in scrape for c in job["static_configs"] for t in c["targets"]]
    assert f"tools:{port}" in targets, "compose's Prometheus scrapes the executor"
    services = _load_one(COMPOSE)["services"]
    tools = services["tools"]
    assert tools["entrypoint"][:3] == ["qbatch", "tools", "serve"]
    init = " ".join(services["kafka-init"]["command"])
    assert "QBATCH_TOOL_CALLS_TOPIC" in init, "compose creates the tool-calls topic"


# --------------------------------------------------------------------------- qbatch serve


def _serve_envvars() -> set[str]:
    """Every variable a `qbatch serve` option reads."""
    import typing

    from producer.cli_serve import serve

    names: set[str] = set()
    for hint in typing.get_type_hints(serve, include_extras=True).values():
        for meta in getattr(hint, "__metadata__", ()):
            envvar = getattr(meta, "envvar", None)
            names.update([envvar] if isinstance(envvar, str) else envvar or [])
    return names


def _check_serve_objects(docs: list[dict[str, Any]] | tuple[dict[str, Any], ...]) -> None:
    """k8s: one `qbatch serve` replica on the worker image, keys from a Secret as a file,
    readiness on /healthz, storage on a PVC (or S3 from its ConfigMap + Secret)."""
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and _component(d) == SERVE]
    pod = deployment["spec"]["template"]
    assert _matches(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    # one runner per Redis prefix; the RWO volume is let go before the next pod starts
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    (container,) = pod["spec"]["containers"]
    assert container["command"][:2] == ["qbatch", "serve"]
    assert container["image"].rsplit("/", 1)[-1].split(":")[0] == "qbatch-worker"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    configs = [e["configMapRef"]["name"] for e in container["envFrom"]]
    assert configs[0].startswith("qbatch-worker-config"), "the workers' Kafka/Redis settings"
    assert configs[1].startswith("qbatch-serve-config")
    env = {e["name"]: e for e in container["env"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    # keys: a file from the Secret, never a plain-text variable
    keys_file = env["QBATCH_SERVE_KEYS_FILE"]["value"]
    (keys_volume,) = [n for n, path in mounts.items() if keys_file.startswith(path + "/")]
    assert volumes[keys_volume]["secret"]["secretName"] == "qbatch-serve-keys"
    assert "QBATCH_API_KEYS" not in env
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "qbatch-serve-secrets" and ref["optional"] is True
    # storage: the default directory is the PVC's mount; /tmp is writable for S3 spooling
    settings = _read_env_file(BASE / "serve.env")
    (files_volume,) = [n for n, path in mounts.items() if path == settings["QBATCH_SERVE_STORAGE"]]
    claim = volumes[files_volume]["persistentVolumeClaim"]["claimName"]
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim" and _component(d) == SERVE]
    assert pvc["metadata"]["name"] == claim and pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "emptyDir" in volumes[next(n for n, p in mounts.items() if p == "/tmp")]
    assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsUser"]
    # readiness (and liveness) on /healthz at the port the server listens on
    port = int(settings["QBATCH_SERVE_PORT"])
    for probe in ("readinessProbe", "livenessProbe"):
        http = container[probe]["httpGet"]
        assert http["path"] == "/healthz" and _resolve_port(container, http["port"]) == port
    assert settings["QBATCH_SERVE_HOST"] == "0.0.0.0"
    (service,) = [d for d in docs if d["kind"] == "Service" and _component(d) == SERVE]
    assert _matches(service["spec"]["selector"], pod["metadata"]["labels"])
    (svc_port,) = service["spec"]["ports"]
    assert _resolve_port(container, svc_port["targetPort"]) == port
    # Prometheus Operator scrapes /metrics on that port, job="qbatch-serve" as in compose
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor" and _component(d) == SERVE]
    assert _matches(monitor["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and _resolve_port(container, endpoint["port"]) == port
    assert pod["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "qbatch-serve"


def test_serve_is_deployed_with_keys_storage_and_probes() -> None:
    docs = [d for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml" for d in _load_all(p)]
    _check_serve_objects(docs)
    # its settings are `qbatch serve` options (or boto3's own AWS_* variables)
    settings = _read_env_file(BASE / "serve.env")
    known = _serve_envvars()
    assert {"QBATCH_SERVE_STORAGE", "QBATCH_S3_ENDPOINT_URL"} <= known
    for name in settings:
        assert name in known or name.startswith("AWS_"), f"serve.env: {name} is no serve option"
    generators = _load_one(BASE / "kustomization.yaml")["configMapGenerator"]
    (gen,) = [g for g in generators if g["name"] == "qbatch-serve-config"]
    assert (
        gen["envs"] == ["serve.env"]
        and gen["options"]["labels"]["app.kubernetes.io/component"] == SERVE
    )
    # the example Secrets show the keys the Deployment reads
    secrets = {d["metadata"]["name"]: d for d in _load_all(BASE / "secret.example.yaml")}
    assert "keys.yaml" in secrets["qbatch-serve-keys"]["stringData"]
    assert {"aws-access-key-id", "aws-secret-access-key"} <= set(
        secrets["qbatch-serve-secrets"]["stringData"]
    )


@pytest.mark.parametrize("directory", [BASE, OVERLAY], ids=["base", "overlay"])
def test_rendered_serve_objects(directory: Path) -> None:
    docs = _render(directory)
    _check_serve_objects(docs)
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and _component(d) == SERVE]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and _component(d) == SERVE]
    refs = [e["configMapRef"]["name"] for e in _container_named(deployment, "serve")["envFrom"]]
    assert config["metadata"]["name"] in refs, "hashed name reaches the Deployment"


def _container_named(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name
    ]
    return found


def test_compose_serve() -> None:
    """compose: `qbatch serve` on the worker image, keys from a mounted secret, storage a
    volume (or S3 from the environment), health on /healthz, loopback port."""
    compose = _load_one(COMPOSE)
    services = compose["services"]
    serve, worker = services["serve"], services["worker"]
    assert serve["image"] == worker["image"], "the worker image installs the serve extra"
    assert serve["entrypoint"][:2] == ["qbatch", "serve"]
    assert "deploy" not in serve, "no GPU"
    env = serve["environment"]
    assert env["QBATCH_KAFKA_BOOTSTRAP"] == worker["environment"]["QBATCH_KAFKA_BOOTSTRAP"]
    assert env["QBATCH_REDIS_URL"] == worker["environment"]["QBATCH_REDIS_URL"]
    assert env["QBATCH_BULK_TOPIC"] == worker["environment"]["QBATCH_BULK_TOPIC"]
    (secret,) = serve["secrets"]
    assert env["QBATCH_SERVE_KEYS_FILE"] == f"/run/secrets/{secret}"
    assert "file" in compose["secrets"][secret]
    assert "QBATCH_API_KEYS" not in env
    storage = _interp_default(env["QBATCH_SERVE_STORAGE"])
    volumes = {v.split(":")[1]: v.split(":")[0] for v in serve["volumes"]}
    assert volumes[storage] in compose["volumes"], "the files live in a named volume"
    for name in ("QBATCH_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert name in env and env[name] is None, f"{name}: passed through, never a value here"
    port = int(env["QBATCH_SERVE_PORT"])
    assert env["QBATCH_SERVE_HOST"] == "0.0.0.0"
    (published,) = serve["ports"]
    assert _interp_default(published).endswith(f":{port}")
    assert f"127.0.0.1:{port}/healthz" in " ".join(serve["healthcheck"]["test"])
    dockerfile = DOCKERFILE.read_text(encoding="utf-8")
    assert 'extras["serve"]' in dockerfile, "the image installs the serve extra"
    assert re.search(r"chown -R qbatch:qbatch [^\n]*" + re.escape(storage), dockerfile)
