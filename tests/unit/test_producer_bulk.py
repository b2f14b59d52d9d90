"""Pure parts of bulk jobs: formats, line validation, ids, output lines, status maths."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from producer.batch_output import (
    STATUS_CODES,
    cancelled_result,
    invalid_result,
    output_json,
    output_line,
)
from producer.bulk import (
    Defaults,
    InputFormat,
    check_job_id,
    detect_format,
    jsonl_lines,
    parse_request_id,
    request_id_for,
    scan_lines,
)
from producer.job_view import JobView
from producer.line_sources import scan_file
from schemas import (
    BatchOutputLine,
    ContractError,
    ErrorCode,
    ResultEnvelope,
    Status,
    valid_id,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def openai_line(cid: str, body: dict | None = None, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body or CHAT})


def native_line(rid: str, **extra: object) -> str:
    return json.dumps({"request_id": rid, "body": CHAT, **extra})


# ---------------------------------------------------------------- ids


def test_request_ids_are_deterministic_and_valid() -> None:
    assert request_id_for("nightly", 7) == "nightly.7"
    assert request_id_for("nightly", 7, attempt=2) == "nightly.7.r2"
    assert parse_request_id("nightly", "nightly.7") == (7, 0)
    assert parse_request_id("nightly", "nightly.7.r2") == (7, 2)


@pytest.mark.parametrize(
    "rid", ["other.7", "nightly.", "nightly.x", "nightly.7.x2", "nightly.7.r", "nightly.7.r2.3"]
)
def test_parse_request_id_rejects_foreign_ids(rid: str) -> None:
    assert parse_request_id("nightly", rid) is None


@given(
    job=st.from_regex(r"[A-Za-z0-9_.:-]{1,96}", fullmatch=True),
    line=st.integers(1, 10**9),
    attempt=st.integers(0, 999),
)
def test_request_id_roundtrip(job: str, line: int, attempt: int) -> None:
    rid = request_id_for(job, line, attempt)
    assert valid_id(rid) == rid
    assert parse_request_id(job, rid) == (line, attempt)


@pytest.mark.parametrize("job", ["", "a b", "x" * 97, "a/b"])
def test_bad_job_ids(job: str) -> None:
    with pytest.raises(ContractError) as exc:
        check_job_id(job)
    assert exc.value.param == "job_id"


# ---------------------------------------------------------------- detection and validation


def test_detect_format_first_non_blank_line_decides() -> None:
    assert detect_format(["", "  ", openai_line("a")]) is InputFormat.openai
    assert detect_format(["\n", native_line("r1")]) is InputFormat.native
    assert detect_format(["", ""]) is None


def test_openai_file_scans_to_envelopes() -> None:
    scan = scan_lines(
        [openai_line("a"), "", openai_line("b", {"prompt": "x"}, "/v1/completions")], "j"
    )
    assert scan.format is InputFormat.openai
    assert scan.total == 2
    first, second = scan.lines
    assert (first.line, first.request_id, first.custom_id) == (1, "j.1", "a")
    assert second.line == 3 and second.request_id == "j.3"
    assert first.envelope is not None and first.envelope.job_id == "j"
    assert second.envelope is not None and second.envelope.endpoint == "/v1/completions"
    assert not scan.bad


def test_native_lines_get_derived_ids_and_keep_options() -> None:
    scan = scan_lines([native_line("mine-1", priority=-3, metadata={"k": 1})], "job")
    (line,) = scan.lines
    assert line.envelope is not None
    assert line.envelope.request_id == "job.1"
    assert line.envelope.custom_id == "mine-1"
    assert line.envelope.priority == -3
    assert line.envelope.metadata == {"k": 1}


def test_native_line_of_another_job_is_an_error() -> None:
    (line,) = scan_lines([native_line("r", job_id="other")], "job").lines
    assert line.error is not None and line.error.param == "job_id"


def test_a_native_line_cannot_forge_a_tool_loop_continuation() -> None:
    """`loop` is the executor's state for turn 2 onwards (its transcript's usage is summed
    into the final result): a file that sets it is refused, line by line."""
    loop = {"turn": 2, "transcript": [{"turn": 1, "calls": [], "usage": None}]}
    (line,) = scan_lines([native_line("r", tool_loop={"max_turns": 4}, loop=loop)], "job").lines
    assert line.envelope is None
    assert line.error is not None and line.error.param == "loop"


def test_every_bad_line_is_reported_with_its_reason() -> None:
    texts = [
        openai_line("ok"),
        "{not json",
        "[1, 2]",
        openai_line("bad-role", {"messages": [{"role": "robot", "content": "x"}]}),
        json.dumps({"custom_id": "u", "method": "POST", "url": "/v1/rerank", "body": CHAT}),
        openai_line("ok"),  # duplicate custom_id
        openai_line("typo", {"messages": CHAT["messages"], "max_tokenz": 5}),
        openai_line("fine"),
    ]
    scan = scan_lines(texts, "j")
    bad = {line.line: line.error for line in scan.bad}
    assert sorted(bad) == [2, 3, 4, 5, 6, 7]
    assert all(err is not None for err in bad.values())
    assert "not JSON" in bad[2].message  # type: ignore[union-attr]
    assert "JSON object" in bad[3].message  # type: ignore[union-attr]
    assert bad[4].param is not None and bad[4].param.startswith("body.messages[0]")  # type: ignore[union-attr]
    assert bad[5].param == "url"  # type: ignore[union-attr]
    assert "duplicate custom_id 'ok' (first on line 1)" in bad[6].message  # type: ignore[union-attr]
    assert "max_tokenz" in bad[7].message  # type: ignore[union-attr]


def test_mixed_file_names_the_line() -> None:
    scan = scan_lines([openai_line("a"), native_line("r"), openai_line("b")], "j")
    assert [line.line for line in scan.mixed] == [2]
    err = scan.mixed[0].error
    assert err is not None and "mixed formats" in err.message


def test_defaults_apply_only_where_unset() -> None:
    defaults = Defaults(priority=5, result_ttl_s=60)
    scan = scan_lines([openai_line("a"), native_line("r", priority=1)], "j", defaults=defaults)
    envs = [line.envelope for line in scan.lines]
    assert envs[0] is not None and envs[0].priority == 5 and envs[0].result_ttl_s == 60
    # native files are their own format; a second scan keeps each line's own priority
    scan2 = scan_lines([native_line("r", priority=1)], "j", defaults=defaults)
    assert scan2.lines[0].envelope is not None and scan2.lines[0].envelope.priority == 1


def test_a_body_priority_moves_to_the_envelope() -> None:
    """vLLM's batch files put `priority` in the body; qbatch reads the envelope's."""
    body = {**CHAT, "priority": -7}
    defaults = Defaults(priority=5)
    (line,) = scan_lines([openai_line("a", body)], "j", defaults=defaults).lines
    assert line.envelope is not None and line.envelope.priority == -7
    assert "priority" not in line.envelope.body.model_fields_set
    native = json.dumps({"request_id": "r", "body": body})
    (line,) = scan_lines([native], "j").lines
    assert line.envelope is not None and line.envelope.priority == -7
    agreeing = json.dumps({"request_id": "r", "priority": -7, "body": body})
    assert scan_lines([agreeing], "j").lines[0].envelope is not None
    clash = json.dumps({"request_id": "r", "priority": 2, "body": body})
    (line,) = scan_lines([clash], "j").lines
    assert line.error is not None and line.error.param == "body.priority"
    null = {**CHAT, "priority": None}
    (line,) = scan_lines([openai_line("n", null)], "j", defaults=defaults).lines
    assert line.envelope is not None and line.envelope.priority == 5


def test_attempt_changes_ids_only() -> None:
    (line,) = scan_lines([openai_line("a")], "j", attempt=3).lines
    assert line.request_id == "j.1.r3" and line.custom_id == "a"


# ---------------------------------------------------------------- output lines


def chat_result(status: Status = Status.succeeded, code: ErrorCode | None = None) -> ResultEnvelope:
    response = None
    if status is Status.succeeded:
        response = {
            "id": "x",
            "created": 1,
            "model": "m",
            "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    return ResultEnvelope.model_validate(
        {
            "request_id": "j.1",
            "job_id": "j",
            "custom_id": "a",
            "status": status,
            "response": response,
            "error": {"code": code, "message": f"{code}: boom"} if code else None,
        }
    )


def test_success_output_line() -> None:
    line = output_line(chat_result())
    assert line.id == "batch_req_j.1" and line.custom_id == "a" and line.error is None
    assert line.response is not None and line.response.status_code == 200
    assert line.response.body is not None and line.response.body["object"] == "chat.completion"
    # and it round-trips through the schema
    assert BatchOutputLine.model_validate_json(output_json(chat_result())) == line


@pytest.mark.parametrize(
    ("status", "code", "http"),
    [
        (Status.failed, ErrorCode.invalid_request, 400),
        (Status.failed, ErrorCode.unknown_model, 400),
        (Status.failed, ErrorCode.context_length_exceeded, 400),
        (Status.expired, ErrorCode.deadline_exceeded, 408),
        (Status.cancelled, ErrorCode.cancelled, 499),
        (Status.failed, ErrorCode.engine_error, 500),
        (Status.failed, ErrorCode.internal_error, 500),
        (Status.failed, ErrorCode.tool_loop_max_turns, 422),
        (Status.failed, ErrorCode.tool_loop_aborted, 422),
    ],
)
def test_error_output_lines(status: Status, code: ErrorCode, http: int) -> None:
    line = output_line(chat_result(status, code))
    assert line.response is not None and line.response.status_code == http
    assert line.error is not None and line.error.code == code.value
    assert line.response.body == {
        "error": {"message": f"{code}: boom", "type": code.value, "param": None, "code": code.value}
    }
    assert STATUS_CODES[code] == http


def test_local_results_for_unsent_lines() -> None:
    scan = scan_lines(["{oops", openai_line("c")], "j")
    bad, good = scan.lines
    failed = invalid_result(bad, "j", 1000)
    assert failed.status is Status.failed and failed.error is not None
    assert failed.error.code is ErrorCode.invalid_request
    assert failed.error.message.startswith("line 1: (line): not JSON")
    cancelled = cancelled_result(good, "j", 1000)
    assert cancelled.status is Status.cancelled and cancelled.custom_id == "c"
    assert output_line(cancelled).response.status_code == 499  # type: ignore[union-attr]


def test_an_unsent_line_past_its_deadline_is_answered_expired() -> None:
    """An expiring serve batch cancels its job: lines never sent by then are `expired`
    (as the worker answers queued ones), lines whose deadline is still ahead `cancelled`."""
    deadline = datetime(2026, 1, 1, tzinfo=UTC)
    (line,) = scan_lines([openai_line("c")], "j", defaults=Defaults(deadline=deadline)).lines
    at = int(deadline.timestamp() * 1000)
    expired = cancelled_result(line, "j", at)
    assert expired.status is Status.expired and expired.error is not None
    assert expired.error.code is ErrorCode.deadline_exceeded
    assert output_line(expired).response.status_code == 408  # type: ignore[union-attr]
    before = cancelled_result(line, "j", at - 1)
    assert before.status is Status.cancelled


# ---------------------------------------------------------------- status maths


def view(**fields: object) -> JobView:
    h = {"status": "running", "total": 100, "created_at": 1_000_000}
    h.update(fields)
    return JobView.from_hash("j", {k: str(v).encode() for k, v in h.items()}, 1_010_000)


def test_progress_never_shows_100_while_results_are_missing() -> None:
    assert view(succeeded=99).progress_pct == 99.0
    v = JobView.from_hash("j", {"status": "running", "total": "10000", "succeeded": "9999"}, 0)
    assert v.progress_pct == 99.9
    assert view(succeeded=60, failed=40).progress_pct == 100.0


def test_rate_and_eta() -> None:
    v = view(succeeded=50)
    assert v.elapsed_s == 10.0
    assert v.rate == 5.0
    assert v.eta_s == 10.0
    assert view().rate is None and view().eta_s is None


def test_finished_rate_uses_last_result_time() -> None:
    v = view(succeeded=100, status="completed", updated_at=1_004_000)
    assert v.elapsed_s == 4.0 and v.rate == 25.0 and v.eta_s == 0.0


def test_all_failed_is_not_reported_as_plain_completed() -> None:
    v = view(failed=100, status="completed_with_errors")
    assert not v.all_succeeded
    assert v.label.startswith("completed_with_errors (0 succeeded, 100 failed")


def test_an_unreadable_stored_result_becomes_a_failed_line_not_a_stopped_collect() -> None:
    """A stored result no reader can parse (here a usage figure past what a 64-bit JSON
    reader holds, as a forged tool-loop transcript once produced) is reported for its line
    as a failed result; collect goes on with the job's other lines."""
    from producer.collect import readable_result
    from schemas import ErrorCode, ResultEnvelope, Status
    from schemas.ref import RequestRef

    good = ResultEnvelope.for_request(
        RequestRef(request_id="job.1", job_id="job"), Status.succeeded, timings=None
    )
    assert readable_result(good.model_dump_json().encode(), "job.1", "job") == good
    text = good.model_dump_json(exclude_none=True)
    huge = text[:-1] + ', "usage": {"prompt_tokens": ' + "9" * 4400 + "}}"
    for raw in (huge.encode(), b"not json", b'{"status": "succeeded"}'):
        result = readable_result(raw, "job.2", "job")
        assert result.status is Status.failed and result.error is not None
        assert result.request_id == "job.2" and result.job_id == "job"
        assert result.error.code is ErrorCode.internal_error
        assert result.error.message.startswith("the stored result could not be read: ")


