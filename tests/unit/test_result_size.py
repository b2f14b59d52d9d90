"""The result-size bound (issue 40): known before a request runs, refused at the edge
naming the field that makes it large, and enforced again on what comes out."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from kafka.structs import TopicPartition

from schemas import ContractError, ErrorCode, Status, decode_request
from schemas.result_size import (
    DEFAULT_MAX_RESULT_BYTES,
    LOGPROB_BYTES_PER_ENTRY,
    RESULT_OVERHEAD_BYTES,
    TEXT_BYTES_PER_TOKEN,
    ResultSize,
)
from tests.unit.test_writer import Store, make
from worker.engines.echo import echo_output
from worker.records import Finished, Inbound, Running
from worker.rendering import PromptRenderer
from worker.result_budget import ResultBudget

TP = TopicPartition("t", 0)


def envelope(rid: str = "r1", **body: Any) -> Any:
    data = {"request_id": rid, "body": {"messages": [{"role": "user", "content": "hi"}], **body}}
    return decode_request(json.dumps(data).encode(), rid.encode())


def test_the_estimate_counts_choices_tokens_and_logprob_entries() -> None:
    plain = ResultSize(1, 1000, None)
    assert plain.bytes == RESULT_OVERHEAD_BYTES + 1000 * TEXT_BYTES_PER_TOKEN
    attack = ResultSize(16, 2000, 20)  # the 8 KB request: ~46 MB measured
    per_token = TEXT_BYTES_PER_TOKEN + 21 * LOGPROB_BYTES_PER_ENTRY
    assert attack.bytes == RESULT_OVERHEAD_BYTES + 16 * 2000 * per_token
    assert 40_000_000 < attack.bytes < 60_000_000


@pytest.mark.parametrize(
    ("size", "param"),
    [
        (ResultSize(16, 2000, 20), "body.top_logprobs"),
        (ResultSize(1, 300_000, 0), "body.logprobs"),
        (ResultSize(16, 200_000, None), "body.n"),
        (ResultSize(1, 3_000_000, None), "body.max_completion_tokens"),
    ],
)
def test_a_result_too_large_names_the_field_that_makes_it_so(size: ResultSize, param: str) -> None:
    with pytest.raises(ContractError) as caught:
        size.check(DEFAULT_MAX_RESULT_BYTES, max_param="body.max_completion_tokens")
    assert caught.value.code is ErrorCode.result_too_large and caught.value.param == param
    assert "max_result_bytes" in caught.value.message


def test_the_renderer_refuses_before_the_request_runs() -> None:
    renderer = PromptRenderer(None, max_model_len=32_768, served_names={"m"})
    attack = envelope(n=16, max_tokens=2000, logprobs=True, top_logprobs=20)
    with pytest.raises(ContractError) as caught:
        renderer.render(attack)
    assert caught.value.param == "body.top_logprobs"
    ok = renderer.render(envelope(max_tokens=100))
    assert ok.result_bytes == ResultSize(1, 100, None).bytes
    # no max_tokens: the budget is what the context leaves, cut to fit (never refused)
    assert renderer.render(envelope()).sampling.max_tokens == 32_768 - 1
    clamped = renderer.render(envelope(n=3, logprobs=True, top_logprobs=5))
    assert clamped.result_bytes <= DEFAULT_MAX_RESULT_BYTES
    assert 10_000 < clamped.sampling.max_tokens < 32_767


def test_a_result_that_comes_out_too_large_is_answered_not_written() -> None:
    """The estimate passed (the renderer's bound is the default 16 MiB) but the output is
    over the writer's 100 KB (the echo engine answers with the prompt, up to max_tokens
    words: 200 KB here): `result_too_large`, small, and written."""
    env = envelope(
        "big", max_tokens=100_000, messages=[{"role": "user", "content": "x " * 300_000}]
    )
    rendered = PromptRenderer(None, max_model_len=1_000_000, served_names={"m"}).render(env)
    output = echo_output(rendered.engine_request("big"))
    store = Store()
    budget = ResultBudget(10**9)
    budget.reserve(rendered.result_bytes)
    writer, done, _ = make(store, max_result_bytes=100_000, budget=budget)
    writer.inbox.put(Finished(Running(Inbound(TP, 3, None, env, 0), rendered, 0), output, 1))  # type: ignore[arg-type]
    writer.inbox.put(None)
    writer.run()
    result = store.written["big"]
    assert result.status is Status.failed and result.error is not None
    assert result.error.code is ErrorCode.result_too_large
    assert len(result.model_dump_json()) < 10_000
    assert done == [[(TP, 3, 0)]] and budget.used == 0  # written, and its reservation freed


def test_the_budget_waits_for_room_and_always_lets_one_through() -> None:
    budget = ResultBudget(100)
    assert budget.reserve(500)  # alone: over the limit, but it runs
    got = threading.Event()
    waiter = threading.Thread(target=lambda: (budget.reserve(10), got.set()))
    waiter.start()
    assert not got.wait(0.3)  # no room while the 500 are held
    budget.release(500)
    assert got.wait(5)
    waiter.join()
    assert budget.used == 10
    assert not budget.reserve(200, stopping=lambda: True)  # stopping: nothing taken
    assert budget.used == 10
