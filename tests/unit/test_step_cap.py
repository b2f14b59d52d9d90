"""The vLLM step cap (worker/engines/step_cap.py), without vLLM: the pure budget rules, and
the mixin in front of a stand-in scheduler that records what each step was allowed; the
factory that picks vLLM's asynchronous or synchronous base, with stand-in vLLM modules."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from worker.engines.step_cap import (
    STEP_TOKENS_ARG,
    LiveCaps,
    StepCapMixin,
    chunk_threshold,
    prefilling,
    requested_cap,
    step_budget,
    step_order,
)


@pytest.mark.parametrize(
    ("extra", "cap"),
    [
        (None, None),
        ({}, None),
        ({STEP_TOKENS_ARG: 512}, 512),
        ({STEP_TOKENS_ARG: 0}, None),
        ({STEP_TOKENS_ARG: -4}, None),
        ({STEP_TOKENS_ARG: True}, None),
        ({STEP_TOKENS_ARG: "512"}, None),
        ({"other": 1}, None),
    ],
)
def test_requested_cap(extra: Any, cap: int | None) -> None:
    assert requested_cap(extra) == cap


def test_budget_and_chunk_rules() -> None:
    assert step_budget(16384, 300, None) == 16384
    assert step_budget(16384, 300, 512) == 812  # every decode plus 512 of prefill
    assert step_budget(16384, 300, 512, prefilling=2) == 300 + 3 * 512  # theirs on top
    assert step_budget(2048, 4000, 512) == 2048  # never above vLLM's own budget
    assert chunk_threshold(0, 512) == 512
    assert chunk_threshold(256, 512) == 256
    assert chunk_threshold(4096, 512) == 512


def test_a_capped_step_serves_protected_then_decoding_then_bulk_chunks() -> None:
    b0, b1 = FakeRequest("b0", is_prefill_chunk=True), FakeRequest("b1")
    b2, b3 = FakeRequest("b2", is_prefill_chunk=True), FakeRequest("b3")
    i0, i1 = FakeRequest("i0", is_prefill_chunk=True), FakeRequest("i1")
    running = [b0, i1, b1, b2, i0, b3]
    assert step_order(running, {"i0", "i1"}) == [i1, i0, b1, b3, b0, b2]
    assert step_order([i1, i0, b1, b3, b0, b2], {"i0", "i1"}) is None
    assert step_order([b1, b0], {"i0"}) is None


def test_what_counts_as_still_prefilling() -> None:
    assert prefilling(FakeRequest("new", num_computed_tokens=0))  # waiting, nothing computed
    assert prefilling(FakeRequest("chunk", num_computed_tokens=256, is_prefill_chunk=True))
    assert not prefilling(FakeRequest("decoding", num_prompt_tokens=300, num_computed_tokens=310))


def test_live_caps_drop_finished_requests() -> None:
    caps = LiveCaps()
    caps.add("a", 512)
    caps.add("b", 256)
    assert caps.current({"a", "b", "x"}) == 256
    assert caps.current({"a", "x"}) == 512 and len(caps) == 1
    assert caps.current({"x"}) is None and len(caps) == 0


@dataclass
class Config:
    long_prefill_token_threshold: int = 0
    max_num_batched_tokens: int = 16384
    enable_chunked_prefill: bool = True


@dataclass(eq=False)
class FakeRequest:
    request_id: str
    extra_args: dict[str, Any] | None = None
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 1
    """Running and decoding unless a test says otherwise."""
    spec_token_ids: list[int] = field(default_factory=list)
    is_prefill_chunk: bool = False
    sampling_params: Any = None

    def __post_init__(self) -> None:
        self.sampling_params = SimpleNamespace(extra_args=self.extra_args)


@dataclass
class FakeScheduler:
    """vLLM's attributes the mixin touches; `schedule` records what the step may use."""

    max_num_scheduled_tokens: int = 16384
    scheduler_config: Config = field(default_factory=Config)
    requests: dict[str, Any] = field(default_factory=dict)
    running: list[Any] = field(default_factory=list)
    steps: list[tuple[int, int]] = field(default_factory=list)

    def add_request(self, request: Any) -> None:
        self.requests[request.request_id] = request
        self.running.append(request)

    def finish(self, request_id: str) -> None:
        request = self.requests.pop(request_id)
        self.running.remove(request)

    def schedule(self, throttle_prefills: bool = False) -> str:
        threshold = self.scheduler_config.long_prefill_token_threshold
        self.steps.append((self.max_num_scheduled_tokens, threshold))
        return "output"


class Capped(StepCapMixin, FakeScheduler):
    pass


@dataclass
class MambaScheduler(FakeScheduler):
    need_mamba_block_aligned_split: bool = True


class CappedMamba(StepCapMixin, MambaScheduler):
    pass


