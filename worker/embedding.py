"""Vector arithmetic every embed engine shares, kept apart from any model: L2
normalisation, Matryoshka truncation, and the echo engine's deterministic vectors.

Qwen3-Embedding (and vLLM's pooling runner for it) pools the last token's hidden state and
normalises it; asked for fewer `dimensions`, vLLM keeps the first N components and
normalises again. The CPU and echo engines do the same, so a caller sees the same shape
whichever engine answered.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence


def normalized(vector: Sequence[float]) -> list[float]:
    """`vector` scaled to unit length (a zero vector stays zero)."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    if norm == 0.0:
        return [0.0] * len(vector)
    return [x / norm for x in vector]


def shortened(vector: Sequence[float], dimensions: int | None) -> list[float]:
    """Matryoshka truncation: the first `dimensions` components, normalised again."""
    if dimensions is None or dimensions >= len(vector):
        return normalized(vector)
    return normalized(vector[:dimensions])


def echo_vector(item: str | Sequence[int], size: int) -> list[float]:
    """A deterministic unit vector of `size` for one input: equal inputs give equal
    vectors, different inputs almost surely different ones (SHA-256 in counter mode)."""
    seed = item.encode() if isinstance(item, str) else struct.pack(f"<{len(item)}Q", *item)
    digest = hashlib.sha256(seed).digest()
    values: list[float] = []
    block = 0
    while len(values) < size:
        chunk = hashlib.sha256(digest + block.to_bytes(8, "little")).digest()
        values.extend((b - 127.5) / 127.5 for b in chunk)
        block += 1
    return normalized(values[:size])


__all__ = ["echo_vector", "normalized", "shortened"]
