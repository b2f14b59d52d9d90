"""`qbatch serve` pure parts: the OpenAI Batch object of a record and its job, batch file
validation (OpenAI's per-line errors), the window, sync timeouts, error bodies."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from producer.bulk import Defaults
from producer.job_view import JobView
from producer.serve.batches import (
    BatchRecord,
    batch_object,
    new_batch_id,
    validate_input,
    window_seconds,
)
from producer.serve.errors import ApiError, openai_param
from producer.serve.runner import output_file_id
from producer.serve.storage import FILE_ID
from producer.serve.sync import request_timeout

CHAT = "/v1/chat/completions"


def _record(**extra: object) -> BatchRecord:
    base = BatchRecord(
        id=new_batch_id(),
        tenant="a",
        endpoint=CHAT,
        input_file_id="file-" + "0" * 32,
        completion_window="24h",
        status="in_progress",
        created_at=1_000,
        expires_at=1_000 + 86_400,
        metadata={"k": "v"},
        in_progress_at=1_001,
    )
    for name, value in extra.items():
        setattr(base, name, value)
    return base


def _view(record: BatchRecord, **counts: int) -> JobView:
    h = {"status": "running", "total": 10, **{k: str(v) for k, v in counts.items()}}
    return JobView.from_hash(record.id, h, 0)


def test_the_batch_object_has_openais_shape_and_live_counts() -> None:
    record = _record()
    obj = batch_object(record, _view(record, succeeded=4, failed=1, expired=1, cancelled=1))
    assert obj["object"] == "batch" and obj["id"] == record.id and obj["status"] == "in_progress"
    assert obj["request_counts"] == {"total": 10, "completed": 4, "failed": 3}
    assert obj["errors"] is None and obj["metadata"] == {"k": "v"}
    for name in ("output_file_id", "error_file_id", "completed_at", "cancelled_at"):
        assert name in obj and obj[name] is None
    assert "tenant" not in obj
    assert batch_object(_record(status="validating"), None)["request_counts"]["total"] == 0
    frozen = _record(status="completed", final_counts={"total": 3, "completed": 3, "failed": 0})
    assert batch_object(frozen, None)["request_counts"]["completed"] == 3


def test_the_record_survives_its_redis_hash() -> None:
    record = _record(
        errors=[{"code": "x", "line": 2, "message": "m", "param": None}], ending="expired"
    )
    h = {k.encode(): v.encode() for k, v in record.to_hash().items()}
    back = BatchRecord.from_hash(h)
    assert back == record
    assert "output_file_id" not in record.to_hash()  # None fields are not written


def _line(i: int, **over: object) -> str:
    line = {
        "custom_id": f"c{i}",
        "method": "POST",
        "url": CHAT,
        "body": {"messages": [{"role": "user", "content": "hi"}]},
    }
    line.update(over)
    return json.dumps(line)


def test_a_good_file_validates_with_the_windows_deadline() -> None:
    deadline = datetime(2030, 1, 1, tzinfo=UTC)
    scan, errors = validate_input(
        [_line(1), "", _line(2)], "batch_x", CHAT, Defaults(deadline=deadline)
    )
    assert errors == [] and scan.total == 2
    assert [line.request_id for line in scan.lines] == ["batch_x.1", "batch_x.3"]
    assert all(
        line.envelope is not None and line.envelope.deadline == deadline for line in scan.lines
    )


def test_bad_lines_are_openai_errors_naming_line_and_param() -> None:
    texts = [
        _line(1),
        _line(2, url="/v1/rerank"),
        _line(3, body={"messages": []}),
        _line(1),
        _line(5, url="/v1/completions", body={"prompt": "p"}),
        "not json",
    ]
    _scan, errors = validate_input(texts, "b", CHAT)
    by_line = {e["line"]: e for e in errors}
    assert sorted(by_line) == [2, 3, 4, 5, 6]
    assert by_line[2]["param"] == "url"
    assert by_line[3]["param"] == "body.messages"
    assert by_line[4]["code"] == "duplicate_custom_id" and by_line[4]["param"] == "custom_id"
    assert by_line[5]["code"] == "mismatched_endpoint"
    assert by_line[6]["param"] is None and "not JSON" in by_line[6]["message"]
    assert all(set(e) == {"code", "line", "message", "param"} for e in errors)


def test_native_envelopes_and_empty_files_are_refused() -> None:
    native = json.dumps({"request_id": "r1", "body": {"prompt": "x"}})
    assert validate_input([native], "b", CHAT)[1][0]["code"] == "invalid_request"
    assert validate_input(["", "  "], "b", CHAT)[1] == [
        {
            "code": "empty_file",
            "line": None,
            "message": "the input file holds no requests",
            "param": None,
        }
    ]


def test_many_bad_lines_are_capped() -> None:
    _scan, errors = validate_input(["[]"] * 1_005, "b", CHAT)
    assert errors[-1]["code"] == "too_many_errors"
    listed = len(errors) - 1
    assert (
        0 < listed <= 1_000
        and errors[-1]["message"] == f"{1_005 - listed} more bad lines not listed"
    )
    assert len(json.dumps(errors)) <= 64 * 1024 + 200


def test_an_error_list_does_not_grow_with_what_the_lines_echo() -> None:
    """A line's unknown key is echoed in `param` and `message`: 9 MB of such lines made an
    18 MB error list, stored in the batch hash and sent with every read of the batch."""
    long_key = "k" * 100_000
    line = json.dumps(
        {
            "custom_id": "c",
            "method": "POST",
            "url": CHAT,
            "body": {"messages": [{"role": "user", "content": "x"}], long_key: 1},
        }
    )
    _scan, errors = validate_input([line] * 90, "b", CHAT)
    assert len(json.dumps(errors)) <= 64 * 1024 + 200
    first = errors[0]
    assert len(first["message"]) <= 503 and (first["param"] is None or len(first["param"]) <= 203)
    assert errors[-1]["code"] == "too_many_errors"


@pytest.mark.parametrize(("window", "seconds"), [("24h", 86_400), ("1h", 3_600), ("168h", 604_800)])
def test_completion_window(window: str, seconds: int) -> None:
    assert window_seconds(window) == seconds


@pytest.mark.parametrize("window", ["0h", "169h", "24", "1d", "24h "])
def test_bad_completion_window(window: str) -> None:
    with pytest.raises(ValueError, match="24h"):
        window_seconds(window)


def test_sync_timeout_comes_from_the_sdk_header_capped() -> None:
    assert request_timeout({"x-stainless-timeout": "30"}, 600, 3_600) == 30
    assert request_timeout({"x-stainless-timeout": "99999"}, 600, 3_600) == 3_600
    for bad in ("nan", "-1", "0", "soon"):
        assert request_timeout({"x-stainless-timeout": bad}, 600, 3_600) == 600
    assert request_timeout({}, 45, 3_600) == 45


def test_error_bodies_and_ids() -> None:
    body = ApiError(404, "No such File object: x", code="not_found", param="id").body()
    assert body == {
        "error": {
            "message": "No such File object: x",
            "type": "invalid_request_error",
            "param": "id",
            "code": "not_found",
        }
    }
    assert ApiError(503, "down").body()["error"]["type"] == "server_error"
    assert openai_param("body.messages[0].role") == "messages[0].role"
    assert openai_param("(envelope)") is None
    out, err = output_file_id("batch_1", "output"), output_file_id("batch_1", "error")
    assert out != err and out == output_file_id("batch_1", "output") and FILE_ID.match(out)


def test_a_lines_result_outlives_the_batch_window_by_a_day() -> None:
    from producer.serve.runner import result_ttl_for

    now = 1_800_000_000.0
    assert result_ttl_for(now + 72 * 3_600, now) == 96 * 3_600
    assert result_ttl_for(now + 168 * 3_600, now) == 192 * 3_600
    assert result_ttl_for(now + 3_600, now) == 25 * 3_600
    assert result_ttl_for(now - 10, now) == 86_400  # already past: still the default
    assert result_ttl_for(now + 90 * 86_400, now) == 30 * 86_400  # the contract's ceiling