def test_steps_are_capped_only_while_a_first_lane_request_is_live_beside_others() -> None:
    sched = Capped()
    base = sched.scheduler_config
    for i in range(300):
        sched.add_request(FakeRequest(f"bulk-{i}"))
    assert sched.schedule() == "output"
    sched.add_request(FakeRequest("i-1", {STEP_TOKENS_ARG: 512}))
    sched.schedule(throttle_prefills=True)
    assert sched.scheduler_config is not base and base.long_prefill_token_threshold == 0
    sched.finish("i-1")
    sched.schedule()
    assert sched.steps == [(16384, 0), (301 + 512, 512), (16384, 0)]
    assert sched.scheduler_config is base  # vLLM's own config back once it left


def test_a_protected_prefill_is_served_first_with_its_own_allowance() -> None:
    sched = Capped()
    for i in range(10):
        chunk = i % 3 == 0
        sched.add_request(FakeRequest(f"bulk-{i}", num_computed_tokens=512, is_prefill_chunk=chunk))
    protected = FakeRequest("i-1", {STEP_TOKENS_ARG: 256}, num_computed_tokens=0)
    sched.add_request(protected)
    running = sched.running
    sched.schedule()
    assert sched.running is running and sched.running[0] is protected  # moved in place
    chunks = [r.request_id for r in sched.running if r.is_prefill_chunk]
    assert [r.request_id for r in sched.running[-len(chunks) :]] == chunks  # bulk chunks last
    protected.num_computed_tokens = 301  # its prompt is in: decoding now
    sched.schedule()
    assert sched.steps == [(11 + 256 * 2, 256), (11 + 256, 256)]


def test_no_cap_where_vllm_must_not_chunk() -> None:
    for sched in (Capped(scheduler_config=Config(enable_chunked_prefill=False)), CappedMamba()):
        sched.add_request(FakeRequest("bulk-0"))
        sched.add_request(FakeRequest("i-1", {STEP_TOKENS_ARG: 128}))
        sched.schedule()
        assert sched.steps == [(16384, 0)]


def test_draft_tokens_of_speculative_decoding_count_as_decodes() -> None:
    sched = Capped()
    sched.add_request(FakeRequest("bulk-0", spec_token_ids=[1, 2, 3]))
    sched.add_request(FakeRequest("i-1", {STEP_TOKENS_ARG: 128}, spec_token_ids=[4, 5]))
    sched.schedule()
    assert sched.steps == [((1 + 3) + (1 + 2) + 128, 128)]


def test_only_first_lane_requests_live_means_no_cap() -> None:
    sched = Capped()
    sched.add_request(FakeRequest("i-1", {STEP_TOKENS_ARG: 512}))
    sched.add_request(FakeRequest("i-2", {STEP_TOKENS_ARG: 256}))
    sched.schedule()
    sched.add_request(FakeRequest("bulk-0"))
    sched.schedule()
    assert sched.steps == [(16384, 0), (3 + 256, 256)]


def test_a_configured_chunk_threshold_is_kept_when_smaller() -> None:
    sched = Capped(scheduler_config=Config(long_prefill_token_threshold=128))
    sched.add_request(FakeRequest("bulk-0"))
    sched.add_request(FakeRequest("i-1", {STEP_TOKENS_ARG: 512}))
    sched.schedule()
    sched.finish("i-1")
    sched.schedule()
    assert sched.steps == [(2 + 512, 128), (16384, 128)]


def test_the_factory_follows_the_engines_async_scheduling(monkeypatch: pytest.MonkeyPatch) -> None:
    class Scheduler(FakeScheduler):
        def __init__(self, *, vllm_config: Any, **_: Any) -> None:
            super().__init__()

    class AsyncScheduler(Scheduler):
        pass

    for name, attr, cls in (
        ("vllm.v1.core.sched.scheduler", "Scheduler", Scheduler),
        ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler", AsyncScheduler),
    ):
        module = ModuleType(name)
        setattr(module, attr, cls)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "worker.engines.vllm_lane_scheduler", raising=False)
    lane = importlib.import_module("worker.engines.vllm_lane_scheduler")
    try:
        for asynchronous, base in ((True, AsyncScheduler), (False, Scheduler)):
            config = SimpleNamespace(
                scheduler_config=SimpleNamespace(async_scheduling=asynchronous)
            )
            made = lane.LaneScheduler(vllm_config=config, kv_cache_config=None)
            assert isinstance(made, base) and isinstance(made, StepCapMixin)
            assert isinstance(made, AsyncScheduler) is asynchronous
            made.add_request(FakeRequest("bulk"))
            made.add_request(FakeRequest("i", {STEP_TOKENS_ARG: 64}))
            made.schedule()
            assert made.steps == [(2 + 64, 64)]
    finally:
        sys.modules.pop("worker.engines.vllm_lane_scheduler", None)
