"""`qbatch serve` end to end: the real, unmodified `openai` SDK against the server (a
subprocess on a loopback port), real Kafka and Redis, and an echo worker on a private
lane (`tests/integration/workers.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.serve_fixtures import (
    KEY_A,
    KEY_B,
    Server,
    batch_lines,
    jsonl,
    read_file,
    serving,
    wait_batch,
)
from tests.tool_fixtures import call_block, registry

try:
    from tests.integration.workers import REPO, Lane, qbatch
except ModuleNotFoundError:
    from workers import REPO, Lane, qbatch  # type: ignore[no-redef]

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def _stack(stack: Any) -> None:
    """The local Kafka + Redis (conftest's `stack` starts it or fails loudly)."""


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("serve")) as server:
        yield server


# ---------------------------------------------------------------- batches


def test_batch_upload_create_poll_download(fast: Server) -> None:
    client = fast.client()
    n = 200
    up = client.files.create(file=("in.jsonl", jsonl(batch_lines(n))), purpose="batch")
    assert up.id.startswith("file-") and up.purpose == "batch" and up.filename == "in.jsonl"
    assert client.files.retrieve(up.id).bytes == len(jsonl(batch_lines(n)))
    batch = client.batches.create(
        input_file_id=up.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "nightly"},
    )
    assert batch.status == "validating" and batch.metadata == {"run": "nightly"}
    assert batch.expires_at == batch.created_at + 24 * 3600
    done = wait_batch(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (n, n)
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    out = read_file(client, done.output_file_id)
    assert Counter(line["custom_id"] for line in out) == Counter(f"c{i}" for i in range(n))
    for line in out:
        assert line["response"]["status_code"] == 200 and line["error"] is None
        message = line["response"]["body"]["choices"][0]["message"]["content"]
        assert message == "m" + line["custom_id"][1:]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list(limit=100)]
    # the batch is a bulk job: `qbatch bulk status` knows it
    status = qbatch(fast.lane, "bulk", "status", batch.id)
    assert status.returncode == 0 and "completed" in status.stdout, status.stdout + status.stderr
    # deleting the input file leaves the output
    assert client.files.delete(up.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(up.id)
    assert done.output_file_id in [f.id for f in client.files.list()]


def test_lines_that_fail_in_the_worker_go_to_the_error_file(fast: Server) -> None:
    """Valid lines the worker refuses (an output budget over the echo worker's 32,768-token
    context) are answered in the error file; the rest in the output file."""
    client = fast.client()
    lines = batch_lines(6)
    for i in (1, 4):
        lines[i]["body"]["max_tokens"] = 40_000
    up = client.files.create(file=("mixed.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_batch(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    counts = done.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (6, 4, 2)
    out, errs = read_file(client, done.output_file_id), read_file(client, done.error_file_id)
    assert sorted(x["custom_id"] for x in out) == ["c0", "c2", "c3", "c5"]
    assert sorted(x["custom_id"] for x in errs) == ["c1", "c4"]
    for line in errs:
        assert line["error"]["code"] == "context_length_exceeded"
        assert line["response"]["status_code"] == 400
        assert line["response"]["body"]["error"]["param"] == "body.max_tokens"


def test_bad_lines_fail_the_batch_with_per_line_errors(fast: Server) -> None:
    client = fast.client()
    lines = batch_lines(5)
    lines[1]["url"] = "/v1/rerank"  # an endpoint qbatch does not serve
    lines[2]["body"]["messages"] = []  # a body the contract refuses
    lines[3]["custom_id"] = "c0"  # a repeated custom_id
    lines[4]["url"] = "/v1/completions"  # another endpoint than the batch's
    lines[4]["body"] = {"model": "echo", "prompt": "p"}
    up = client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    failed = wait_batch(client, batch.id, {"failed", "completed"}, timeout=60)
    assert failed.status == "failed" and failed.failed_at is not None
    assert failed.errors is not None and failed.errors.data is not None
    errors = {e.line: e for e in failed.errors.data}
    assert sorted(errors) == [2, 3, 4, 5], failed.errors
    assert errors[2].param == "url" and "/v1/chat/completions" in (errors[2].message or "")
    assert errors[3].param == "body.messages"
    assert errors[4].code == "duplicate_custom_id"
    assert errors[5].code == "mismatched_endpoint"
    assert failed.output_file_id is None and failed.request_counts.total == 0  # type: ignore[union-attr]


def test_cancel_mid_way_and_the_concurrent_batch_limit(tmp_path: Path) -> None:
    n = 400
    slow = ("--echo-delay-ms", "200", "--max-inflight", "16", "--batch-max-size", "8")
    with serving(tmp_path, *slow) as server:
        client = server.client(max_retries=0)
        up = client.files.create(file=("in.jsonl", jsonl(batch_lines(n))), purpose="batch")
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        # team-b may run 1 batch at a time (its limit in the keys file)
        small = server.client(KEY_B, max_retries=0)
        up_b = small.files.create(file=("b.jsonl", jsonl(batch_lines(20))), purpose="batch")
        first = small.batches.create(
            input_file_id=up_b.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        with pytest.raises(openai.RateLimitError) as limit:
            small.batches.create(
                input_file_id=up_b.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert limit.value.code == "batch_limit_reached"
        deadline = time.monotonic() + 60
        while (client.batches.retrieve(batch.id).request_counts.completed or 0) < 10:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        done = wait_batch(client, batch.id, {"cancelled"}, timeout=120)
        counts = done.request_counts
        assert counts is not None and counts.total == n and 10 <= counts.completed < n
        assert counts.completed + counts.failed == n
        out, errs = read_file(client, done.output_file_id), read_file(client, done.error_file_id)
        assert len(out) == counts.completed and len(errs) == counts.failed
        assert Counter(x["custom_id"] for x in out + errs) == Counter(f"c{i}" for i in range(n))
        assert {x["error"]["code"] for x in errs} == {"cancelled"}
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(batch.id)
        # once team-b's batch has ended, its slot is free again
        wait_batch(small, first.id, {"completed"}, timeout=120)
        again = small.batches.create(
            input_file_id=up_b.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert small.batches.cancel(again.id).status in ("cancelling", "cancelled")


def bulk_records(lane: Lane) -> int:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=lane.bootstrap.split(","))
    try:
        parts = [
            TopicPartition(lane.bulk_topic, p)
            for p in consumer.partitions_for_topic(lane.bulk_topic)
        ]
        return sum(consumer.end_offsets(parts).values())
    finally:
        consumer.close()


def test_server_killed_mid_batch_resumes_and_completes(tmp_path: Path) -> None:
    n = 1_000
    with serving(tmp_path, "--echo-delay-ms", "20", "--echo-concurrency", "4") as server:
        client = server.client()
        up = client.files.create(file=("in.jsonl", jsonl(batch_lines(n))), purpose="batch")
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while (client.batches.retrieve(batch.id).request_counts.completed or 0) < 100:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        server.kill()
        with pytest.raises(openai.APIConnectionError):
            client.with_options(max_retries=0).batches.retrieve(batch.id)
        server.start()  # same storage, same Redis prefix: the runner resumes the batch
        resumed = client.with_options(base_url=server.base_url)
        mid = resumed.batches.retrieve(batch.id)
        assert mid.status in ("in_progress", "finalizing", "completed")
        done = wait_batch(resumed, batch.id, {"completed", "failed"}, timeout=180)
        assert done.status == "completed", done
        out = read_file(resumed, done.output_file_id)
        assert len(out) == n
        assert Counter(x["custom_id"] for x in out) == Counter(f"c{i}" for i in range(n))
        assert all(x["response"]["status_code"] == 200 for x in out)
        assert bulk_records(server.lane) == n  # no line was queued twice


# ---------------------------------------------------------------- sync requests


def test_sync_chat_with_tools_completions_and_models(fast: Server) -> None:
    client = fast.client()
    tools = [t for t in registry.openai_tools() if t["function"]["name"] == "get_weather"]
    chat = client.chat.completions.create(
        model="echo",
        messages=[{"role": "user", "content": call_block("get_weather", city="Paris")}],
        tools=tools,  # type: ignore[arg-type]
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.tool_calls[0].type == "function"
    fn = choice.message.tool_calls[0].function  # type: ignore[union-attr]
    assert fn.name == "get_weather" and json.loads(fn.arguments) == {"city": "Paris"}
    plain = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hello there"}], timeout=30
    )
    assert plain.choices[0].message.content == "hello there" and plain.usage is not None
    text = client.completions.create(model="echo", prompt="one two three")
    assert text.choices[0].text == "one two three"
    assert [m.id for m in client.models.list()] == ["echo"]
    assert client.models.retrieve("echo").id == "echo"
    with pytest.raises(openai.BadRequestError) as streamed:
        client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "x"}], stream=True
        )
    assert streamed.value.param == "stream" and "stream" in streamed.value.message
    with pytest.raises(openai.BadRequestError) as empty:
        client.chat.completions.create(model="echo", messages=[])
    assert empty.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as unknown:  # the worker's answer, mapped
        client.with_options(max_retries=0).chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}]
        )
    assert unknown.value.code == "unknown_model"


