"""`vllm`: the production engine, on one or many tensor-parallel GPUs.

continuous (default): one `AsyncLLM` runs on an asyncio loop in its own
thread; every micro-batch is fed into it as it arrives, so vLLM's scheduler
batches at the token level across micro-batches and a long answer never holds
the GPU for the rest of its batch.

static: one blocking `LLM.generate` per micro-batch, the naive design, kept
as the baseline the benchmarks beat.

The engine is built with vLLM's `LLM_CLASS` usage context in both modes: an
offline batch service wants the offline class's scheduler limits (on an H200,
`max_num_seqs=1024`, `max_num_batched_tokens=16384`) rather than the smaller
defaults `AsyncLLM` otherwise takes, which cost ~10% throughput on workload W.
Explicit `--max-num-seqs` / `--max-num-batched-tokens` still win.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from worker.config import WorkerSettings
from worker.engines.base import (
    Engine,
    EngineFinish,
    EngineOutput,
    EngineRequest,
    EngineSample,
    EngineStats,
    OnDone,
    SamplingSpec,
    TokenLogprob,
)
from worker.engines.step_cap import STEP_TOKENS_ARG
from worker.engines.vllm_stats import (
    _StatsLogger,
    combined_stats,
    engine_times,
    kv_cache_tokens,
    max_num_seqs,
)
from worker.logs import log

LANE_SCHEDULER = "worker.engines.vllm_lane_scheduler.LaneScheduler"
"""vLLM's scheduler with the step cap (`scheduler_cls`; named, so vLLM's engine core imports
it and this module does not)."""

_PASS_THROUGH = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "max_model_len",
    "gpu_memory_utilization",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "block_size",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "load_format",
    "enforce_eager",
    "seed",
    "trust_remote_code",
    "tokenizer",
)


def engine_kwargs(settings: WorkerSettings) -> dict[str, Any]:
    """vLLM engine arguments from worker settings; None means "vLLM's default".

    Pure, so the argument flow (tensor parallelism included) is unit-tested
    without a GPU.
    """
    kwargs: dict[str, Any] = {"model": settings.model}
    for name in _PASS_THROUGH:
        value = getattr(settings, name)
        if value is not None:
            kwargs[name] = value
    kwargs["served_model_name"] = settings.served_name()
    kwargs["scheduling_policy"] = "priority"
    if settings.interactive_step_tokens > 0 and settings.engine_mode == "continuous":
        kwargs["scheduler_cls"] = LANE_SCHEDULER
    kwargs.update(settings.engine_args)
    return kwargs


def _config_objects(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`--engine-args` JSON gives config sections as dicts; `LLM` converts them itself,
    `AsyncEngineArgs` does not for every section, so the ones it leaves are made here."""
    section = kwargs.get("structured_outputs_config")
    if not isinstance(section, dict):
        return kwargs
    from vllm.config import StructuredOutputsConfig

    return {**kwargs, "structured_outputs_config": StructuredOutputsConfig(**section)}


