"""Embeddings on vLLM's pooling runner: records on Kafka -> a `--task embed` worker
(Qwen3-0.6B shape, dummy weights, its config marked Matryoshka-trained) -> vectors in
Redis. Run on the GPU machine with the stack up (deploy/gpu/README.md):
    python3 -m pytest tests/gpu -q
The weights are random: these tests check shapes, norms, determinism and the plumbing."""

from __future__ import annotations

import base64
import json
import math
import struct
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.harness import create_topics, start_pipeline

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "qwen3-14b"


def _model_dir() -> Path:
    """The 0.6B config beside the real tokenizer, marked Matryoshka-trained."""
    target = Path(tempfile.mkdtemp(prefix="qbatch-gpu-embed-"))
    for item in FIXTURE.iterdir():
        if item.is_file() and not item.name.startswith("config"):
            (target / item.name).write_bytes(item.read_bytes())
    config = json.loads((FIXTURE / "config-0.6b.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return target


@pytest.fixture(scope="module")
def embed_pipeline() -> Iterator[dict[str, Any]]:
    from worker.config import WorkerSettings
    from worker.engines.vllm_embed import VllmEmbedder

    run = f"gpuemb-{uuid.uuid4().hex[:6]}"
    settings = WorkerSettings(
        engine="vllm",
        task="embed",
        model=str(_model_dir()),
        served_model_name="Qwen3-0.6B-embed",
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        topic=f"{run}.requests",
        bulk_topic=f"{run}.requests.bulk",
        dlq_topic=f"{run}.dlq",
        group=f"{run}-w",
        prefix=run,
        metrics_port=0,
    )
    create_topics(
        settings, [(settings.topic, 2), (settings.bulk_topic, 2), (settings.dlq_topic, 1)]
    )
    engine = VllmEmbedder.from_settings(settings)
    engine.start()
    pipe = start_pipeline(settings, engine)

    def send(rid: str, body: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return pipe.send({"request_id": rid, "endpoint": "/v1/embeddings", "body": body, **extra})

    yield {"send": send, "engine": engine}
    pipe.stop()


def _floats(value: Any) -> list[float]:
    if isinstance(value, list):
        return value
    raw = base64.b64decode(value)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def _norm(vector: list[float]) -> float:
    return math.sqrt(math.fsum(x * x for x in vector))


def test_vectors_of_the_models_size_normalised_and_deterministic(
    embed_pipeline: dict[str, Any],
) -> None:
    engine = embed_pipeline["engine"]
    size = engine.embedding_shape.size
    assert size == 1024  # the 0.6B config's hidden size
    res = embed_pipeline["send"]("e1", {"input": ["same text", "other text", "same text"]})
    assert res["status"] == "succeeded", res
    data = res["response"]["data"]
    vectors = [_floats(item["embedding"]) for item in data]
    assert [item["index"] for item in data] == [0, 1, 2]
    assert all(len(v) == size for v in vectors)
    assert all(abs(_norm(v) - 1) < 1e-2 for v in vectors)  # bf16 model, float32 vectors
    assert max(abs(a - b) for a, b in zip(vectors[0], vectors[2], strict=True)) < 1e-2
    assert res["response"]["usage"]["prompt_tokens"] > 0


def test_dimensions_and_base64_on_vllm(embed_pipeline: dict[str, Any]) -> None:
    res = embed_pipeline["send"](
        "e2", {"input": [[11, 12, 13], [14, 15]], "dimensions": 64, "encoding_format": "base64"}
    )
    assert res["status"] == "succeeded", res
    for item in res["response"]["data"]:
        assert isinstance(item["embedding"], str)
        vector = _floats(item["embedding"])
        assert len(vector) == 64 and abs(_norm(vector) - 1) < 1e-2
    assert res["response"]["usage"]["prompt_tokens"] == 5


def test_refusals_name_the_field_before_the_gpu(embed_pipeline: dict[str, Any]) -> None:
    res = embed_pipeline["send"]("e3", {"input": "x", "dimensions": 4096})
    assert res["status"] == "failed" and res["error"]["param"] == "body.dimensions", res
    bad = embed_pipeline["send"]("e4", {"input": " ".join(["w"] * 3000)})  # over 2,048
    assert bad["status"] == "failed" and bad["error"]["code"] == "context_length_exceeded", bad
