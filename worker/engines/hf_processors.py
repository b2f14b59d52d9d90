"""transformers logits processors and stopping criteria that give the CPU engine vLLM's
sampling semantics (OpenAI penalties, logit_bias, allowed_token_ids, per-row max_tokens).
torch is imported inside each call, so importing this module needs no torch."""

from __future__ import annotations

from typing import Any

__all__ = ["BiasAndMask", "OpenAIPenalties", "PerRowMaxTokens"]


class PerRowMaxTokens:
    """Retires each row at its own max_tokens, so the batch stops when every row is done."""

    def __init__(self, prompt_width: int, limits: list[int]) -> None:
        import torch

        self.prompt_width = prompt_width
        self.limits = torch.tensor(limits, dtype=torch.long)

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        generated = input_ids.shape[1] - self.prompt_width
        return (generated >= self.limits).to(input_ids.device)


class BiasAndMask:
    """OpenAI `logit_bias` (added to the logits) and vLLM `allowed_token_ids` (all other ids
    masked), applied before sampling."""

    def __init__(
        self, bias: tuple[tuple[int, float], ...], allowed: tuple[int, ...] | None
    ) -> None:
        self.bias = bias
        self.allowed = allowed

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if self.allowed is not None:
            mask = torch.full_like(scores, float("-inf"))
            mask[:, list(self.allowed)] = 0.0
            scores = scores + mask
        if self.bias:
            ids = torch.tensor([tid for tid, _ in self.bias], device=scores.device)
            values = torch.tensor(
                [b for _, b in self.bias], dtype=scores.dtype, device=scores.device
            )
            scores = scores.clone()
            scores[:, ids] += values
        return scores


class OpenAIPenalties:
    """OpenAI presence/frequency penalties over the tokens generated so far."""

    def __init__(self, prompt_width: int, presence: float, frequency: float) -> None:
        self.prompt_width = prompt_width
        self.presence = presence
        self.frequency = frequency

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        generated = input_ids[:, self.prompt_width :]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
