"""The conformance corpus end to end: raw envelopes on real Kafka, results from real Redis.

Every body of `tests/fixtures/conformance/bodies.jsonl` is published as it would be by a
producer that does not validate (so the worker's own checks answer the bad ones), to an
echo worker. Each must come back exactly once: `succeeded` where the corpus says `ok`,
else `failed` naming the corpus's `param`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas import Status
from tests.conformance import load

try:
    from tests.integration.workers import Lane, echo_worker
except ModuleNotFoundError:
    from workers import Lane, echo_worker  # type: ignore[no-redef]

pytestmark = pytest.mark.integration


@pytest.fixture
def lane(stack: object) -> Iterator[Lane]:
    lane = Lane.new("qbconf")
    lane.create_topics()
    yield lane
    lane.delete_topics()
    lane.clean_redis()


def test_every_corpus_body_gets_its_expected_result(lane: Lane, tmp_path: Path) -> None:
    cases = load()
    client = lane.client()
    ids = {f"conf-{i:03d}": case for i, case in enumerate(cases)}
    try:
        with echo_worker(lane, log=tmp_path / "worker.log"):
            for rid, case in ids.items():
                raw = json.dumps(case.envelope(rid, "echo")).encode()
                client.producer.send(lane.topic, key=rid.encode(), value=raw)
            client.producer.flush()
            results = client.wait_many(list(ids), timeout=120)
    finally:
        client.close()
    missing = [ids[rid].name for rid, result in results.items() if result is None]
    assert missing == [], f"no result for {missing}"
    for rid, case in ids.items():
        result = results[rid]
        assert result is not None
        if case.ok:
            assert result.status is Status.succeeded, (case.name, result.error)
            assert result.response is not None
            n = int(case.body.get("n") or 1)
            assert [c.index for c in result.response.choices] == list(range(n)), case.name
            asked = case.body.get("logprobs")
            has = [c.logprobs is not None for c in result.response.choices]
            assert has == [asked not in (None, False)] * n, case.name
            assert result.response.system_fingerprint, case.name
        else:
            assert result.status is Status.failed, case.name
            assert result.error is not None and result.error.param == case.expect, (
                case.name,
                result.error,
            )
