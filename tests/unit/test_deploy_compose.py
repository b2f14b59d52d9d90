"""Static checks of deploy/docker: the compose file (its keys, Kafka and topic init, the GPU
worker, Grafana, `qbatch serve`) and the Dockerfile; `docker compose config` runs where a
compose plugin exists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib

import pytest

from tests.unit._deploy_files import (
    COMPOSE,
    DASHBOARD,
    DOCKER,
    DOCKERFILE,
    ROOT,
    duration_s,
    interp_default,
    load_one,
)

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
    compose = load_one(COMPOSE)
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
        image = interp_default(svc.get("image", ""))
        if image and "build" not in svc:
            tag = image.rsplit(":", 1)[-1] if ":" in image.split("/")[-1] else ""
            assert tag and tag != "latest" and re.search(r"\d", tag), f"{name}: unpinned {image}"
        for port in svc.get("ports", []):
            assert interp_default(port).startswith("127.0.0.1:"), f"{name}: {port} not loopback"


def test_compose_kafka_and_topic_init() -> None:
    services = load_one(COMPOSE)["services"]
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
    assert interp_default(init["environment"]["QBATCH_BULK_TOPIC"]) == "qbatch.requests.bulk"
    assert interp_default(init["environment"]["QBATCH_TOPIC"]) == "qbatch.requests"
    assert interp_default(init["environment"]["QBATCH_DLQ_TOPIC"]) == "qbatch.requests.dlq"
    assert int(interp_default(init["environment"]["QBATCH_PARTITIONS"])) >= 2


def test_compose_gpu_worker() -> None:
    services = load_one(COMPOSE)["services"]
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
    assert int(interp_default(device["count"])) >= 1
    assert env["QBATCH_ENGINE"] == "vllm"
    assert env["QBATCH_KAFKA_BOOTSTRAP"] == "kafka:9092"
    assert env["QBATCH_REDIS_URL"].startswith("redis://redis:6379/")
    drain = float(interp_default(env["QBATCH_DRAIN_TIMEOUT_S"]))
    assert duration_s(worker["stop_grace_period"]) > drain + 10
    assert worker["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "shm_size" in worker or worker.get("ipc") == "host"


def test_compose_grafana_is_provisioned() -> None:
    grafana = load_one(COMPOSE)["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    prov = (DOCKER / mounts["/etc/grafana/provisioning"]).resolve()
    (ds,) = load_one(prov / "datasources" / "prometheus.yaml")["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    (provider,) = load_one(prov / "dashboards" / "qbatch.yaml")["providers"]
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


def test_compose_serve() -> None:
    """compose: `qbatch serve` on the worker image, keys from a mounted secret, storage a
    volume (or S3 from the environment), health on /healthz, loopback port."""
    compose = load_one(COMPOSE)
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
    storage = interp_default(env["QBATCH_SERVE_STORAGE"])
    volumes = {v.split(":")[1]: v.split(":")[0] for v in serve["volumes"]}
    assert volumes[storage] in compose["volumes"], "the files live in a named volume"
    for name in ("QBATCH_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert name in env and env[name] is None, f"{name}: passed through, never a value here"
    port = int(env["QBATCH_SERVE_PORT"])
    assert env["QBATCH_SERVE_HOST"] == "0.0.0.0"
    (published,) = serve["ports"]
    assert interp_default(published).endswith(f":{port}")
    assert f"127.0.0.1:{port}/healthz" in " ".join(serve["healthcheck"]["test"])
    dockerfile = DOCKERFILE.read_text(encoding="utf-8")
    assert 'extras["serve"]' in dockerfile, "the image installs the serve extra"
    assert re.search(r"chown -R qbatch:qbatch [^\n]*" + re.escape(storage), dockerfile)
