"""Static checks of the YAML under deploy/ and of the Kubernetes manifests (worker, tool
executor, `qbatch serve`); compose and the Dockerfile are in test_deploy_compose.py, the
dashboard and alerts in test_deploy_observability.py.

Nothing here starts a container or talks to a cluster. The checks are the ones that catch
real drift: a probe on the wrong path or port, a grace period shorter than the drain
timeout, a GPU request that differs from the tensor-parallel size, a KEDA trigger watching
another topic or group than the workers consume, a setting no worker reads.

Where `kubectl` (or `kustomize`) is installed the Kustomize base and overlay are rendered
and checked as rendered.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.unit._deploy_files import (
    ALERTS,
    BASE,
    COMPOSE,
    DASHBOARD,
    DEPLOY,
    DOCKERFILE,
    K8S,
    OVERLAY,
    PROM_CONFIG,
    ROOT,
    SERVE,
    TOOL_EXECUTOR,
    WORKER_JOB,
    component,
    container_named,
    deploy_yaml_files,
    interp_default,
    load_all,
    load_one,
    matches,
    read_env_file,
    render,
    resolve_port,
    worker_container,
    worker_object,
)
from worker.config import WorkerSettings

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


@pytest.mark.parametrize("path", deploy_yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_under_deploy_parses(path: Path) -> None:
    docs = load_all(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: top level is {type(doc).__name__}, not a mapping"


def _k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in deploy_yaml_files() if K8S in p.parents for d in load_all(p)]


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
    k = load_one(directory / "kustomization.yaml")
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
    assert {d["kind"] for d in load_all(BASE / "secret.example.yaml")} == {"Secret"}


# --------------------------------------------------------------------------- worker settings


def _overlay_values() -> dict[str, str]:
    """base/worker.env merged with the overlay's configMapGenerator literals."""
    env = read_env_file(BASE / "worker.env")
    k = load_one(OVERLAY / "kustomization.yaml")
    gens = [g for g in k.get("configMapGenerator", []) if g["name"] == "qbatch-worker-config"]
    assert gens and gens[0].get("behavior") == "merge"
    for literal in gens[0].get("literals", []):
        key, _, value = literal.partition("=")
        env[key] = value
    return env


def _strategic_patch(kind: str) -> dict[str, Any]:
    k = load_one(OVERLAY / "kustomization.yaml")
    for p in k.get("patches", []):
        doc = load_one(OVERLAY / p["path"])
        if doc["kind"] == kind:
            return doc
    raise AssertionError(f"overlay has no {kind} patch")


