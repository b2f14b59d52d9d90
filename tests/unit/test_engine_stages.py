"""Stage times from the engines: vLLM's per-request stats read into epoch ms
(`worker.engines.vllm_stats.engine_times`, pure), and the echo engine's abort of what
waits (what a cancel asks of it)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from worker.engines.base import EngineOutput, EngineRequest, SamplingSpec
from worker.engines.echo import EchoEngine
from worker.engines.vllm_stats import engine_times


def test_vllm_stats_become_first_scheduled_and_first_token_times() -> None:
    stats = SimpleNamespace(
        arrival_time=1_000.0,  # the frontend's wall clock
        first_token_latency=2.5,
        scheduled_ts=50.0,  # the engine core's monotonic clock: only differences count
        first_token_ts=50.4,
    )
    assert engine_times(stats) == (1_002_100, 1_002_500)


def test_missing_or_odd_stats_tell_nothing() -> None:
    assert engine_times(None) == (None, None)
    assert engine_times(SimpleNamespace(arrival_time=0.0, first_token_latency=1.0)) == (None, None)
    odd = SimpleNamespace(
        arrival_time=10.0, first_token_latency=1.0, scheduled_ts=9, first_token_ts=1
    )
    assert engine_times(odd) == (None, 11_000)  # a prefill longer than the latency: dropped


def test_the_echo_engine_aborts_what_waits_and_lets_what_runs_finish() -> None:
    engine = EchoEngine(delay_ms=200, concurrency=1)
    engine.start()
    outputs: list[EngineOutput] = []
    got = threading.Event()

    def on_done(output: EngineOutput) -> None:
        outputs.append(output)
        if len(outputs) == 3:
            got.set()

    spec = SamplingSpec(max_tokens=8)
    engine.submit([EngineRequest(k, "a b", None, spec) for k in ("run", "w1", "w2")], on_done)
    engine.abort(["w1", "w2"])
    assert got.wait(10)
    finishes = {o.key: o.finish for o in outputs}
    assert finishes == {"run": "stop", "w1": "abort", "w2": "abort"}
    assert engine.capacity() == (1, None)
    engine.close()


def test_the_stage_histogram_exposes_cumulative_buckets_per_stage_and_lane() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from worker.metrics import StageHistogram

    registry = CollectorRegistry()
    stages = StageHistogram((0.01, 0.1, 1.0, float("inf")), registry)
    for seconds in (0.005, 0.01, 0.05, 2.0):
        stages.observe("render", "bulk", seconds)
    stages.observe("write", "interactive", 0.2)
    text = generate_latest(registry).decode()
    assert 'qbatch_stage_seconds_bucket{lane="bulk",le="0.01",stage="render"} 2.0' in text
    assert 'qbatch_stage_seconds_bucket{lane="bulk",le="0.1",stage="render"} 3.0' in text
    assert 'qbatch_stage_seconds_bucket{lane="bulk",le="+Inf",stage="render"} 4.0' in text
    assert 'qbatch_stage_seconds_count{lane="bulk",stage="render"} 4.0' in text
    assert 'qbatch_stage_seconds_sum{lane="bulk",stage="render"} 2.065' in text
    assert 'qbatch_stage_seconds_bucket{lane="interactive",le="1.0",stage="write"} 1.0' in text
