"""The night of job families (issues 42 and 43): OpenAI Batch chat lines the way a night's
bulk jobs look, from a seed.

`families` families (300) of 1 to 16 lines, most small (sizes drawn with weight 0.8**k, then
moved a line at a time to total exactly `lines`, 1,438); each family shares one system prompt
of 700-2,400 words (one-token words: about as many tokens), a third of them with a tools
block; each line a user message of 40-250 words and 32-200 output tokens (`ignore_eos`);
the file shuffled. custom_id `n<family>-<k>`. Pure: the same seed gives the same lines.
"""

from __future__ import annotations

import random
from typing import Any

from tests.benchmarks import bench_runbatch as rb

FAMILIES = 300
LINES = 1438
SIZES = (1, 16)
SYSTEM_WORDS = (700, 2400)
USER_WORDS = (40, 250)
OUTPUT_TOKENS = (32, 200)
TOOLS_SHARE = 1 / 3


def family_sizes(rng: random.Random, families: int = FAMILIES, lines: int = LINES) -> list[int]:
    """Sizes in SIZES, mostly small, summing to exactly `lines`."""
    low, high = SIZES
    if not families * low <= lines <= families * high:
        raise ValueError(f"{lines} lines do not fit {families} families of {low}-{high}")
    choices = list(range(low, high + 1))
    sizes = rng.choices(choices, weights=[0.8**k for k in choices], k=families)
    while (total := sum(sizes)) != lines:
        i = rng.randrange(families)
        if total < lines and sizes[i] < high:
            sizes[i] += 1
        elif total > lines and sizes[i] > low:
            sizes[i] -= 1
    return sizes


def night_lines(
    words: list[str], families: int = FAMILIES, lines: int = LINES, seed: int = 7
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for fam, size in enumerate(family_sizes(rng, families, lines)):
        system = rb.words_text(rng, words, rng.randint(*SYSTEM_WORDS))
        tools = rng.random() < TOOLS_SHARE
        for k in range(size):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": rb.words_text(rng, words, rng.randint(*USER_WORDS))},
            ]
            line = rb.batch_line(f"n{fam:03d}-{k}", messages, rng.randint(*OUTPUT_TOKENS))
            if tools:
                line["body"]["tools"] = [rb.TOOL]
            out.append(line)
    rng.shuffle(out)
    return out


__all__ = ["FAMILIES", "LINES", "family_sizes", "night_lines"]