def test_jsonl_lines_split_on_newlines_only(tmp_path: Path) -> None:
    """U+2028/U+2029/U+0085 are legal raw inside a JSON string (`ensure_ascii=False`,
    `JSON.stringify`); `str.splitlines()` broke such a line in two."""
    assert jsonl_lines("a\r\nb\n\nc\u2028d\u2029e\x85f\n") == ["a", "b", "", "c\u2028d\u2029e\x85f"]
    assert jsonl_lines("") == [] and jsonl_lines("x") == ["x"]
    body = {"model": "m", "messages": [{"role": "user", "content": "one\u2028two\u2029three\x85"}]}
    path = tmp_path / "in.jsonl"
    line = json.dumps(
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body},
        ensure_ascii=False,
    )
    path.write_text(line + "\n" + openai_line("d") + "\n", encoding="utf-8")
    scan = scan_file(path, "j")
    assert scan.total == 2 and not scan.bad
    first = scan.lines[0]
    assert first.line == 1 and first.envelope is not None
    assert scan.lines[1].line == 2 and scan.lines[1].custom_id == "d"


def test_a_leading_byte_order_mark_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + openai_line("c").encode() + b"\n")
    (line,) = scan_file(path, "j").lines
    assert line.ok and line.custom_id == "c"


@given(st.sets(st.integers(1, 5_000), max_size=200))
def test_line_bitmap_round_trips(numbers: set[int]) -> None:
    from producer.line_sources import bitmap_lines, line_bitmap

    assert bitmap_lines(line_bitmap(numbers)) == sorted(numbers)


