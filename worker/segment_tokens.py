"""Token ids of a rendered prompt, with the long stretches between added tokens cached.

Why: the worker tokenizes every rendered chat prompt on its dispatcher thread, and a
night's bulk jobs are families whose lines share a 1,000-3,000-token system prompt (and a
tools block): on the night of job families (tests/benchmarks/families.py) tokenizing was
~95% of rendering, ~8 ms a line on a 2-core VM, the same system prompt over and over.

A fast (Rust) Hugging Face tokenizer first splits its input at its added tokens
(`<|im_start|>`, `<|im_end|>`, `<tool_call>`, ...), then normalizes, pre-tokenizes and
runs BPE on each stretch between them on its own. So the ids of a text are the ids of its
stretches and added tokens, in order, and a stretch's ids can be kept and reused. Here a
stretch of at least `min_chars` characters (a system prompt, a tools block, a document)
is looked up in a bounded LRU cache; everything else between two cached stretches is
encoded in one call, as before.

That identity holds only for added tokens matched on the raw text with no stripping
(`normalized`, `lstrip`, `rstrip` and `single_word` all false, as in Qwen3's); a tokenizer
with any other added token, a slow tokenizer, or `add_special_tokens=True` (whose post-
processor may add ids around the whole text) is encoded whole, exactly as before.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

DEFAULT_MIN_CHARS = 1024
DEFAULT_MAX_CACHED_TOKENS = 2_000_000
"""About 16 MB of cached ids (a list slot each, small ints shared) plus the keys' text."""


def plain_added_tokens(tokenizer: Any) -> dict[str, int] | None:
    """The tokenizer's added tokens (text -> id) when every one of them splits the raw text
    as is; None when any does not, or the tokenizer is not a fast one."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if not decoder:
        return None
    tokens: dict[str, int] = {}
    for token_id, added in decoder.items():
        flags = ("normalized", "lstrip", "rstrip", "single_word")
        if any(bool(getattr(added, flag, True)) for flag in flags):
            return None
        content = str(getattr(added, "content", ""))
        if not content:
            return None
        tokens[content] = int(token_id)
    return tokens


class SegmentEncoder:
    """`encode(text)`: the same ids as `tokenizer.encode(text, add_special_tokens=False)`."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        min_chars: int = DEFAULT_MIN_CHARS,
        max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
    ) -> None:
        self._whole: Callable[[str], list[int]] = lambda text: list(
            tokenizer.encode(text, add_special_tokens=False)
        )
        self._added = plain_added_tokens(tokenizer)
        self._split: re.Pattern[str] | None = None
        if self._added:
            longest_first = sorted(self._added, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
        self._min_chars = min_chars
        self._max_tokens = max_cached_tokens
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cached_tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self._split is not None

    def encode(self, text: str) -> list[int]:
        if self._split is None or len(text) < self._min_chars:
            return self._whole(text)
        parts = self._split.split(text)  # stretch, added, stretch, added, ..., stretch
        out: list[int] = []
        run_start = 0  # where the text not yet encoded starts
        offset = 0
        for i, part in enumerate(parts):
            if i % 2 == 0 and len(part) >= self._min_chars:
                if offset > run_start:
                    out.extend(self._whole(text[run_start:offset]))
                out.extend(self._stretch(part))
                run_start = offset + len(part)
            offset += len(part)
        if offset > run_start:
            out.extend(self._whole(text[run_start:]))
        return out

    def _stretch(self, part: str) -> tuple[int, ...]:
        with self._lock:
            ids = self._cache.get(part)
            if ids is not None:
                self._cache.move_to_end(part)
                self.hits += 1
                return ids
        ids = tuple(self._whole(part))
        with self._lock:
            self.misses += 1
            if len(ids) <= self._max_tokens and part not in self._cache:
                self._cache[part] = ids
                self._cached_tokens += len(ids)
                while self._cached_tokens > self._max_tokens:
                    _old, dropped = self._cache.popitem(last=False)
                    self._cached_tokens -= len(dropped)
        return ids


__all__ = ["DEFAULT_MIN_CHARS", "SegmentEncoder", "plain_added_tokens"]
