"""What the deploy/ checks share: the files' paths, YAML loading, kustomize rendering and
the worker object lookups (the tests are in test_deploy_manifests.py, test_deploy_compose.py
and test_deploy_observability.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tests.ci_gate import tool_missing
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


def deploy_yaml_files() -> list[Path]:
    """Every YAML file under deploy/, hidden folders pruned before they are walked: the
    local stack keeps its Kafka data in deploy/local/.cache, where topics are deleted
    while a test run walks (an rglob there raced a deletion in a run)."""
    files = []
    for folder, dirs, names in os.walk(DEPLOY):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [
            Path(folder) / n
            for n in names
            if n.endswith((".yaml", ".yml")) and not n.startswith(".")
        ]
    return sorted(files)


def load_all(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def load_one(path: Path) -> Any:
    docs = load_all(path)
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


def read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {raw!r}"
        env[key.strip()] = value.strip()
    return env


def duration_s(value: str) -> float:
    """Go/Compose durations like '90s', '1m30s', '2m'."""
    total = 0.0
    matched = ""
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value):
        total += float(num) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
        matched += num + unit
    assert matched == value, f"not a duration: {value!r}"
    return total


_INTERP = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interp_default(value: str) -> str:
    """Resolve compose `${VAR:-default}` to its default (as with an empty environment)."""
    return _INTERP.sub(lambda m: m.group(2) or "", value)


def walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def _kustomize_cmd() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@cache
def render(directory: Path) -> tuple[dict[str, Any], ...]:
    cmd = _kustomize_cmd()
    if cmd is None:
        tool_missing("neither kustomize nor kubectl is installed")
    out = subprocess.run(
        [*cmd, str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, f"kustomize failed for {directory}:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


TOOL_EXECUTOR = "tool-executor"
SERVE = "serve"


def component(doc: dict[str, Any]) -> str | None:
    labels: dict[str, str] = doc.get("metadata", {}).get("labels") or {}
    return labels.get("app.kubernetes.io/component")


def worker_object(
    docs: tuple[dict[str, Any], ...] | list[dict[str, Any]], kind: str
) -> dict[str, Any]:
    """The one worker object of `kind` (the tool executor's and the server's objects are
    checked apart)."""
    found = [d for d in docs if d["kind"] == kind and component(d) not in {TOOL_EXECUTOR, SERVE}]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def worker_container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    workers = [c for c in containers if c["name"] == "worker"]
    assert len(workers) == 1
    return workers[0]


def resolve_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert named, f"probe port {port!r} is not a named container port"
    return int(named[0])


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container_named(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name
    ]
    return found
