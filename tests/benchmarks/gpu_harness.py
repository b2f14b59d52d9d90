"""What every GPU benchmark phase shares: the engines (vLLM with dummy weights, or the echo
engine for a dry run on the CPU), the local stack (Kafka topics, workers sharing a loaded
engine, Redis), the GPU machine (its name, its free memory, child phases that must give
it back) and the JSON the phases leave behind.

gpu_runs, bench_gpu, bench_gpu_latency, bench_knobs, bench_gpu_prefix,
bench_gpu_summarize, bench_runbatch and bench_kafka_hop build on these; nothing here
measures anything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[2]
FIXTURE_DIR = REPO / "tests" / "fixtures" / "qwen3-14b"
MODEL_CONFIGS = {"14b": "config.json", "0.6b": "config-0.6b.json"}
"""The model shapes a benchmark can load (dummy weights): `--model`, or QBATCH_BENCH_MODEL
in the child processes a phase starts."""


def model_dir(name: str) -> Path:
    """The fixture directory for 14B; for another shape, a copy of its tokenizer with that
    config as `config.json` (under the temp dir, rebuilt each time)."""
    if name not in MODEL_CONFIGS:
        raise SystemExit(f"unknown model {name!r}: one of {', '.join(MODEL_CONFIGS)}")
    if MODEL_CONFIGS[name] == "config.json":
        return FIXTURE_DIR
    target = Path(tempfile.gettempdir()) / f"qbatch-bench-qwen3-{name}"
    target.mkdir(parents=True, exist_ok=True)
    for item in FIXTURE_DIR.iterdir():
        if item.is_file() and not item.name.startswith("config"):
            (target / item.name).write_bytes(item.read_bytes())
    (target / "config.json").write_bytes((FIXTURE_DIR / MODEL_CONFIGS[name]).read_bytes())
    return target


MODEL = os.environ.get("QBATCH_BENCH_MODEL", "14b")
MODEL_DIR = model_dir(MODEL)


def select_model(name: str) -> None:
    """Load `name` from now on, here and in the child phases this process starts."""
    global MODEL, MODEL_DIR
    os.environ["QBATCH_BENCH_MODEL"] = name
    MODEL, MODEL_DIR = name, model_dir(name)


DRY_DELAY_MS = 20.0  # the echo engine's answer time in dry runs


# ---------------------------------------------------------------------------- engines


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    from worker.config import WorkerSettings
    from worker.engines.vllm_engine import engine_kwargs as from_settings

    fields: dict[str, Any] = {
        "engine": "vllm",
        "model": str(MODEL_DIR),
        "served_model_name": served_name(),
        "load_format": "dummy",
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.9,
    }
    fields.update(overrides)
    return from_settings(WorkerSettings(**fields))


def served_name() -> str:
    return "Qwen3-14B" if MODEL == "14b" else f"Qwen3-{MODEL.upper()}"


def make_engine(mode: str, dry: bool, **overrides: Any) -> Any:
    if dry:
        from worker.engines.echo import EchoEngine

        return EchoEngine(
            served_name=served_name(),
            max_model_len=int(overrides.get("max_model_len", 4096)),
            delay_ms=DRY_DELAY_MS,
        )
    from worker.engines.vllm_engine import VllmEngine

    return VllmEngine(engine_kwargs(**overrides), mode=mode)


def kv_cache_tokens(engine: Any) -> int | None:
    """The engine's KV cache capacity in tokens (`EngineStats.kv_cache_tokens`, which the
    worker exports as `qbatch_engine_kv_cache_capacity_tokens`); None from a checkout
    whose engines do not report it (an A/B run against an older tree)."""
    return getattr(engine.stats(), "kv_cache_tokens", None)


def reset_prefix_cache(engine: Any) -> None:
    """Forget the KV blocks earlier runs left behind, so that no run is served from the
    prefix cache of another. (The previous session's wait sweep ran the same prompts
    three times and credited the cache hits of the 2nd and 3rd runs to their settings;
    its B16 ran the prompts B64 had just run.)"""
    llm = getattr(engine, "_llm", None)
    if llm is None:
        return
    loop = getattr(engine, "_loop", None)
    if loop is not None:  # AsyncLLM: a coroutine, on the engine's loop
        import asyncio

        asyncio.run_coroutine_threadsafe(llm.reset_prefix_cache(), loop).result(60)
    else:
        llm.reset_prefix_cache()


class KeepOpen:
    """Lets one loaded engine serve several worker runs (the worker closes its engine)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def close(self) -> None:
        return


# ---------------------------------------------------------------------------- the stack


def bootstrap() -> str:
    return os.environ.get("QBATCH_KAFKA_BOOTSTRAP", "127.0.0.1:9092")


