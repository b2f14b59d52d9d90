"""A cap on the tokens of a vLLM step while a first-lane request is live.

Why: on the H100 (RESULTS.md, 2026-12-07) interactive requests under a bulk job spent
their time in `generation`, not in a queue: every running sequence shares each engine
step, and a step that also carries up to `max_num_batched_tokens` (16,384) of the job's
prefill takes tens of times the idle step. vLLM's priority policy orders its waiting queue
and picks whom to preempt, but it fills every step to the full budget whoever runs.

So a first-lane request carries the cap it wants (`extra_args[STEP_TOKENS_ARG]`, set by
the vLLM engine from `QBATCH_INTERACTIVE_STEP_TOKENS`), and while one is live in the
engine (waiting or running) and other requests share it, each step schedules at most
`running + cap` tokens, plus `cap` more for each protected request still in its prefill,
and no prefill chunk longer than `cap`: the decodes of every running sequence still go in,
bulk prefill goes on at most `cap` tokens a step (a protected request's allowance it
cannot use, e.g. waiting for its grammar, goes to bulk too: at most `cap` times one plus
the protected requests prefilling). vLLM serves running requests in list order, each chunk
taking what the budget has left, then the waiting queue (where the priority policy puts
protected requests first); so for a capped step the running list is put in the order
protected, decoding, bulk prefill chunks (stable within each, in place): a decode is never
left without its token behind two bulk chunks, and a protected request's own prefill never
waits for a bulk chunk ahead of it (measured on the H100 before that order: interactive
requests waited ~0.7 s in vLLM's queue and ~0.8 s in prefill at cap 256). The price is bulk
prefill throughput while interactive requests run, measured in RESULTS.md.

Not applied (vLLM's own steps) where chunked prefill is off, since a cap would chunk
prompts vLLM must not chunk, or where a hybrid model aligns chunks to Mamba blocks, since
a cap under the block size would round every chunk to nothing.

Pure (no vLLM import): `StepCapMixin` wraps any class with vLLM's scheduler attributes
(`schedule`, `add_request`, `requests`, `running`, `max_num_scheduled_tokens`,
`scheduler_config`); `worker.engines.vllm_lane_scheduler` puts it in front of vLLM's.
"""

from __future__ import annotations

import copy
from collections.abc import Container, Mapping
from typing import Any

STEP_TOKENS_ARG = "qbatch_step_tokens"
"""The `SamplingParams.extra_args` key a request's cap travels under."""


def requested_cap(extra_args: Mapping[str, Any] | None) -> int | None:
    """The cap a request asks for, or None (none asked, or not a positive int)."""
    if not extra_args:
        return None
    value = extra_args.get(STEP_TOKENS_ARG)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def step_budget(full_budget: int, running: int, cap: int | None, prefilling: int = 0) -> int:
    """Tokens one step may schedule: every running sequence's next tokens (`running`), `cap`
    for bulk prefill and `cap` for each of the `prefilling` protected requests."""
    if cap is None:
        return full_budget
    return min(full_budget, running + cap * (1 + prefilling))


def step_order(running: list[Any], protected: Container[str]) -> list[Any] | None:
    """`running` in the order a capped step serves it: protected requests, then the other
    decoding ones, then the other prefill chunks (stable within each); None when it is in
    that order already (the common case: nothing to rewrite)."""
    front, decoding, chunks = [], [], []
    for request in running:
        if request.request_id in protected:
            front.append(request)
        elif getattr(request, "is_prefill_chunk", False):
            chunks.append(request)
        else:
            decoding.append(request)
    ordered = front + decoding + chunks
    if all(a is b for a, b in zip(ordered, running, strict=True)):
        return None
    return ordered


def next_tokens(running: list[Any]) -> int:
    """What the running sequences' decodes take in a step: one token each, plus its draft
    tokens under speculative decoding (vLLM's `spec_token_ids`)."""
    return sum(1 + len(getattr(r, "spec_token_ids", None) or ()) for r in running)