def test_secrets_stay_out_of_the_config_map() -> None:
    for env in (
        read_env_file(BASE / "worker.env"),
        _overlay_values(),
        read_env_file(BASE / "serve.env"),
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
    compose_env = load_one(COMPOSE)["services"]["worker"]["environment"]
    deployment = load_one(BASE / "deployment.yaml")
    pod_env = {e["name"] for e in worker_container(deployment)["env"]}
    for name in [*_overlay_values(), *compose_env, *pod_env]:
        if name.startswith("QBATCH_"):
            assert name in known, f"{name} is not a setting the worker reads"


def _settings_sets() -> dict[str, dict[str, str]]:
    compose_env = load_one(COMPOSE)["services"]["worker"]["environment"]
    return {
        "k8s base": read_env_file(BASE / "worker.env"),
        "k8s overlay": _overlay_values(),
        "compose": {k: interp_default(str(v)) for k, v in compose_env.items()},
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
    deployment = worker_object(docs, "Deployment")
    pod = deployment["spec"]["template"]
    container = worker_container(deployment)
    metrics_port = int(env["QBATCH_METRICS_PORT"])

    assert matches(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])

    # probes: liveness/startup on /healthz, readiness on /readyz, all on the metrics port
    expected = {
        "livenessProbe": "/healthz",
        "readinessProbe": "/readyz",
        "startupProbe": "/healthz",
    }
    for probe, path in expected.items():
        http = container[probe]["httpGet"]
        assert http["path"] == path, f"{probe} on {http['path']}"
        assert resolve_port(container, http["port"]) == metrics_port, f"{probe} port"

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
    service = worker_object(docs, "Service")
    assert matches(service["spec"]["selector"], pod["metadata"]["labels"])
    svc_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert resolve_port(container, svc_ports["metrics"]["targetPort"]) == metrics_port
    monitor = worker_object(docs, "ServiceMonitor")
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert service["metadata"]["name"] == WORKER_JOB, "job label in alerts/dashboard"
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [
        ("metrics", "/metrics")
    ]
    pdb = worker_object(docs, "PodDisruptionBudget")
    assert matches(pdb["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])

    # KEDA watches what the workers consume and never asks for idle workers
    scaled = worker_object(docs, "ScaledObject")
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
        auth = worker_object(docs, "TriggerAuthentication")
        assert auth["metadata"]["name"] == trigger["authenticationRef"]["name"]


def test_base_manifests_are_consistent() -> None:
    docs = [d for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml" for d in load_all(p)]
    _check_worker_objects(docs, read_env_file(BASE / "worker.env"))


def test_overlay_patches_keep_gpu_grace_and_config_consistent() -> None:
    """Without rendering: the overlay's values against its own patches."""
    env = _overlay_values()
    dep = _strategic_patch("Deployment")
    res = worker_container(dep)["resources"]
    tp = int(env["QBATCH_TENSOR_PARALLEL_SIZE"])
    assert tp > 1, "the example overlay demonstrates tensor parallelism"
    assert int(res["limits"]["nvidia.com/gpu"]) == int(res["requests"]["nvidia.com/gpu"]) == tp
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(env["QBATCH_DRAIN_TIMEOUT_S"]) + 10


@pytest.mark.parametrize("directory", [BASE, OVERLAY], ids=["base", "overlay"])
def test_rendered_kustomization_is_consistent(directory: Path) -> None:
    docs = render(directory)
    config = worker_object(docs, "ConfigMap")
    assert config["metadata"]["name"].startswith("qbatch-worker-config-"), "hashed name"
    container = worker_container(worker_object(docs, "Deployment"))
    assert container["envFrom"][0]["configMapRef"]["name"] == config["metadata"]["name"]
    assert container["image"] != "qbatch-worker", "images: transformer did not pin a tag"
    env = dict(config["data"])
    if directory == OVERLAY:
        assert env == _overlay_values()
        assert {d["metadata"].get("namespace") for d in docs} == {"qbatch"}
    _check_worker_objects(docs, env)


def test_prometheus_rule_matches_alerts_file() -> None:
    rule = load_one(BASE / "prometheusrule.yaml")
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == load_one(ALERTS)["groups"], (
        "deploy/k8s/base/prometheusrule.yaml is out of date: regenerate it from alerts.yaml"
    )


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
    from worker.tool_loop.http import load_http_tools

    docs = [d for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml" for d in load_all(p)]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and component(d) == TOOL_EXECUTOR]
    pod = deployment["spec"]["template"]
    assert matches(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    command = container["command"]
    assert command[:3] == ["qbatch", "tools", "serve"]
    config_path = command[command.index("--config") + 1]
    mount = next(m for m in container["volumeMounts"] if config_path.startswith(m["mountPath"]))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    generators = load_one(BASE / "kustomization.yaml")["configMapGenerator"]
    generated = next(g for g in generators if g["name"] == volume["configMap"]["name"])
    assert Path(config_path).name in generated["files"]
    assert load_http_tools(BASE / Path(config_path).name, env={})  # the shipped file loads
    assert container["envFrom"][0]["configMapRef"]["name"] == "qbatch-worker-config"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env["QBATCH_TOOLS_METRICS_PORT"]) == port
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor" and component(d) == TOOL_EXECUTOR]
    assert matches(monitor["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    scrape = load_one(DEPLOY / "prometheus" / "prometheus.yml")["scrape_configs"]
    targets = [t for job in scrape for c in job["static_configs"] for t in c["targets"]]
    assert f"tools:{port}" in targets, "compose's Prometheus scrapes the executor"
    services = load_one(COMPOSE)["services"]
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
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and component(d) == SERVE]
    pod = deployment["spec"]["template"]
    assert matches(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
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
    settings = read_env_file(BASE / "serve.env")
    (files_volume,) = [n for n, path in mounts.items() if path == settings["QBATCH_SERVE_STORAGE"]]
    claim = volumes[files_volume]["persistentVolumeClaim"]["claimName"]
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim" and component(d) == SERVE]
    assert pvc["metadata"]["name"] == claim and pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "emptyDir" in volumes[next(n for n, p in mounts.items() if p == "/tmp")]
    assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsUser"]
    # readiness (and liveness) on /healthz at the port the server listens on
    port = int(settings["QBATCH_SERVE_PORT"])
    for probe in ("readinessProbe", "livenessProbe"):
        http = container[probe]["httpGet"]
        assert http["path"] == "/healthz" and resolve_port(container, http["port"]) == port
    assert settings["QBATCH_SERVE_HOST"] == "0.0.0.0"
    (service,) = [d for d in docs if d["kind"] == "Service" and component(d) == SERVE]
    assert matches(service["spec"]["selector"], pod["metadata"]["labels"])
    (svc_port,) = service["spec"]["ports"]
    assert resolve_port(container, svc_port["targetPort"]) == port
    # Prometheus Operator scrapes /metrics on that port, job="qbatch-serve" as in compose
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor" and component(d) == SERVE]
    assert matches(monitor["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and resolve_port(container, endpoint["port"]) == port
    assert pod["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "qbatch-serve"


def test_serve_is_deployed_with_keys_storage_and_probes() -> None:
    docs = [d for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml" for d in load_all(p)]
    _check_serve_objects(docs)
    # its settings are `qbatch serve` options (or boto3's own AWS_* variables)
    settings = read_env_file(BASE / "serve.env")
    known = _serve_envvars()
    assert {"QBATCH_SERVE_STORAGE", "QBATCH_S3_ENDPOINT_URL"} <= known
    for name in settings:
        assert name in known or name.startswith("AWS_"), f"serve.env: {name} is no serve option"
    generators = load_one(BASE / "kustomization.yaml")["configMapGenerator"]
    (gen,) = [g for g in generators if g["name"] == "qbatch-serve-config"]
    assert (
        gen["envs"] == ["serve.env"]
        and gen["options"]["labels"]["app.kubernetes.io/component"] == SERVE
    )
    # the example Secrets show the keys the Deployment reads
    secrets = {d["metadata"]["name"]: d for d in load_all(BASE / "secret.example.yaml")}
    assert "keys.yaml" in secrets["qbatch-serve-keys"]["stringData"]
    assert {"aws-access-key-id", "aws-secret-access-key"} <= set(
        secrets["qbatch-serve-secrets"]["stringData"]
    )


@pytest.mark.parametrize("directory", [BASE, OVERLAY], ids=["base", "overlay"])
def test_rendered_serve_objects(directory: Path) -> None:
    docs = render(directory)
    _check_serve_objects(docs)
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and component(d) == SERVE]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and component(d) == SERVE]
    refs = [e["configMapRef"]["name"] for e in container_named(deployment, "serve")["envFrom"]]
    assert config["metadata"]["name"] in refs, "hashed name reaches the Deployment"
