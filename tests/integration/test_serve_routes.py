"""Several models, one front (issue 17, part 3), end to end: two echo worker pools on two
private lanes (one Redis prefix), a route table, and the client, `qbatch bulk run` and
`qbatch serve` sending each model's requests to its own pool. Each pool's worker serves
only its own model name, so a misrouted request would come back `unknown_model`; usage
is counted per tenant and model, once."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from producer.usage import UsageStore, last_days
from schemas import ConnectionSettings, ContractError, Status
from schemas.routes import parse_routes
from tests.serve_fixtures import KEY_A, Server, keys_file

try:
    from tests.integration.workers import Lane, echo_worker, qbatch
except ModuleNotFoundError:
    from workers import Lane, echo_worker, qbatch  # type: ignore[no-redef]

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def _stack(stack: Any) -> None:
    """The local Kafka + Redis (conftest's `stack` starts it or fails loudly)."""


@dataclass
class Pools:
    alpha: Lane
    beta: Lane
    routes_file: Path
    table: dict[str, Any]


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pools]:
    tmp = tmp_path_factory.mktemp("routes")
    alpha = Lane.new("qbra")
    other = Lane.new("qbrb")  # beta's own topics and group, alpha's Redis prefix
    beta = Lane(
        topic=other.topic, dlq_topic=other.dlq_topic, group=other.group, prefix=alpha.prefix
    )
    table = {
        "alpha": {"topic": alpha.topic, "bulk_topic": alpha.bulk_topic},
        "alpha-latest": {"topic": alpha.topic, "bulk_topic": alpha.bulk_topic},
        "beta": {"topic": beta.topic, "bulk_topic": beta.bulk_topic},
    }
    routes_file = tmp / "routes.json"
    routes_file.write_text(json.dumps(table))
    for lane in (alpha, beta):
        lane.create_topics(partitions=2)
    try:
        with (
            echo_worker(
                alpha,
                "--served-model-name",
                "alpha",
                "--model-aliases",
                '["alpha-latest"]',
                log=tmp / "alpha.log",
            ),
            echo_worker(beta, "--served-model-name", "beta", log=tmp / "beta.log"),
        ):
            yield Pools(alpha, beta, routes_file, table)
    finally:
        for lane in (alpha, beta):
            lane.delete_topics()
        alpha.clean_redis()


def chat(model: str, text: str = "hi") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}]}


def test_the_client_sends_each_model_to_its_pool(pools: Pools) -> None:
    settings = ConnectionSettings(routes=parse_routes(pools.table))
    with pools.alpha.client(settings=settings) as qb:
        ids = {m: qb.submit(chat(m)) for m in ("alpha", "alpha-latest", "beta")}
        results = qb.wait_many(list(ids.values()), timeout=60)
        with pytest.raises(ContractError, match=r"body\.model"):
            qb.submit(chat("gamma"))
    got = {m: results[rid] for m, rid in ids.items()}
    assert all(r is not None and r.status is Status.succeeded for r in got.values()), got
    assert {m: r.response.model for m, r in got.items() if r and r.response} == {
        "alpha": "alpha",
        "alpha-latest": "alpha",
        "beta": "beta",
    }


def batch_line(custom_id: str, model: str) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": chat(model, custom_id),
    }


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_bulk_run_refuses_unknown_models_and_routes_the_rest(pools: Pools, tmp_path: Path) -> None:
    routes = ("--routes", str(pools.routes_file))
    bad = write_jsonl(tmp_path / "bad.jsonl", [batch_line("a", "alpha"), batch_line("g", "gamma")])
    errors = tmp_path / "errors.jsonl"
    refused = qbatch(
        pools.alpha,
        *routes,
        "bulk",
        "run",
        str(bad),
        "--out",
        str(tmp_path / "o"),
        "--errors",
        str(errors),
    )  # the existing per-line path: the bad line is answered `failed`, never sent
    assert refused.returncode == 1, refused.stderr[-2000:]
    (error_line,) = [json.loads(x) for x in errors.read_text().splitlines()]
    assert error_line["custom_id"] == "g" and "'gamma'" in error_line["error"]["message"]
    lines = [batch_line(f"a{i}", "alpha") for i in range(3)] + [batch_line("b0", "beta")]
    good = write_jsonl(tmp_path / "good.jsonl", lines)
    out = tmp_path / "out.jsonl"
    run = ("bulk", "run", str(good), "--out", str(out), "--job", "routes-good")
    done = qbatch(pools.alpha, *routes, *run)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    models = {r["custom_id"]: r["response"]["body"]["model"] for r in rows}
    assert models == {"a0": "alpha", "a1": "alpha", "a2": "alpha", "b0": "beta"}
    # usage of a bulk run: tenant `cli`; collecting again counts nothing twice
    again = qbatch(pools.alpha, *routes, *run)  # collects the finished job again
    assert again.returncode == 0, again.stderr[-2000:]
    usage = qbatch(pools.alpha, "usage", "--tenant", "cli", "--json")
    assert usage.returncode == 0, usage.stderr
    by_model = {r["model"]: r["requests"] for r in json.loads(usage.stdout)}
    assert by_model == {"alpha": 4, "beta": 1}  # 3 + the bad file's good line