def test_line_bitmap_counts_bits_as_redis_setbit_does() -> None:
    from producer.line_sources import line_bitmap

    assert line_bitmap([1]) == b"\x40" and line_bitmap([8]) == b"\x00\x80"


def _outline(x: object) -> list[tuple[object, ...]]:
    lines = x if isinstance(x, list) else list(x)  # type: ignore[call-overload]
    return [
        (
            line.line,
            line.request_id,
            line.custom_id,
            line.ok,
            line.mixed,
            line.error.message if line.error else None,
            line.envelope,
        )
        for line in lines
    ]


def test_a_streamed_scan_matches_the_whole_file_scan(tmp_path: Path) -> None:
    """Issue 39: `bulk submit` parsed a whole file in memory (4.48 GB for 1,000,000 lines).
    The streaming pass (`scan_stream`) gives the same lines, errors and duplicates, from
    any position, a line over the envelope bound included."""
    from producer.stream_scan import scan_stream

    defaults = Defaults(result_ttl_s=7_200)
    texts = [
        openai_line("a"),
        "",
        "{oops",
        openai_line("b", {**CHAT, "note": "one\u2028two"}),
        openai_line("a"),  # duplicate custom_id
        native_line("r"),  # mixed
        "   ",
        openai_line("x" * 600_000),  # long but under the bound
        json.dumps({"custom_id": "huge", "body": "y" * 1_100_000}),
        openai_line("c"),
    ]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(texts).encode() + b"\n")
    whole = scan_file(path, "j", defaults=defaults)
    streamed = scan_stream(path, "j", defaults=defaults)
    assert (streamed.format, streamed.total, streamed.invalid) == (
        whole.format,
        whole.total,
        whole.invalid,
    )
    assert streamed.duplicates == {5: 1} and streamed.mixed_count == 1
    assert _outline(streamed.bad) == _outline(whole.bad)
    for position in (0, 2, 5, whole.total):
        assert _outline(streamed.lines_from(position)) == _outline(whole.lines[position:])


