"""The main job on a local default: stack up, a CPU worker on a small Qwen3, sample requests.

    bash deploy/local/demo.sh          # what the README's first command runs

1. brings up the local Kafka + Redis (deploy/local/stack.sh up);
2. picks a model: `QBATCH_DEMO_MODEL` if set, else Qwen/Qwen3-0.6B from the Hugging Face
   hub when it is reachable, else a TINY RANDOM-WEIGHT model built from the real Qwen3
   tokenizer and config (its answers are noise; it shows the plumbing, not a model);
3. starts `qbatch-worker --engine transformers` and waits until it is ready;
4. sends a plain chat, a tool-call request, a completion, and a deliberately broken
   record (as a buggy producer would), and prints each result as it comes back;
5. stops the worker with SIGTERM (it drains) and leaves the stack running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("QBATCH_STACK_DIR", REPO / "deploy" / "local" / ".cache"))
HUB_MODEL = "Qwen/Qwen3-0.6B"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def stack_up() -> dict[str, str]:
    out = subprocess.run(
        ["bash", str(REPO / "deploy" / "local" / "stack.sh"), "up"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    env = {}
    for line in out.stdout.splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export ") :].partition("=")
            env[key] = value.strip("'\"")
    return env


def pick_model() -> tuple[str, str]:
    """(path or hub id, how it was chosen)."""
    if os.environ.get("QBATCH_DEMO_MODEL"):
        return os.environ["QBATCH_DEMO_MODEL"], "from QBATCH_DEMO_MODEL"
    if os.environ.get("QBATCH_DEMO_OFFLINE") != "1":
        try:
            os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
            os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "30")
            from huggingface_hub import snapshot_download

            path = snapshot_download(HUB_MODEL, allow_patterns=["*.json", "*.safetensors", "*.txt"])
            return path, f"{HUB_MODEL} from the Hugging Face hub"
        except Exception as exc:  # offline, blocked, rate limited: fall back, say so
            print(f"   hub not reachable ({type(exc).__name__}); using a tiny random model")
    sys.path.insert(0, str(REPO))  # the tiny model builder is test code (tests/tiny_model.py)
    from tests.tiny_model import build_tiny_qwen3

    path = build_tiny_qwen3(CACHE / "models" / "tiny-qwen3")
    return str(path), "TINY RANDOM-WEIGHT Qwen3 (real tokenizer and chat template; text is noise)"


def wait_ready(port: int, worker: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise SystemExit(f"worker exited with {worker.returncode}; see its log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("worker not ready in time")


def show(result: Any) -> None:
    if result is None:
        print("   (no result in time)")
        return
    data = json.loads(result.model_dump_json(exclude_none=True))
    brief: dict[str, Any] = {"request_id": data["request_id"], "status": data["status"]}
    if data.get("error"):
        brief["error"] = data["error"]
    if data.get("response"):
        choice = data["response"]["choices"][0]
        brief["finish_reason"] = choice.get("finish_reason")
        brief["output"] = choice.get("message") or {"text": choice.get("text")}
        brief["usage"] = data["response"]["usage"]
    if data.get("tool_call_errors"):
        brief["tool_call_errors"] = data["tool_call_errors"]
    brief["timings_ms"] = {k: v for k, v in data["timings"].items() if k.endswith("_ms")}
    print(json.dumps(brief, indent=2, ensure_ascii=False)[:3000])


def main() -> int:
    say("starting the local stack (Kafka in KRaft mode + Redis)")
    env = stack_up()
    os.environ.update(env)
    print("   " + "  ".join(f"{k}={v}" for k, v in env.items()))
    say("choosing a model")
    model, how = pick_model()
    print(f"   {how}: {model}")
    port = int(os.environ.get("QBATCH_DEMO_METRICS_PORT", "9400"))
    log_path = CACHE / "run" / "demo-worker.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    say(f"starting qbatch-worker (transformers engine, CPU); log: {log_path}")
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker", "--engine", "transformers", "--model", model,
         "--metrics-port", str(port), "--default-max-tokens", "48", "--log-format", "json"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=log_path.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_ready(port, worker)
        print(f"   ready: http://127.0.0.1:{port}/readyz  metrics: http://127.0.0.1:{port}/metrics")
        run_samples()
    finally:
        say("stopping the worker (SIGTERM: it drains, writes, commits)")
        worker.send_signal(signal.SIGTERM)
        try:
            print(f"   worker exit status {worker.wait(120)}")
        except subprocess.TimeoutExpired:
            worker.kill()
    print("\nThe stack is still up: `deploy/local/stack.sh down` stops it.")
    return 0


def run_samples() -> None:
    from kafka import KafkaProducer

    from producer.client import QBatchClient
    from schemas import ConnectionSettings

    stamp = time.strftime("%H%M%S")
    with QBatchClient() as client:
        say("a plain chat request")
        rid = client.submit(
            {"messages": [{"role": "user", "content": "Say hello in French."}],
             "max_tokens": 32, "chat_template_kwargs": {"enable_thinking": False}},
            request_id=f"demo-chat-{stamp}", metadata={"demo": True},
        )  # fmt: skip
        show(client.wait(rid, timeout=300))

        say("a tool-call request (the tools are rendered into the prompt by the chat template)")
        rid = client.submit(
            {"messages": [{"role": "user", "content": "What's the weather in Oslo?"}],
             "tools": TOOLS, "max_tokens": 48},
            request_id=f"demo-tools-{stamp}",
        )  # fmt: skip
        show(client.wait(rid, timeout=300))

        say("a /v1/completions request")
        rid = client.submit(
            {"prompt": "The capital of Norway is", "max_tokens": 8},
            request_id=f"demo-completion-{stamp}",
        )
        show(client.wait(rid, timeout=300))

        say("a broken record, as a buggy producer would send it (max_tokens: -5)")
        bad_id = f"demo-bad-{stamp}"
        settings = ConnectionSettings()
        raw = KafkaProducer(**settings.kafka_kwargs())
        raw.send(
            settings.topic,
            key=bad_id.encode(),
            value=json.dumps(
                {
                    "request_id": bad_id,
                    "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5},
                }
            ).encode(),
        )
        raw.flush()
        raw.close()
        show(client.wait(bad_id, timeout=60))
        print(f"   (the raw record also went to the dead-letter topic {settings.dlq_topic})")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