@contextlib.contextmanager
def routed_server(pools: Pools, tmp: Path) -> Iterator[Server]:
    server = Server(
        pools.alpha,
        tmp / "files",
        keys_file(tmp / "keys.json"),
        tmp / "serve.log",
        extra_env={"QBATCH_ROUTES": json.dumps(pools.table)},
    )
    try:
        yield server.start()
    finally:
        server.stop()


def wait_batch(client: openai.OpenAI, batch_id: str) -> Any:
    import time

    deadline = time.monotonic() + 120
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in {"completed", "failed", "expired", "cancelled"}:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)


def test_serve_routes_models_refuses_unknown_ones_and_counts_usage(
    pools: Pools, tmp_path: Path
) -> None:
    with routed_server(pools, tmp_path) as server:
        client = server.client()
        assert [m.id for m in client.models.list()] == ["alpha", "alpha-latest", "beta"]
        answer = client.chat.completions.create(**chat("beta"))
        assert answer.model == "beta"
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**chat("gamma"))
        assert info.value.code == "model_not_found" and info.value.param == "model"

        lines = [batch_line("a", "alpha"), batch_line("b", "beta"), batch_line("c", "beta")]
        up = client.files.create(
            file=("in.jsonl", write_jsonl(tmp_path / "in.jsonl", lines).read_bytes()),
            purpose="batch",
        )
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_batch(client, batch.id)
        assert done.status == "completed", done
        assert done.output_file_id is not None
        output = [
            json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()
        ]
        assert sorted(r["response"]["body"]["model"] for r in output) == ["alpha", "beta", "beta"]

        bad = [batch_line("a", "alpha"), batch_line("g", "gamma")]
        up = client.files.create(
            file=("bad.jsonl", write_jsonl(tmp_path / "bad.jsonl", bad).read_bytes()),
            purpose="batch",
        )
        failed = wait_batch(
            client,
            client.batches.create(
                input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id,
        )
        assert failed.status == "failed" and failed.errors and failed.errors.data
        assert [(e.code, e.line) for e in failed.errors.data] == [("model_not_found", 2)]

        metrics = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).text
        assert 'qbatch_serve_usage_requests_total{model="beta",tenant="team-a"} 3.0' in metrics
        assert 'qbatch_serve_usage_requests_total{model="alpha",tenant="team-a"} 1.0' in metrics
        page = httpx.get(
            f"http://127.0.0.1:{server.port}/", headers={"Authorization": f"Bearer {KEY_A}"}
        )
        assert page.status_code == 200 and done.id in page.text

    usage = qbatch(pools.alpha, "usage", "--tenant", "team-a", "--json")
    assert usage.returncode == 0, usage.stderr
    by_model = {
        r["model"]: (r["requests"], r["prompt_tokens"] > 0) for r in json.loads(usage.stdout)
    }
    assert by_model == {"alpha": (1, True), "beta": (3, True)}


def test_a_result_counts_once_however_often_it_is_recorded(pools: Pools) -> None:
    with pools.alpha.client() as qb:
        rid = qb.submit(chat("alpha"), request_id="req-usage-once")
        result = qb.wait(rid, timeout=60)
        assert result is not None and result.response is not None
        store = UsageStore(qb.redis, qb.keys)
        first = store.record("team-once", result)
        assert first is not None and first[1]["requests"] == 1
        assert store.record("team-once", result) is None  # a redone finalize / collect
        rows = store.rows(["team-once"], last_days(2))
        assert [(r.model, r.counts["requests"]) for r in rows] == [("alpha", 1)]
        assert "team-once" in store.tenants()
