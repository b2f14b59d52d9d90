"""A simulated prefix cache for the echo engine: what vLLM's would hit, on the CPU.

The echo engine has no KV cache, so on its own it cannot show what prefix-aware placement
(`producer.placement`) buys. With `--echo-prefix-cache-tokens N` it keeps this model of
vLLM's automatic prefix caching and reports `cached_tokens` per request, which feed the
same `qbatch_engine_prefix_cache_*` counters and `usage.prompt_tokens_details` as vLLM's
numbers do (the echo then counts prompt tokens in the simulator's unit too). It models
the parts that decide the hit rate:

* the prompt is cut into fixed-size blocks (16 tokens, vLLM's default block size; a token
  is taken as 4 characters: there is no tokenizer), and only full blocks are cached;
* each block's hash chains its parent's (and the request's `cache_salt`), so a block hits
  only when everything before it is the same, as with vLLM's block hashes;
* a request hits its longest run of cached leading blocks, and a fully cached prompt still
  recomputes its last token (vLLM needs one token to compute logits);
* the cache holds `capacity_tokens` worth of blocks, evicting the least recently used; a
  request's blocks are touched tail first, so its first blocks are the last to go (vLLM
  frees a finished request's blocks in reverse order for the same reason).

It does not model blocks pinned by running requests (echo answers at once) or the GPU's
memory: N is simply how many tokens of prefixes fit. Pure: no clock, no I/O; not
thread-safe (the echo engine calls it from the dispatcher thread only).
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK_TOKENS = 16
"""vLLM's default KV block size, in tokens."""
CHARS_PER_TOKEN = 4
"""The simulated tokenizer: about 4 characters of English a token."""


class SimulatedPrefixCache:
    """An LRU of chained block hashes; `lookup` counts and then caches a prompt."""

    def __init__(
        self,
        capacity_tokens: int,
        *,
        block_tokens: int = BLOCK_TOKENS,
        chars_per_token: int = CHARS_PER_TOKEN,
    ) -> None:
        if capacity_tokens < 1 or block_tokens < 1 or chars_per_token < 1:
            raise ValueError("capacity_tokens, block_tokens and chars_per_token must be >= 1")
        self.block_tokens = block_tokens
        self.chars_per_token = chars_per_token
        self.block_chars = block_tokens * chars_per_token
        self.capacity_blocks = max(1, capacity_tokens // block_tokens)
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        """Tokens looked up so far (every prompt's length in simulated tokens)."""
        self.hits = 0
        """Tokens found cached so far."""

    @property
    def capacity_tokens(self) -> int:
        """What it holds when full, in whole blocks (as vLLM's blocks x block size)."""
        return self.capacity_blocks * self.block_tokens

    def __len__(self) -> int:
        """Blocks held now."""
        return len(self._blocks)

    def clear(self) -> None:
        """Drop every cached block (as vLLM's `reset_prefix_cache`); the totals stay."""
        self._blocks.clear()

    def tokens(self, text: str) -> int:
        """`text`'s length in simulated tokens (rounded up)."""
        return -(-len(text) // self.chars_per_token)

    def _hashes(self, text: str, salt: str | None) -> list[int]:
        parent = hash(("salt", salt))
        out = []
        for start in range(0, len(text) - self.block_chars + 1, self.block_chars):
            parent = hash((parent, text[start : start + self.block_chars]))
            out.append(parent)
        return out

    def lookup(self, text: str, salt: str | None = None) -> tuple[int, int]:
        """(hit tokens, query tokens) for a prompt, which is then cached (its full blocks)."""
        query = self.tokens(text)
        hashes = self._hashes(text, salt)
        cached = 0
        for block in hashes:
            if block not in self._blocks:
                break
            cached += 1
        hit = min(cached * self.block_tokens, max(query - 1, 0))
        for block in reversed(hashes):  # tail first: the prompt's head is the freshest
            if block in self._blocks:
                self._blocks.move_to_end(block)
            else:
                self._blocks[block] = None
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        self.queries += query
        self.hits += hit
        return hit, query

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


__all__ = ["BLOCK_TOKENS", "CHARS_PER_TOKEN", "SimulatedPrefixCache"]
