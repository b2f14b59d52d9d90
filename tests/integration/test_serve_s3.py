"""`qbatch serve --storage s3://...` end to end: the real `openai` SDK against the server,
its files in a real S3-compatible server (moto's server mode on a loopback port), real
Kafka and Redis and an echo worker (test_serve.py's server and helpers)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.cli_common import EXIT_USAGE
from tests.s3_fixtures import BUCKET, CREDENTIALS, moto_s3, object_keys
from tests.serve_fixtures import Server, batch_lines, jsonl, keys_file, read_file, wait_batch

try:
    from tests.integration.workers import Lane, echo_worker, qbatch
except ModuleNotFoundError:
    from workers import Lane, echo_worker, qbatch  # type: ignore[no-redef]

pytestmark = pytest.mark.integration
PREFIX = "serve-e2e/"


@pytest.fixture(scope="module", autouse=True)
def _stack(stack: Any) -> None:
    """The local Kafka + Redis (conftest's `stack` starts it or fails loudly)."""


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    """A private lane, an echo worker and `qbatch serve` storing in moto's S3."""
    tmp = tmp_path_factory.mktemp("serve-s3")
    lane = Lane.new("qbs3")
    lane.create_topics()
    with moto_s3() as endpoint:
        server = Server(
            lane,
            f"s3://{BUCKET}/{PREFIX}",
            keys_file(tmp / "keys.json"),
            tmp / "serve.log",
            extra_env={**CREDENTIALS, "QBATCH_S3_ENDPOINT_URL": endpoint},
        )
        try:
            with echo_worker(lane, log=tmp / "worker.log"):
                server.start()
                yield server, endpoint
        finally:
            server.stop()
            lane.delete_topics()
            lane.clean_redis()


def test_a_batch_through_s3_storage(s3_server: tuple[Server, str], tmp_path: Path) -> None:
    server, endpoint = s3_server
    client = server.client()
    n = 50
    data = jsonl(batch_lines(n))
    up = client.files.create(file=("in.jsonl", data), purpose="batch")
    # the bytes are the one object in the bucket (records live in Redis)
    (key,) = object_keys(endpoint, prefix=PREFIX)
    assert key.startswith(f"{PREFIX}files/{up.id}.")
    assert client.files.content(up.id).content == data
    batch = client.batches.create(
        input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_batch(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    out = read_file(client, done.output_file_id)
    assert Counter(line["custom_id"] for line in out) == Counter(f"c{i}" for i in range(n))
    assert all(line["response"]["status_code"] == 200 for line in out)
    out_keys = [k for k in object_keys(endpoint, prefix=PREFIX) if done.output_file_id in k]
    assert len(out_keys) == 1
    assert {f.id for f in client.files.list()} == {up.id, done.output_file_id}
    # delete removes the record and the object
    assert client.files.delete(up.id).deleted is True
    assert not [k for k in object_keys(endpoint, prefix=PREFIX) if up.id in k]
    assert {f.id for f in client.files.list()} == {done.output_file_id}


def test_a_bad_storage_url_stops_the_server_at_start(s3_server: tuple[Server, str]) -> None:
    server, _ = s3_server
    keys = str(server.keys_file)
    out = qbatch(server.lane, "serve", "--keys-file", keys, "--storage", "ftp://bucket/x")
    assert out.returncode == EXIT_USAGE, out.stdout + out.stderr
    assert "storage must be a path or a file://, s3://, gs:// or az:// URL" in out.stderr
