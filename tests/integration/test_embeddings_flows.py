"""`/v1/embeddings` end to end on real Kafka and Redis: the client, `qbatch bulk` and
`qbatch serve` (the unmodified `openai` SDK) in front of embed workers (`--task embed`):
the echo engine for plumbing and kill -9, the transformers engine on a tiny random Qwen3
for real vectors."""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.client import EmbeddingFailed
from schemas import ContractError, Status
from schemas.errors import ErrorCode
from tests.integration.workers import (
    Lane,
    echo_worker,
    qbatch,
    start_worker,
    stop_worker,
    wait_for,
)
from tests.serve_fixtures import jsonl, read_file, serving, wait_batch

pytestmark = pytest.mark.integration

EMBED = ("--task", "embed")


@pytest.fixture
def lane(stack: object) -> Iterator[Lane]:
    with Lane.private("qbemb", partitions=2) as lane:
        yield lane


def norm(vector: list[float]) -> float:
    return math.sqrt(math.fsum(x * x for x in vector))


def floats(value: Any) -> list[float]:
    if isinstance(value, list):
        return value
    raw = base64.b64decode(value)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def test_client_embed_through_an_echo_pool(lane: Lane, tmp_path: Path) -> None:
    with (
        echo_worker(
            lane, *EMBED, "--echo-embed-size", "32", "--max-model-len", "50", log=tmp_path / "w.log"
        ),
        lane.client() as qb,
    ):
        vectors = qb.embed(["the same words", "other words", "the same words"])
        assert [len(v) for v in vectors] == [32, 32, 32]
        assert all(abs(norm(v) - 1) < 1e-5 for v in vectors)
        assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
        short = qb.embed("the same words", dimensions=8)
        assert len(short) == 1 and len(short[0]) == 8 and abs(norm(short[0]) - 1) < 1e-5
        assert qb.embed([[1, 2, 3]])[0] == qb.embed([1, 2, 3])[0]  # ids: one input either way

        # refused at the client, naming the field, before anything is published
        for body, param in (
            ({"input": ""}, "body.input"),
            ({"input": []}, "body.input"),
            ({"input": "x", "encoding_format": "int8"}, "body.encoding_format"),
            ({"input": "x", "dimensions": 0}, "body.dimensions"),
            ({"input": "x", "temperature": 0.5}, "body.temperature"),
        ):
            with pytest.raises(ContractError) as err:
                qb.submit(body, endpoint="/v1/embeddings")
            assert (err.value.param or "").startswith(param), (body, err.value.param)

        # refused by the worker, which knows the model: each a failed result naming it
        with pytest.raises(EmbeddingFailed) as failed:
            qb.embed("x", dimensions=33)
        error = failed.value.result.error
        assert error is not None and error.param == "body.dimensions"
        long_input = " ".join(f"w{i}" for i in range(80))
        with pytest.raises(EmbeddingFailed) as failed:
            qb.embed(["fits", long_input])
        error = failed.value.result.error
        assert error is not None and error.code is ErrorCode.context_length_exceeded
        assert error.param == "body.input[1]"
        # ... unless the request's context policy cuts it, reported per input
        rid = qb.submit(
            {"input": ["fits", long_input]},
            endpoint="/v1/embeddings",
            context={"strategy": "truncate_head"},
        )
        result = qb.wait(rid, timeout=30)
        assert result is not None and result.status is Status.succeeded
        assert result.context is not None
        [cut] = result.context.truncated
        assert (cut.input, cut.tokens_removed) == (1, 30)
        assert result.response is not None and result.response.usage.prompt_tokens == 51
        # the CLI: the body's `input` names the endpoint
        done = qbatch(
            lane, "submit", "--body", '{"input": ["a b", "c"]}', "--wait", "--timeout", "30"
        )
        assert done.returncode == 0, done.stderr
        printed = json.loads(done.stdout)
        assert printed["status"] == "succeeded" and len(printed["response"]["data"]) == 2
        # a chat request is not for this pool: answered, naming the endpoint
        rid = qb.submit({"messages": [{"role": "user", "content": "hi"}]})
        result = qb.wait(rid, timeout=30)
        assert result is not None and result.status is Status.failed
        assert result.error is not None and result.error.param == "endpoint"