def sampling_params(spec: SamplingSpec, step_tokens: int = 0) -> Any:
    """SamplingSpec -> vllm.SamplingParams, final output only (no per-token streaming);
    `step_tokens` > 0: the step cap this request asks for while it runs (step_cap.py)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    kwargs: dict[str, Any] = {
        "max_tokens": spec.max_tokens,
        "ignore_eos": spec.ignore_eos,
        "min_tokens": spec.min_tokens,
        "output_kind": RequestOutputKind.FINAL_ONLY,
        "stop": list(spec.stop) or None,
        "seed": spec.seed,
    }
    optional = (
        "temperature",
        "top_p",
        "top_k",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
        "repetition_penalty",
        "logprobs",
    )
    for name in optional:
        value = getattr(spec, name)
        if value is not None:
            kwargs[name] = value
    if spec.n > 1:
        kwargs["n"] = spec.n
    if spec.logit_bias:
        kwargs["logit_bias"] = dict(spec.logit_bias)
    if spec.stop_token_ids:
        kwargs["stop_token_ids"] = list(spec.stop_token_ids)
    if spec.include_stop_str_in_output:
        kwargs["include_stop_str_in_output"] = True
    if spec.allowed_token_ids is not None:
        kwargs["allowed_token_ids"] = list(spec.allowed_token_ids)
    if spec.bad_words:
        kwargs["bad_words"] = list(spec.bad_words)
    if spec.json_schema is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(json=spec.json_schema)
    elif spec.json_object:
        kwargs["structured_outputs"] = StructuredOutputsParams(json_object=True)
    elif spec.choice is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(choice=list(spec.choice))
    if step_tokens > 0:
        kwargs["extra_args"] = {STEP_TOKENS_ARG: step_tokens}
    return SamplingParams(**kwargs)


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return "unknown"


def describe_error(exc: BaseException) -> str:
    """The exception and its causes, outermost first.

    vLLM wraps engine failures in `EngineGenerateError` with an empty message; the reason
    is in its `__cause__` (seen on the H200: a structured-output request failed with
    nothing but "EngineGenerateError: " in its result).
    """
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(parts) < 5:
        seen.add(id(current))
        text = str(current)
        parts.append(f"{type(current).__name__}: {text}" if text else type(current).__name__)
        current = current.__cause__ or current.__context__
    return " <- ".join(parts)


def _finish(reason: str | None) -> EngineFinish:
    if reason == "length":
        return "length"
    if reason == "abort":
        return "abort"
    return "stop"


def token_logprobs(
    token_ids: Sequence[int], positions: Any, k: int, decode: Callable[[int], str]
) -> list[TokenLogprob]:
    """vLLM's per-position `{token_id: Logprob}` (the sampled token plus the top k, in any
    order; `FlatLogprobs` reads the same) -> `TokenLogprob`s, alternatives best first.
    `decode` names a token whose `decoded_token` vLLM left empty."""
    out: list[TokenLogprob] = []
    for token_id, position in zip(token_ids, positions, strict=False):
        entries = position or {}

        def text(tid: int, entry: Any) -> str:
            decoded = getattr(entry, "decoded_token", None)
            return decoded if decoded is not None else decode(tid)

        chosen = entries.get(token_id)
        ranked = sorted(entries.items(), key=lambda item: -item[1].logprob)[:k]
        out.append(
            TokenLogprob(
                token_id=int(token_id),
                token=text(token_id, chosen),
                logprob=float(chosen.logprob) if chosen is not None else float("-inf"),
                top=tuple((int(tid), text(tid, e), float(e.logprob)) for tid, e in ranked),
            )
        )
    return out


def _to_output(
    key: str, result: Any, k: int | None = None, decode: Callable[[int], str] = str
) -> EngineOutput:
    samples = []
    for completion in sorted(result.outputs, key=lambda c: c.index):
        ids = list(completion.token_ids)
        logprobs = None
        if k is not None and completion.logprobs is not None:
            logprobs = token_logprobs(ids, completion.logprobs, k, decode)
        samples.append(
            EngineSample(
                text=completion.text,
                completion_tokens=len(ids),
                finish=_finish(completion.finish_reason),
                token_ids=ids,
                logprobs=logprobs,
            )
        )
    output = EngineOutput.of_samples(
        key,
        samples,
        prompt_tokens=len(result.prompt_token_ids or ()),
        cached_tokens=getattr(result, "num_cached_tokens", None),
    )
    output.scheduled_ms, output.first_token_ms = engine_times(getattr(result, "metrics", None))
    return output


def _prompt(request: EngineRequest) -> Any:
    prompt: dict[str, Any]
    if request.prompt_token_ids is not None:
        prompt = {"prompt_token_ids": request.prompt_token_ids}
    else:
        prompt = {"prompt": request.prompt}
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt


class VllmEngine(Engine):
    name = "vllm"

    def __init__(
        self, kwargs: dict[str, Any], *, mode: str = "continuous", step_tokens: int = 0
    ) -> None:
        if mode not in ("continuous", "static"):
            raise ValueError(f"unknown engine mode {mode!r}")
        self.mode = mode
        self.step_tokens = step_tokens if kwargs.get("scheduler_cls") == LANE_SCHEDULER else 0
        """The step cap first-lane requests ask for (0: none); only the lane scheduler reads it."""
        self._kwargs = kwargs
        self._served_name = str(kwargs.get("served_model_name") or kwargs["model"])
        self._tokenizer: Any = None
        self._max_model_len = 0
        self._kv_cache_tokens: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._llm: Any = None
        self._thread: threading.Thread | None = None
        self._static_q: queue.Queue[tuple[Sequence[EngineRequest], OnDone] | None] = queue.Queue()
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._max_num_seqs: int | None = None
        self._scheduler_stats: dict[int, Any] = {}
        """vLLM engine index -> its last SchedulerStats (_StatsLogger writes them)."""

    def _fingerprint_parts(self) -> list[str]:
        names = (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "dtype",
            "quantization",
            "kv_cache_dtype",
            "load_format",
            "seed",
        )
        return [f"vllm={_vllm_version()}"] + [f"{name}={self._kwargs.get(name)}" for name in names]

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> VllmEngine:
        return cls(
            engine_kwargs(settings),
            mode=settings.engine_mode,
            step_tokens=settings.interactive_step_tokens,
        )

    # ------------------------------------------------------------------ start

    def _start(self) -> None:
        from transformers import AutoTokenizer

        from worker.rendering import load_generation_defaults

        source = self._kwargs.get("tokenizer") or self._kwargs["model"]
        self._tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=bool(self._kwargs.get("trust_remote_code"))
        )
        if Path(self._kwargs["model"]).is_dir():
            self._generation_defaults = load_generation_defaults(self._kwargs["model"])
        # Build the engine on the calling (main) thread, as vLLM expects; only the
        # event loop (continuous) or the blocking generate calls (static) live on
        # the engine thread. AsyncLLM starts its output handler lazily, inside our loop.
        if self.mode == "continuous":
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM

            self._llm = AsyncLLM.from_engine_args(
                AsyncEngineArgs(**_config_objects(self._kwargs)),
                usage_context=UsageContext.LLM_CLASS,
                stat_loggers=[self._stats_logger],
            )
            self._max_model_len = int(self._llm.model_config.max_model_len)
            self._kv_cache_tokens = kv_cache_tokens(getattr(self._llm, "vllm_config", None))
            self._max_num_seqs = max_num_seqs(getattr(self._llm, "vllm_config", None))
            self._loop = asyncio.new_event_loop()
            target = self._run_loop
        else:
            from vllm import LLM

            self._llm = LLM(**self._kwargs)
            self._max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
            self._kv_cache_tokens = kv_cache_tokens(
                getattr(self._llm.llm_engine, "vllm_config", None)
            )
            target = self._run_static
        self._thread = threading.Thread(target=target, name="qbatch-vllm", daemon=True)
        self._thread.start()
        log.info(
            "vllm_engine_ready",
            mode=self.mode,
            model=self._served_name,
            max_model_len=self._max_model_len,
            kv_cache_tokens=self._kv_cache_tokens,
            tensor_parallel_size=self._kwargs.get("tensor_parallel_size", 1),
        )

    def _run_loop(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _run_static(self) -> None:
        while True:
            item = self._static_q.get()
            if item is None:
                return
            batch, on_done = item
            self._run_static_batch(batch, on_done)

    def _run_static_batch(self, batch: Sequence[EngineRequest], on_done: OnDone) -> None:
        """One micro-batch as one blocking call (static mode)."""
        try:
            results = self._llm.generate(
                [_prompt(r) for r in batch],
                [sampling_params(r.sampling) for r in batch],
                use_tqdm=False,
                priority=[r.priority for r in batch],
            )
        except Exception as exc:
            log.exception("vllm_static_generate_failed", size=len(batch))
            for request in batch:
                on_done(EngineOutput(request.key, "", 0, 0, "error", error=str(exc)))
            return
        for request, result in zip(batch, results, strict=True):
            on_done(self._output(request, result))

    # ------------------------------------------------------------------ submit

    def submit(self, batch: Sequence[EngineRequest], on_done: OnDone) -> None:
        if self.mode == "static":
            self._static_q.put((list(batch), on_done))
            return
        assert self._loop is not None, "start() first"
        self._loop.call_soon_threadsafe(self._spawn, list(batch), on_done)

    def _spawn(self, batch: list[EngineRequest], on_done: OnDone) -> None:
        for request in batch:
            task = asyncio.ensure_future(self._generate(request, on_done))
            self._inflight[request.key] = task
            task.add_done_callback(functools.partial(self._forget, request.key))

    def _forget(self, key: str, _task: asyncio.Task[None]) -> None:
        self._inflight.pop(key, None)

    def abort(self, keys: Sequence[str]) -> None:
        """Cancel the requests' tasks on the engine's loop: vLLM's `generate` aborts a
        request whose consumer is cancelled (waiting or generating), and `_generate`
        answers it with finish "abort"."""
        if self.mode != "continuous" or self._loop is None:
            return
        wanted = list(keys)

        def cancel() -> None:
            for key in wanted:
                task = self._inflight.get(key)
                if task is not None:
                    task.cancel()

        self._loop.call_soon_threadsafe(cancel)

    def capacity(self) -> tuple[int | None, int | None]:
        if self.mode != "continuous":
            return None, None  # a static batch runs whole: nothing to keep room in
        return self._max_num_seqs, self._kv_cache_tokens

    async def _generate(self, request: EngineRequest, on_done: OnDone) -> None:
        final = None
        try:
            async for output in self._llm.generate(
                _prompt(request),
                sampling_params(request.sampling, self.step_tokens if request.first_lane else 0),
                request.key,
                priority=request.priority,
            ):
                final = output
        except asyncio.CancelledError:  # `abort`: vLLM has aborted the request
            on_done(EngineOutput(request.key, "", 0, 0, "abort"))
            return
        except Exception as exc:
            on_done(EngineOutput(request.key, "", 0, 0, "error", error=describe_error(exc)))
            return
        if final is None:
            on_done(EngineOutput(request.key, "", 0, 0, "error", error="engine returned nothing"))
            return
        try:
            output = self._output(request, final)
        except Exception as exc:  # an odd output must still answer its request
            output = EngineOutput(request.key, "", 0, 0, "error", error=describe_error(exc))
        on_done(output)

    def _output(self, request: EngineRequest, result: Any) -> EngineOutput:
        return _to_output(request.key, result, request.sampling.logprobs, self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return str(self._tokenizer.decode([token_id], skip_special_tokens=False))

    # ------------------------------------------------------------------ stats / close

    def _stats_logger(self, vllm_config: Any, engine_index: int = 0) -> _StatsLogger:
        """vLLM's per-engine stat-logger factory, bound to this engine's store."""
        return _StatsLogger(self._scheduler_stats, engine_index)

    def stats(self) -> EngineStats:
        stats = combined_stats(list(self._scheduler_stats.values()))
        stats.kv_cache_tokens = self._kv_cache_tokens
        return stats

    def close(self) -> None:
        if self.mode == "static":
            self._static_q.put(None)
        elif self._loop is not None and self._llm is not None:
            self._llm.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)