def test_an_over_long_first_line_neither_decides_the_format_nor_splits(tmp_path: Path) -> None:
    """A native file whose first line (after a byte-order mark) is over the bound: one bad
    line, the format from the next line, and the line numbers (request ids) unmoved."""
    from producer.stream_scan import scan_stream

    big = native_line("first", metadata={"pad": "z" * 1_100_000})
    path = tmp_path / "native.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + f"{big}\n{native_line('a')}\n{native_line('b')}\n".encode())
    streamed = scan_stream(path, "j")
    assert (streamed.format, streamed.total, streamed.invalid, streamed.mixed_count) == (
        InputFormat.native,
        3,
        1,
        0,
    )
    lines = list(streamed.lines_from(0))
    assert [(x.line, x.request_id, x.ok) for x in lines] == [
        (1, "j.1", False),
        (2, "j.2", True),
        (3, "j.3", True),
    ]
    assert lines[0].error is not None and "over" in lines[0].error.message


def test_a_streamed_scan_holds_little_more_than_one_line(tmp_path: Path) -> None:
    """20,000 lines (4.6 MB): the whole-file scan peaks at ~20x the file in Python objects
    (its every envelope); the streamed one at less than the file (a 64-bit digest per
    custom_id, for the uniqueness rule, is what grows with the lines)."""
    import tracemalloc

    from producer.stream_scan import scan_stream

    path = tmp_path / "big.jsonl"
    body = {"messages": [{"role": "user", "content": "q" * 100}]}
    path.write_text("".join(openai_line(f"c{i}", body) + "\n" for i in range(20_000)))
    tracemalloc.start()
    try:
        scan = scan_stream(path, "j")
        assert sum(1 for _ in scan.lines_from(0)) == 20_000
        streamed = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        assert scan_file(path, "j").total == 20_000
        whole = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = path.stat().st_size
    print(
        f"file {size / 1e6:.1f} MB: streamed peak {streamed / 1e6:.1f} MB, whole {whole / 1e6:.1f} MB"
    )
    assert streamed < size and whole > 10 * streamed
