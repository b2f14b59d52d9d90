"""QBatchClient against in-memory fakes (no sockets) and the CLI parts that need none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from producer.cli import app, default_job_id
from producer.client import PublishError, QBatchClient, Request, build_envelope
from schemas import ContractError, ResultEnvelope, decode_request


class FakeFuture:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.is_done = True

    def get(self, timeout: float | None = None) -> object:
        if self.error:
            raise self.error
        return object()


class FakeProducer:
    def __init__(self, fail: set[str] | None = None) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []
        self.flushes = 0
        self.closed = False
        self.fail = fail or set()

    def send(self, topic: str, key: bytes, value: bytes) -> FakeFuture:
        self.sent.append((topic, key, value))
        return FakeFuture(RuntimeError("nope") if key.decode() in self.fail else None)

    def flush(self, timeout: float | None = None) -> None:
        self.flushes += 1

    def close(self, timeout: float | None = None) -> None:
        self.closed = True


class FakeRedis:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.blpops: list[tuple[list[str], float]] = []
        self.on_blpop: Any = None

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def mget(self, keys: list[str]) -> list[bytes | None]:
        return [self.data.get(k) for k in keys]

    def blpop(self, keys: list[str], timeout: float) -> None:
        self.blpops.append((keys, timeout))
        if self.on_blpop:
            self.on_blpop()

    def close(self) -> None:
        pass


def result_json(rid: str, status: str = "succeeded") -> bytes:
    data: dict[str, Any] = {"request_id": rid, "status": status}
    if status != "succeeded":
        data["error"] = {"code": "engine_error", "message": "boom"}
    return json.dumps(data).encode()


@pytest.fixture
def client() -> QBatchClient:
    return QBatchClient(
        bootstrap="k:1",
        redis_url="redis://r:1/0",
        topic="t",
        prefix="p",
        producer=FakeProducer(),
        redis_client=FakeRedis(),
        poll_s=0.01,
    )


def test_submit_publishes_a_valid_keyed_envelope(client: QBatchClient) -> None:
    rid = client.submit(
        {"messages": [{"role": "user", "content": "hi"}]}, priority=-1, metadata={"a": 1}
    )
    ((topic, key, value),) = client.producer.sent
    assert topic == "t" and key == rid.encode()
    env = decode_request(value, key)
    assert env.priority == -1 and env.metadata == {"a": 1} and env.submitted_at is not None
    assert rid.startswith("req-") and client.producer.flushes == 1


def test_completions_endpoint_is_inferred() -> None:
    env = build_envelope({"prompt": "x"}, request_id="r1")
    assert env.endpoint == "/v1/completions"


def test_invalid_request_is_refused_before_publishing(client: QBatchClient) -> None:
    with pytest.raises(ContractError) as exc:
        client.submit({"messages": []})
    assert exc.value.param == "body.messages"
    assert client.producer.sent == []


def test_submit_many_validates_all_first(client: QBatchClient) -> None:
    with pytest.raises(ContractError, match=r"^\[1\] body"):
        client.submit_many([{"prompt": "a"}, {"prompt": ""}])
    assert client.producer.sent == []
    ids = client.submit_many(
        [{"prompt": "a"}, Request(body={"prompt": "b"}, request_id="mine", custom_id="c")]
    )
    assert ids[1] == "mine" and len(client.producer.sent) == 2 and client.producer.flushes == 1


def test_duplicate_ids_in_one_call_are_refused(client: QBatchClient) -> None:
    with pytest.raises(ContractError):
        client.submit_many([Request({"prompt": "a"}, request_id="x")] * 2)


def test_unacknowledged_records_raise() -> None:
    qb = QBatchClient(producer=FakeProducer(fail={"bad"}), redis_client=FakeRedis())
    with pytest.raises(PublishError) as exc:
        qb.submit_many(
            [Request({"prompt": "a"}, request_id="ok"), Request({"prompt": "b"}, request_id="bad")]
        )
    assert set(exc.value.failed) == {"bad"}


def test_get_and_typed_results(client: QBatchClient) -> None:
    assert client.get("r1") is None
    client.redis.data["p:result:r1"] = result_json("r1")
    result = client.get("r1")
    assert isinstance(result, ResultEnvelope) and result.ok


def test_wait_checks_get_then_blocks_then_gets(client: QBatchClient) -> None:
    fake: FakeRedis = client.redis

    def arrive() -> None:
        fake.data["p:result:r1"] = result_json("r1")

    fake.on_blpop = arrive
    result = client.wait("r1", timeout=5)
    assert result is not None and result.request_id == "r1"
    assert fake.blpops[0][0] == ["p:done:r1"]


def test_wait_times_out_with_none(client: QBatchClient) -> None:
    assert client.wait("never", timeout=0.05) is None


def test_wait_many(client: QBatchClient) -> None:
    fake: FakeRedis = client.redis
    fake.data["p:result:a"] = result_json("a")

    def arrive() -> None:
        fake.data["p:result:b"] = result_json("b", "failed")

    fake.on_blpop = arrive
    found = client.wait_many(["a", "b", "c"], timeout=0.1)
    assert found["a"] is not None and found["b"] is not None and not found["b"].ok
    assert found["c"] is None
    assert "p:done:c" in fake.blpops[-1][0] and "p:done:a" not in fake.blpops[-1][0]


def test_close_flushes_and_is_idempotent(client: QBatchClient) -> None:
    with client:
        pass
    assert client.producer.closed and client.producer.flushes == 1
    client.close()
    assert client.producer.flushes == 1


def test_bad_prefix_is_refused() -> None:
    with pytest.raises(ValueError):
        QBatchClient(prefix="no spaces")


# ---------------------------------------------------------------- CLI without sockets

runner = CliRunner()


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["submit"],
        ["get"],
        ["wait"],
        ["bulk"],
        ["bulk", "submit"],
        ["bulk", "status"],
        ["bulk", "collect"],
        ["bulk", "cancel"],
        ["bulk", "run"],
        ["bulk", "retry"],
    ],
)
def test_help_everywhere(args: list[str]) -> None:
    result = runner.invoke(app, [*args, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_dry_run_lists_every_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    good = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "x"}]},
    }
    path.write_text(
        "\n".join(
            [
                json.dumps(good),
                "nope",
                json.dumps({**good, "custom_id": "b", "body": {}}),
                json.dumps(good),
            ]
        )
        + "\n"
    )
    result = runner.invoke(app, ["--json", "bulk", "submit", str(path), "--job", "j", "--dry-run"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout.splitlines()[0])
    assert report["total"] == 4 and report["valid"] == 1
    assert [b["line"] for b in report["bad"]] == [2, 3, 4]
    assert "duplicate custom_id" in report["bad"][2]["message"]


def test_dry_run_clean_file_exits_0(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        json.dumps({"request_id": "x", "body": {"prompt": "p"}, "endpoint": "/v1/completions"})
    )
    result = runner.invoke(app, ["-q", "bulk", "submit", str(path), "--job", "j", "--dry-run"])
    assert result.exit_code == 0, result.output


def test_bad_job_id_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("{}\n")
    result = runner.invoke(app, ["bulk", "submit", str(path), "--job", "bad job", "--dry-run"])
    assert result.exit_code == 2


def test_default_job_id_is_stable_and_valid(tmp_path: Path) -> None:
    job = default_job_id(Path("/data/night ly.v2.jsonl"), "ab" * 32)
    assert job == "night_ly.v2-abababababab"


@pytest.mark.parametrize(
    "body",
    [
        '{"messages": [{"role": "user", "content": "hi"}], "seed": ' + "9" * 5000 + "}",
        "[" * 100_000 + "]" * 100_000,
    ],
)
def test_cli_refuses_hostile_bodies_with_usage_exit(body: str) -> None:
    """A body the worker would refuse is refused here too: exit 2 and a message, no trace."""
    result = runner.invoke(app, ["submit", "--body", body])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


def test_cli_refuses_a_reserved_job_id(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}}\n'
    )
    result = runner.invoke(app, ["bulk", "submit", str(path), "--job", "nightly:done", "--dry-run"])
    assert result.exit_code == 2 and ":done" in result.output
