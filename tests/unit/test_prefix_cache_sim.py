"""The echo engine's simulated prefix cache (worker/engines/prefix_cache.py) and how the
echo engine reports it."""

from __future__ import annotations

import pytest

from schemas import validate_envelope
from worker.engines.base import EngineOutput, EngineRequest
from worker.engines.echo import EchoEngine
from worker.engines.prefix_cache import SimulatedPrefixCache
from worker.rendering import PromptRenderer

BLOCK = 64  # characters of one 16-token block at 4 characters a token


def text(head: str, n_blocks: int, tail: str = "") -> str:
    return head * (BLOCK * n_blocks) + tail


def test_a_shared_prefix_hits_its_full_blocks_only() -> None:
    cache = SimulatedPrefixCache(10_000)
    first = text("a", 10, "question one")
    assert cache.lookup(first) == (0, cache.tokens(first))  # cold
    hit, query = cache.lookup(text("a", 10, "another question"))
    assert hit == 10 * 16 and query == cache.tokens(text("a", 10, "another question"))
    # a prompt differing in block 3 hits blocks 0-2 only (the chain breaks there)
    changed = text("a", 3) + text("b", 7)
    assert cache.lookup(changed)[0] == 3 * 16
    assert cache.queries == sum(cache.tokens(t) for t in (first, changed)) + query
    assert cache.hits == 160 + 48


def test_a_fully_cached_prompt_recomputes_its_last_token() -> None:
    cache = SimulatedPrefixCache(10_000)
    prompt = text("a", 4)  # exactly 4 full blocks, 64 tokens
    cache.lookup(prompt)
    assert cache.lookup(prompt) == (63, 64)
    cache.clear()  # as vLLM's reset_prefix_cache: cold again, the totals kept
    assert len(cache) == 0 and cache.lookup(prompt) == (0, 64) and cache.queries == 192


def test_the_salt_isolates_prefixes() -> None:
    cache = SimulatedPrefixCache(10_000)
    cache.lookup(text("a", 5), salt="tenant-a")
    assert cache.lookup(text("a", 5, "x"), salt="tenant-b")[0] == 0
    assert cache.lookup(text("a", 5, "x"), salt="tenant-a")[0] == 80


def test_capacity_evicts_the_least_recently_used_tails_first() -> None:
    cache = SimulatedPrefixCache(16 * 8)  # 8 blocks
    a, b = text("a", 6), text("b", 6)
    cache.lookup(a)
    cache.lookup(b)  # 12 blocks offered: a's tail goes first, its head stays longest
    assert len(cache) == 8
    assert cache.lookup(a + "?")[0] == 2 * 16  # a's first two blocks survived
    # b was touched before this second look at a: now b's tail is the oldest
    assert cache.lookup(b + "?")[0] < 6 * 16


def test_families_interleaved_beyond_capacity_thrash_and_grouped_ones_hit() -> None:
    """Why placement matters: the same 40 prompts, 4 families of 10, in two orders."""

    def rate(order: list[str]) -> float:
        cache = SimulatedPrefixCache(16 * 12)  # room for one family's 10-block prefix
        for i, fam in enumerate(order):
            cache.lookup(text(fam, 10, f" q{i}"))
        return cache.hit_rate

    grouped = [f for f in "abcd" for _ in range(10)]
    shuffled = [f for _ in range(10) for f in "abcd"]
    assert rate(shuffled) == 0.0
    assert rate(grouped) > 0.85


def test_bad_sizes() -> None:
    with pytest.raises(ValueError):
        SimulatedPrefixCache(0)


def _request(content: str, system: str) -> EngineRequest:
    renderer = PromptRenderer(None, max_model_len=100_000, served_names={"echo"})
    env = validate_envelope(
        {
            "request_id": "r",
            "body": {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": content},
                ]
            },
        }
    )
    return renderer.render(env).engine_request("k")


def test_the_echo_engine_reports_simulated_cached_tokens_on_the_whole_conversation() -> None:
    policy = "Follow the house rules carefully. " * 100
    outputs: list[EngineOutput] = []
    engine = EchoEngine(prefix_cache_tokens=100_000)
    engine.submit([_request("first question", policy)], outputs.append)
    engine.submit([_request("second question", policy)], outputs.append)
    first, second = outputs
    assert first.text == "first question"  # the echo still answers the last user message
    assert first.cached_tokens == 0
    # prompt tokens are the simulator's: the whole conversation at 4 characters a token
    conversation = f"system: {policy}\nuser: second question"
    assert second.prompt_tokens == -(-len(conversation) // 4)
    # the long system prompt hits, in whole 16-token blocks
    assert second.cached_tokens == (len(f"system: {policy}") // 64) * 16
    assert engine.prefix_cache is not None and engine.prefix_cache.hit_rate > 0.45
    # off by default: no cached_tokens, nothing counted
    plain: list[EngineOutput] = []
    EchoEngine().submit([_request("q", policy)], plain.append)
    assert plain[0].cached_tokens is None
    # its capacity, as vLLM's blocks x block size (qbatch_engine_kv_cache_capacity_tokens)
    assert EchoEngine(prefix_cache_tokens=4_010).stats().kv_cache_tokens == 4_000
    assert EchoEngine().stats().kv_cache_tokens is None
