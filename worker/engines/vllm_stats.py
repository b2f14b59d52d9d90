"""vLLM's numbers, read for the worker (pure: no vLLM import): the scheduler's last stats
per engine (`_StatsLogger`, `combined_stats`), its capacity (`max_num_seqs`,
`kv_cache_tokens`: what `worker.engine_gate` keeps worse lanes under) and a request's
stage times (`engine_times`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.engines.base import EngineStats


class _StatsLogger:
    """Keeps one engine's last scheduler stats for the worker's metrics (vLLM's per-engine
    stat-logger API). Each VllmEngine hands vLLM a factory bound to its own store, keyed
    by vLLM's engine index: two engines in one process (the two-worker benchmark) or a
    data-parallel AsyncLLM must not read each other's queue depth, as they did when the
    last stats lived on the class."""

    def __init__(self, store: dict[int, Any], engine_index: int = 0) -> None:
        self._store = store
        self.engine_index = engine_index

    def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any) -> None:
        if scheduler_stats is not None:
            self._store[self.engine_index] = scheduler_stats

    def log_engine_initialized(self) -> None:
        return

    def log(self) -> None:
        return

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        return


def combined_stats(latest: Sequence[Any]) -> EngineStats:
    """One EngineStats from the last scheduler stats of each of an AsyncLLM's engines:
    requests add up, the KV cache reads as its fullest engine's (the saturation signal
    the alerts and the admission want)."""
    if not latest:
        return EngineStats()
    return EngineStats(
        kv_cache_usage=max(float(s.kv_cache_usage) for s in latest),
        running=sum(int(s.num_running_reqs) for s in latest),
        waiting=sum(int(s.num_waiting_reqs) for s in latest),
    )


def max_num_seqs(vllm_config: Any) -> int | None:
    """How many requests vLLM's scheduler runs at once (None where this version does
    not say)."""
    try:
        return int(vllm_config.scheduler_config.max_num_seqs)
    except (AttributeError, TypeError, ValueError):
        return None


def kv_cache_tokens(vllm_config: Any) -> int | None:
    """The KV cache's capacity in tokens, known once vLLM has profiled the memory; None
    where this version does not say. Two workers on one GPU each load the weights, so
    each gets a fraction of one worker's cache (tests/benchmarks/RESULTS.md, session 14:
    2 x 37,968 against 271,472 on an H100): the figure that explains such a setup."""
    try:
        cache = vllm_config.cache_config
        return int(cache.num_gpu_blocks) * int(cache.block_size)
    except (AttributeError, TypeError):
        return None


def engine_times(stats: Any) -> tuple[int | None, int | None]:
    """(first scheduled, first token) in epoch ms from vLLM's per-request stats
    (`RequestStateStats`: `arrival_time` is the frontend's wall clock, `first_token_latency`
    seconds from it; `scheduled_ts` and `first_token_ts` are the engine core's monotonic
    clock, so only their difference is used). (None, None) when vLLM kept no stats."""
    try:
        arrival = float(stats.arrival_time)
        latency = float(stats.first_token_latency)
    except (AttributeError, TypeError, ValueError):
        return None, None
    if arrival <= 0 or latency <= 0:
        return None, None
    first_token = arrival + latency
    try:
        prefill = float(stats.first_token_ts) - float(stats.scheduled_ts)
    except (AttributeError, TypeError, ValueError):
        prefill = -1.0
    scheduled = first_token - prefill if 0 <= prefill <= latency else None
    return (None if scheduled is None else int(scheduled * 1000)), int(first_token * 1000)


__all__ = ["combined_stats", "engine_times", "kv_cache_tokens", "max_num_seqs"]