def prefilling(request: Any) -> bool:
    """Still computing its prompt: a running one part way through it (vLLM's
    `is_prefill_chunk`), or one waiting with nothing computed (new, or preempted and to
    recompute)."""
    if getattr(request, "is_prefill_chunk", False):
        return True
    return int(getattr(request, "num_computed_tokens", 0)) == 0


def chunk_threshold(configured: int, cap: int) -> int:
    """The longest prefill chunk a capped step takes (vLLM's `long_prefill_token_threshold`,
    0 meaning none)."""
    return cap if configured <= 0 else min(configured, cap)


class LiveCaps:
    """The caps of live requests, by vLLM request id; dead ones are dropped as they are seen."""

    def __init__(self) -> None:
        self._caps: dict[str, int] = {}

    def add(self, request_id: str, cap: int) -> None:
        self._caps[request_id] = cap

    def __len__(self) -> int:
        return len(self._caps)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._caps

    def ids(self) -> list[str]:
        return list(self._caps)

    def current(self, live: Container[str]) -> int | None:
        """The smallest cap among requests still in `live`, or None."""
        if not self._caps:
            return None
        dead = [rid for rid in self._caps if rid not in live]
        for rid in dead:
            del self._caps[rid]
        return min(self._caps.values(), default=None)


class StepCapMixin:
    """Put before a vLLM scheduler class in the bases: applies the live requests' caps to
    each step (see the module docstring)."""

    requests: dict[str, Any]
    running: list[Any]
    max_num_scheduled_tokens: int
    scheduler_config: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._qbatch_caps = LiveCaps()
        self._qbatch_full_budget = self.max_num_scheduled_tokens
        self._qbatch_config = self.scheduler_config
        self._qbatch_capped_configs: dict[int, Any] = {}
        self._qbatch_applies = bool(
            getattr(self.scheduler_config, "enable_chunked_prefill", True)
        ) and not getattr(self, "need_mamba_block_aligned_split", False)

    def add_request(self, request: Any) -> None:
        super().add_request(request)  # type: ignore[misc]
        params = getattr(request, "sampling_params", None)
        cap = requested_cap(getattr(params, "extra_args", None))
        if cap is not None:
            self._qbatch_caps.add(request.request_id, cap)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        cap = self._qbatch_caps.current(self.requests) if self._qbatch_applies else None
        if cap is not None and len(self.requests) <= len(self._qbatch_caps):
            cap = None  # only protected requests are live: nothing to hold back
        pending, decodes = 0, len(self.running)
        if cap is not None:
            reordered = step_order(self.running, self._qbatch_caps)
            if reordered is not None:
                self.running[:] = reordered
            pending = sum(prefilling(self.requests[rid]) for rid in self._qbatch_caps.ids())
            decodes = next_tokens(self.running)
        full = self._qbatch_full_budget
        self.max_num_scheduled_tokens = step_budget(full, decodes, cap, pending)
        self.scheduler_config = self._qbatch_config if cap is None else self._capped_config(cap)
        return super().schedule(*args, **kwargs)  # type: ignore[misc]

    def _capped_config(self, cap: int) -> Any:
        config = self._qbatch_capped_configs.get(cap)
        if config is None:
            if len(self._qbatch_capped_configs) >= 16:  # caps come from workers' settings
                self._qbatch_capped_configs.clear()
            config = copy.copy(self._qbatch_config)
            threshold = chunk_threshold(self._qbatch_config.long_prefill_token_threshold, cap)
            object.__setattr__(config, "long_prefill_token_threshold", threshold)
            self._qbatch_capped_configs[cap] = config
        return config


__all__ = [
    "STEP_TOKENS_ARG",
    "LiveCaps",
    "StepCapMixin",
    "chunk_threshold",
    "next_tokens",
    "prefilling",
    "requested_cap",
    "step_budget",
    "step_order",
]