def redis_url() -> str:
    return os.environ.get("QBATCH_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_client() -> Any:
    """A client for QBATCH_REDIS_URL: one Redis, or a Redis Cluster (redis+cluster://)."""
    from schemas.redis_conn import connect

    return connect(redis_url())


def keys_for(prefix: str) -> Any:
    """The contract's key names under `prefix` (hash-tagged on a Redis Cluster)."""
    from schemas import RedisKeys
    from schemas.redis_conn import is_cluster_url

    return RedisKeys(prefix, cluster=is_cluster_url(redis_url()))


def mget_all(client: Any, keys: list[str]) -> list[Any]:
    from schemas.redis_conn import mget

    return mget(client, keys)


def create_topic(topic: str) -> None:
    """A run's requests topic and its bulk lane's (the worker subscribes to both)."""
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap().split(","))
    # Replicated where there are brokers to replicate to (a cluster's min.insync.replicas=2
    # refuses acks=all writes to a topic of one replica).
    replication = min(3, len(admin.describe_cluster()["brokers"]))
    admin.create_topics(
        [NewTopic(topic, 8, replication), NewTopic(f"{topic}.bulk", 8, replication)]
    )
    admin.close()


def start_worker(engine: Any, run: str, **worker_settings: Any) -> tuple[Any, threading.Thread]:
    """A worker on topic `bench.<run>`, key prefix `<run>`, sharing the loaded engine."""
    from worker.config import WorkerSettings
    from worker.service import build_worker

    topic = f"bench.{run}"
    settings = WorkerSettings(
        engine="vllm",
        model=str(MODEL_DIR),
        topic=topic,
        bulk_topic=f"{topic}.bulk",
        dlq_topic=f"{topic}.dlq",
        group=f"{run}-workers",
        prefix=run,
        metrics_port=0,
        dead_letter=False,
        log_level="warning",
        **worker_settings,
    )
    worker = build_worker(settings, KeepOpen(engine))  # type: ignore[arg-type]
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


def cli_env(run: str) -> dict[str, str]:
    """The environment of a `qbatch` CLI subprocess aimed at the workers of topic
    `bench.<run>` (bulk lane `bench.<run>.bulk`, key prefix `<run>`), this repo first."""
    env = dict(os.environ)
    env.update(
        QBATCH_TOPIC=f"bench.{run}",
        QBATCH_BULK_TOPIC=f"bench.{run}.bulk",
        QBATCH_PREFIX=run,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    return env


# ---------------------------------------------------------------------------- the GPU machine


KV_LINE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def nvidia_smi(field: str) -> list[str]:
    """One value per GPU of `nvidia-smi --query-gpu=FIELD`; empty where there is none."""
    try:
        text = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


def gpu_memory_used_mib() -> int | None:
    values = nvidia_smi("memory.used")
    try:
        return sum(int(x) for x in values) if values else None
    except ValueError:
        return None


def wait_for_free_gpu(timeout_s: float = 60) -> None:
    """The driver frees a dead process's memory within seconds; the next engine sizes its
    KV cache from what is free, so it must not start before that."""
    until = time.time() + timeout_s
    while time.time() < until:
        used = gpu_memory_used_mib()
        if used is None or used < 4096:
            return
        time.sleep(1)


def add_phase_args(parser: argparse.ArgumentParser, out_help: str, work_help: str) -> None:
    """The options of every benchmark run in phases (each phase its own device call, the
    report made anywhere from their JSON): where the results go, where the megabytes of
    input go, the engine's context and the card a report names when made off the GPU."""
    parser.add_argument("--out", type=Path, required=True, help=out_help)
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "qbatch-bench-work",
        help=work_help,
    )
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-name", help="report: the device the phases ran on (off the GPU)")


def gpu_name() -> str:
    names = nvidia_smi("name")
    return f"{len(names)}x {names[0]}" if names else "no GPU"


def run_child(args: list[str], log: Any, deadline: float) -> tuple[int | None, list[str]]:
    """bench_gpu's CLI with `args` (a phase: the knob and full phases run each engine
    this way) in a child process group; its output into `log` and our stdout.

    Killed (the engine-core processes with it) at `deadline`; returns its exit status
    (None when killed) and the lines it printed.
    """
    wait_for_free_gpu()
    cmd = [sys.executable, "-m", "tests.benchmarks.bench_gpu", *args]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            log.write(line)
            log.flush()
            sys.stdout.write(line)
            sys.stdout.flush()

    pumper = threading.Thread(target=pump, daemon=True)
    pumper.start()
    try:
        rc: int | None = proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        rc = None
        print(f"bench_gpu: {' '.join(args)} ran out of time: killed", flush=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    pumper.join(timeout=10)
    wait_for_free_gpu()  # for whatever runs next, in this process or after it
    return rc, lines


def exit_now() -> NoReturn:
    """End a phase whose results are on disk. vLLM's engine teardown at interpreter exit
    can hang for minutes (seen with the LLM class): do not spend device time waiting for
    it, but do not leave the engine-core process holding the GPU for the next phase."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join(10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------- figures


def percentiles(values: list[float], digits: int = 3) -> dict[str, float]:
    if not values:
        return {}
    if len(values) == 1:
        v = round(values[0], digits)
        return {"p50": v, "p90": v, "p99": v}
    qs = statistics.quantiles(values, n=100, method="inclusive")
    return {k: round(qs[i], digits) for k, i in (("p50", 49), ("p90", 89), ("p99", 98))}


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