# ---------------------------------------------------------------- bad input, auth, tenants


def test_bad_uploads_and_batch_requests(fast: Server) -> None:
    client = fast.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as not_jsonl:
        client.files.create(file=("x.csv", b"a,b\n1,2\n"), purpose="batch")
    assert not_jsonl.value.code == "invalid_file_format" and "line 1" in not_jsonl.value.message
    with pytest.raises(openai.BadRequestError) as purpose:
        client.files.create(file=("x.jsonl", jsonl(batch_lines(1))), purpose="fine-tune")
    assert purpose.value.param == "purpose"
    small = fast.client(KEY_B, max_retries=0)
    with pytest.raises(openai.APIStatusError) as big:
        small.files.create(file=("big.jsonl", jsonl(batch_lines(200))), purpose="batch")
    assert big.value.status_code == 413 and big.value.code == "file_too_large"
    assert small.files.list().data == []  # nothing kept
    up = client.files.create(file=("ok.jsonl", jsonl(batch_lines(1))), purpose="batch")
    with pytest.raises(openai.BadRequestError) as endpoint:
        client.batches.create(
            input_file_id=up.id,
            endpoint="/v1/rerank",  # type: ignore[arg-type]
            completion_window="24h",
        )
    assert endpoint.value.param == "endpoint"
    with pytest.raises(openai.BadRequestError) as window:
        client.batches.create(
            input_file_id=up.id,
            endpoint="/v1/chat/completions",
            completion_window="2 days",  # type: ignore[arg-type]
        )
    assert window.value.param == "completion_window"


