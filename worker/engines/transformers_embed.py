"""`transformers` with `--task embed`: last-token pooling on the CPU, as vLLM's pooling
runner does for Qwen3-Embedding.

The model is loaded without its language-model head (`AutoModel`); each input's vector
is the final hidden state of its last token, L2-normalised, and cut to `dimensions`
(Matryoshka, where the model's config says it was trained for it: `is_matryoshka`,
`matryoshka_dimensions`, the keys vLLM reads). A micro-batch's inputs run together, in
slices of similar length, left-padded, with position ids counted from each input's own
first token, so an input's vector does not depend on its batch-mates.

The queue, thread and lifecycle are the generate engine's (`TransformersEngine`).
"""

from __future__ import annotations

from typing import Any

from schemas.endpoints import Task
from worker.embedding import shortened
from worker.engines.base import EmbeddingShape, EngineOutput, EngineRequest, OnDone
from worker.engines.transformers_engine import TransformersEngine, _deliver, _error

__all__ = ["TransformersEmbedder"]

ROWS_PER_FORWARD = 16
"""Inputs in one forward pass: bounds the padded activations a micro-batch allocates."""


class TransformersEmbedder(TransformersEngine):
    name = "transformers"
    supported_tasks = frozenset({Task.embed})

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        super().__init__(model_path, **kwargs)
        hidden = int(self._text_config.hidden_size)
        self.embedding_shape = EmbeddingShape.of_config(self._config, hidden)

    def _model_class(self) -> Any:
        """The model without its language-model head: the final hidden states."""
        from transformers import AutoModel

        return AutoModel

    def _prepare(self, model: Any) -> None:
        """Nothing to set: an embedder generates nothing."""

    def _run_batch(self, batch: list[EngineRequest], on_done: OnDone) -> None:
        rows: list[tuple[int, int, list[int]]] = []  # (request, input, ids)
        ready: list[EngineRequest] = []
        for request in batch:
            problem = self._problem(request)
            if problem is not None:
                _deliver(on_done, _error(request, problem))
                continue
            assert request.embed is not None
            for index, item in enumerate(request.embed.inputs):
                rows.append((len(ready), index, list(item)))  # type: ignore[arg-type]
            ready.append(request)
        vectors: list[dict[int, list[float]]] = [{} for _ in ready]
        rows.sort(key=lambda row: len(row[2]))  # similar lengths pad little
        for start in range(0, len(rows), ROWS_PER_FORWARD):
            chunk = rows[start : start + ROWS_PER_FORWARD]
            pooled = self._pool([ids for _, _, ids in chunk])
            for (owner, index, _), vector in zip(chunk, pooled, strict=True):
                vectors[owner][index] = vector
        for owner, request in enumerate(ready):
            assert request.embed is not None
            spec = request.embed
            out = [shortened(vectors[owner][i], spec.dimensions) for i in range(len(spec.inputs))]
            tokens = sum(len(item) for item in spec.inputs)
            _deliver(on_done, EngineOutput(request.key, "", tokens, 0, "stop", embeddings=out))

    def _problem(self, request: EngineRequest) -> str | None:
        if request.embed is None:
            return "this engine embeds (--task embed); it runs no generation"
        for item in request.embed.inputs:
            if not isinstance(item, list):
                return "an embed engine with a tokenizer takes token ids"
            if len(item) > self.max_model_len:
                return f"an input of {len(item)} tokens is over max_model_len {self.max_model_len}"
        return None

    def _pool(self, inputs: list[list[int]]) -> list[list[float]]:
        """The last token's final hidden state of each input (left-padded together)."""
        import torch

        width = max(len(ids) for ids in inputs)
        ids = torch.full((len(inputs), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), width), dtype=torch.long)
        for row, item in enumerate(inputs):
            ids[row, width - len(item) :] = torch.tensor(item, dtype=torch.long)
            mask[row, width - len(item) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            hidden = self._model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
            ).last_hidden_state
        last = hidden[:, -1, :].float().cpu()
        return [row.tolist() for row in last]