def test_bulk_embeddings_on_the_cpu_engine(lane: Lane, tmp_path: Path) -> None:
    """A nightly job in small: OpenAI Batch lines through the transformers engine on a
    tiny random Qwen3, whose config says it is Matryoshka-trained (so dimensions work)."""
    from tests.tiny_model import build_tiny_qwen3

    tiny_qwen3_dir = build_tiny_qwen3(tmp_path / "tiny")
    model = tmp_path / "tiny-embed"
    model.mkdir()
    for item in tiny_qwen3_dir.iterdir():
        if item.is_file():
            (model / item.name).symlink_to(item)
    config = json.loads((tiny_qwen3_dir / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))

    texts = ["a line about search", "a line about dedupe", "a line about search"]
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": text}}
        for i, text in enumerate(texts)
    ]
    lines.append(
        {
            "custom_id": "many",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"input": texts[:2], "dimensions": 16, "encoding_format": "float"},
        }
    )
    lines.append(
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"input": "x", "dimensions": -1},
        }
    )
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    log = tmp_path / "worker.log"
    proc = start_worker(lane, "--engine", "transformers", "--model", str(model), *EMBED, log=log)
    try:
        errors = tmp_path / "errors.jsonl"
        done = qbatch(
            lane,
            "bulk",
            "run",
            str(src),
            "--out",
            str(out),
            "--errors",
            str(errors),
            "--timeout",
            "240",
            timeout=300,
        )
    finally:
        stop_worker(proc)
    assert done.returncode != 0, "a bad line makes the job's exit status say so"
    rows = {row["custom_id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"c0", "c1", "c2", "many"}, done.stderr
    vectors = {}
    for cid in ("c0", "c1", "c2"):
        body = rows[cid]["response"]["body"]
        [item] = body["data"]
        assert isinstance(item["embedding"], str), "bulk defaults to base64"
        vectors[cid] = floats(item["embedding"])
        assert len(vectors[cid]) == 64 and abs(norm(vectors[cid]) - 1) < 1e-4
        assert body["usage"]["prompt_tokens"] > 0
    assert max(abs(a - b) for a, b in zip(vectors["c0"], vectors["c2"], strict=True)) < 1e-5
    assert vectors["c0"] != vectors["c1"]
    many = rows["many"]["response"]["body"]["data"]
    assert [item["index"] for item in many] == [0, 1]
    assert all(
        isinstance(item["embedding"], list) and len(item["embedding"]) == 16 for item in many
    )
    assert abs(norm(many[0]["embedding"]) - 1) < 1e-4
    [bad] = [json.loads(line) for line in errors.read_text().splitlines()]
    assert bad["custom_id"] == "bad" and "body.dimensions" in json.dumps(bad["error"])


def test_kill_9_mid_embedding_job_loses_and_repeats_nothing(lane: Lane, tmp_path: Path) -> None:
    n = 300
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"c{i}",
                    "method": "POST",
                    "url": "/v1/embeddings",
                    "body": {"input": [f"doc {i} part a", f"doc {i} part b"]},
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    log = tmp_path / "w.log"
    slow = (
        *EMBED,
        "--echo-delay-ms",
        "20",
        "--echo-concurrency",
        "8",
        "--batch-max-size",
        "8",
        # the killed worker's partitions move in 6 s (the broker's least), not 45
        "--session-timeout-ms",
        "6000",
    )
    first = start_worker(lane, *slow, log=log)
    submit = qbatch(lane, "bulk", "submit", str(src), "--job", "emb-job")
    assert submit.returncode == 0, submit.stderr
    with lane.client() as qb:
        keys = qb.keys

        def answered() -> int:
            return sum(1 for _ in qb.redis.scan_iter(match=keys.result("emb-job*"), count=1000))

        wait_for("a third of the job", lambda: answered() >= n // 3, 60)
        first.kill()  # kill -9 mid-job
        first.wait(timeout=10)
        second = start_worker(lane, *slow, log=log)
        try:
            out = tmp_path / "out.jsonl"
            done = qbatch(lane, "bulk", "collect", "emb-job", "--out", str(out), "--timeout", "120")
        finally:
            stop_worker(second)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [row["custom_id"] for row in rows]
    assert sorted(ids) == sorted(f"c{i}" for i in range(n)) and len(set(ids)) == n
    for row in rows:
        data = row["response"]["body"]["data"]
        assert [item["index"] for item in data] == [0, 1]


def test_openai_sdk_embeddings_and_an_embeddings_batch(tmp_path: Path) -> None:
    with serving(tmp_path, *EMBED, "--echo-embed-size", "24", name="qbsemb") as server:
        client = server.client()
        made = client.embeddings.create(model="echo", input=["alpha", "beta", "alpha"])
        assert made.object == "list" and [d.index for d in made.data] == [0, 1, 2]
        assert all(len(d.embedding) == 24 for d in made.data)
        assert made.data[0].embedding == made.data[2].embedding
        assert made.usage.prompt_tokens == 3 and made.usage.total_tokens == 3
        small = client.embeddings.create(model="echo", input="alpha", dimensions=6)
        assert len(small.data[0].embedding) == 6
        # base64 as the SDK asks it by default, decoded by the SDK: the same floats
        raw = client.embeddings.create(model="echo", input="alpha", encoding_format="float")
        assert raw.data[0].embedding == pytest.approx(made.data[0].embedding, abs=1e-6)

        import openai

        with pytest.raises(openai.BadRequestError) as bad:
            client.embeddings.create(model="echo", input="x", dimensions=25)
        assert "dimensions" in str(bad.value)

        lines = [
            {
                "custom_id": f"e{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "echo", "input": f"text {i}"},
            }
            for i in range(20)
        ]
        up = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        batch = wait_batch(client, batch.id, {"completed", "failed", "expired", "cancelled"})
        assert batch.status == "completed", batch
        rows = read_file(client, batch.output_file_id)
        assert sorted(r["custom_id"] for r in rows) == sorted(f"e{i}" for i in range(20))
        for row in rows:
            [item] = row["response"]["body"]["data"]
            assert len(floats(item["embedding"])) == 24
        # usage per tenant counts embeddings as requests and prompt tokens, no completions
        usage = qbatch(server.lane, "usage", "--tenant", "team-a", "--json")
        assert usage.returncode == 0, usage.stderr
        [row] = json.loads(usage.stdout)
        assert row["model"] == "echo" and row["requests"] == 4 + 20
        assert row["prompt_tokens"] == 3 + 1 + 1 + 40 and row["completion_tokens"] == 0