def test_keys_and_tenant_isolation(fast: Server) -> None:
    raw = httpx.get(f"{fast.base_url}/files", timeout=10)
    assert raw.status_code == 401 and raw.json()["error"]["code"] == "missing_api_key"
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError) as wrong:
        fast.client("sk-not-a-key", max_retries=0).files.list()
    assert wrong.value.code == "invalid_api_key"
    a, b = fast.client(), fast.client(KEY_B, max_retries=0)
    up = a.files.create(file=("mine.jsonl", jsonl(batch_lines(2))), purpose="batch")
    batch = a.batches.create(
        input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (
        lambda: b.files.retrieve(up.id),
        lambda: b.files.content(up.id),
        lambda: b.files.delete(up.id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert up.id not in [f.id for f in b.files.list()]
    assert batch.id not in [x.id for x in b.batches.list()]
    assert a.files.retrieve(up.id).id == up.id  # still there for its owner
    assert wait_batch(a, batch.id, {"completed"}).request_counts.completed == 2  # type: ignore[union-attr]
    log = fast.log.read_text()
    assert KEY_A not in log and KEY_B not in log and "sk-not-a-key" not in log


def test_server_refuses_to_start_without_keys(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "QBATCH_API_KEYS"}
    run = subprocess.run(
        [sys.executable, "-m", "producer.cli", "serve", "--storage-dir", str(tmp_path)],
        env={**env, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "QBATCH_API_KEYS" in run.stderr
