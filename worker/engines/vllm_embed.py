"""`vllm` with `--task embed`: vLLM's pooling runner.

The model loads with `runner="pooling", convert="embed"`: a causal LM such as
Qwen3-Embedding (or a Qwen3 checkpoint standing in for one) gets vLLM's embedding adapter,
which pools the last token's hidden state and normalises it. Each input of a request is
one vLLM pooling request (`AsyncLLM.encode`, task "embed"), so vLLM batches inputs of
many requests together at the token level, as it does for generation; `dimensions` is
vLLM's own Matryoshka truncation, which it refuses for a model not trained for it (the
renderer refuses first, from the same config keys: `EmbeddingShape`).

Static mode runs a micro-batch's inputs in one `LLM.embed` call (the baseline).
The event loop, thread, cancelling and lifecycle are the generate engine's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog

from schemas.endpoints import Task
from worker.engines.base import EmbeddingShape, EmbedSpec, EngineOutput, EngineRequest, OnDone
from worker.engines.vllm_engine import VllmEngine, describe_error, engine_kwargs

if TYPE_CHECKING:
    from worker.config import WorkerSettings

__all__ = ["VllmEmbedder", "embed_kwargs"]

log = structlog.get_logger("qbatch.engine.vllm_embed")


def embed_kwargs(settings: WorkerSettings) -> dict[str, Any]:
    """The generate engine's arguments with vLLM's pooling runner; the step cap's scheduler
    is left out (an embedding is one prefill: there is no decode to protect)."""
    kwargs = engine_kwargs(settings)
    kwargs.pop("scheduler_cls", None)
    kwargs.setdefault("runner", "pooling")
    kwargs.setdefault("convert", "embed")  # setdefault: `--engine-args` may say otherwise
    return kwargs


def _pooling_params(spec: EmbedSpec) -> Any:
    from vllm import PoolingParams

    return PoolingParams(task="embed", dimensions=spec.dimensions)


def _inputs(spec: EmbedSpec) -> list[dict[str, Any]]:
    return [
        {"prompt_token_ids": item} if isinstance(item, list) else {"prompt": item}
        for item in spec.inputs
    ]


def _vector(result: Any) -> list[float]:
    data = result.outputs.data if hasattr(result.outputs, "data") else result.outputs.embedding
    return [float(x) for x in (data.tolist() if hasattr(data, "tolist") else data)]


class VllmEmbedder(VllmEngine):
    supported_tasks = frozenset({Task.embed})

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> VllmEmbedder:
        return cls(embed_kwargs(settings), mode=settings.engine_mode)

    def _start(self) -> None:
        super()._start()
        model_config = (
            self._llm.model_config
            if self.mode == "continuous"
            else self._llm.llm_engine.model_config
        )
        self.embedding_shape = EmbeddingShape.of_config(
            model_config.hf_config, int(model_config.embedding_size)
        )

    def _run_static_batch(self, batch: Sequence[EngineRequest], on_done: OnDone) -> None:
        """A micro-batch's inputs in one `LLM.embed` call (which takes no priorities: lanes
        order only the micro-batches in static mode). When that call fails, each request
        runs alone, so one bad request fails only itself."""
        ready = [r for r in batch if r.embed is not None]
        for request in batch:
            if request.embed is None:
                on_done(_not_embed(request))
        try:
            outputs = self._embed_together(ready)
        except Exception as exc:
            if len(ready) == 1:
                log.exception("vllm_static_embed_failed", size=1)
                on_done(_failed(ready[0], exc))
                return
            for request in ready:
                self._run_static_batch([request], on_done)
            return
        for output in outputs:
            on_done(output)

    def _embed_together(self, ready: list[EngineRequest]) -> list[EngineOutput]:
        prompts: list[dict[str, Any]] = []
        params: list[Any] = []
        for request in ready:
            assert request.embed is not None
            prompts += _inputs(request.embed)
            params += [_pooling_params(request.embed)] * len(request.embed.inputs)
        results = self._llm.embed(prompts, pooling_params=params, use_tqdm=False)
        outputs, at = [], 0
        for request in ready:
            assert request.embed is not None
            mine = results[at : at + len(request.embed.inputs)]
            at += len(mine)
            tokens = sum(len(r.prompt_token_ids) for r in mine)
            vectors = [_vector(r) for r in mine]
            outputs.append(EngineOutput(request.key, "", tokens, 0, "stop", embeddings=vectors))
        return outputs

    async def _generate(self, request: EngineRequest, on_done: OnDone) -> None:
        """Every input of the request as one vLLM pooling request, awaited together; a
        cancel (`abort`) cancels them all, and vLLM aborts each."""
        spec = request.embed
        if spec is None:
            on_done(_not_embed(request))
            return
        params = _pooling_params(spec)
        parts = [
            asyncio.ensure_future(
                self._encode_one(prompt, params, f"{request.key}#{i}", request.priority)
            )
            for i, prompt in enumerate(_inputs(spec))
        ]
        try:
            finals = await asyncio.gather(*parts)
        except BaseException as exc:
            # gather passes the first failure on and leaves the other inputs running in
            # vLLM: stop them all (vLLM aborts each) before the request is answered
            for part in parts:
                part.cancel()
            await asyncio.gather(*parts, return_exceptions=True)
            if isinstance(exc, asyncio.CancelledError):
                on_done(EngineOutput(request.key, "", 0, 0, "abort"))
            elif isinstance(exc, Exception):
                on_done(_failed(request, exc))
            else:
                raise
            return
        try:
            tokens = sum(len(final.prompt_token_ids) for final in finals)
            output = EngineOutput(
                request.key, "", tokens, 0, "stop", embeddings=[_vector(f) for f in finals]
            )
        except Exception as exc:  # an odd output must still answer its request
            output = _failed(request, exc)
        on_done(output)

    async def _encode_one(
        self, prompt: dict[str, Any], params: Any, request_id: str, priority: int
    ) -> Any:
        final = None
        async for output in self._llm.encode(prompt, params, request_id, priority=priority):
            final = output
        if final is None:
            raise RuntimeError("engine returned nothing")
        return final


def _failed(request: EngineRequest, exc: BaseException) -> EngineOutput:
    return EngineOutput(request.key, "", 0, 0, "error", error=describe_error(exc))


def _not_embed(request: EngineRequest) -> EngineOutput:
    return EngineOutput(
        request.key,
        "",
        0,
        0,
        "error",
        error="this engine embeds (--task embed); it generates nothing",
    )
