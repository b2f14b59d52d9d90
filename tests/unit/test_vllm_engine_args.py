"""Argument flow into vLLM, checked without a GPU (vLLM itself is not imported)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from worker.config import WorkerSettings
from worker.engines import resolve_engine_name
from worker.engines.vllm_engine import VllmEngine, describe_error, engine_kwargs


def settings(**kw: object) -> WorkerSettings:
    return WorkerSettings(engine="vllm", model="/models/Qwen3-14B", **kw)  # type: ignore[arg-type]


def test_defaults_leave_vllm_defaults_alone() -> None:
    kwargs = engine_kwargs(settings())
    assert kwargs["model"] == "/models/Qwen3-14B"
    assert kwargs["served_model_name"] == "Qwen3-14B"
    assert kwargs["tensor_parallel_size"] == 1
    assert kwargs["scheduling_policy"] == "priority"  # request priorities reach vLLM
    for unset in ("max_num_seqs", "max_num_batched_tokens", "quantization", "max_model_len",
                  "enable_prefix_caching", "enable_chunked_prefill", "block_size"):  # fmt: skip
        assert unset not in kwargs


def test_every_engine_argument_is_passed_through() -> None:
    kwargs = engine_kwargs(
        settings(
            tensor_parallel_size=4,
            pipeline_parallel_size=2,
            max_model_len=32768,
            gpu_memory_utilization=0.85,
            enable_chunked_prefill=True,
            enable_prefix_caching=False,
            block_size=32,
            dtype="bfloat16",
            quantization="awq",
            kv_cache_dtype="fp8",
            max_num_seqs=512,
            max_num_batched_tokens=16384,
            load_format="dummy",
            served_model_name="qwen",
            engine_args={"swap_space": 8},
        )
    )
    assert kwargs == {
        "model": "/models/Qwen3-14B",
        "tensor_parallel_size": 4,
        "pipeline_parallel_size": 2,
        "max_model_len": 32768,
        "gpu_memory_utilization": 0.85,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": False,
        "block_size": 32,
        "dtype": "bfloat16",
        "quantization": "awq",
        "kv_cache_dtype": "fp8",
        "max_num_seqs": 512,
        "max_num_batched_tokens": 16384,
        "load_format": "dummy",
        "enforce_eager": False,
        "seed": 0,
        "trust_remote_code": False,
        "served_model_name": "qwen",
        "scheduling_policy": "priority",
        "swap_space": 8,
    }


def test_engine_args_json_can_override_anything() -> None:
    kwargs = engine_kwargs(settings(engine_args={"scheduling_policy": "fcfs"}))
    assert kwargs["scheduling_policy"] == "fcfs"


def test_engine_modes_and_served_name() -> None:
    engine = VllmEngine.from_settings(settings(engine_mode="static", tensor_parallel_size=2))
    assert engine.mode == "static"
    assert engine.model_name == "Qwen3-14B"
    assert engine._kwargs["tensor_parallel_size"] == 2


def test_auto_engine_without_vllm_is_transformers() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; auto may pick it")
    auto = WorkerSettings(engine="auto", model="m")  # type: ignore[arg-type]
    assert resolve_engine_name(auto) == "transformers"
    assert resolve_engine_name(WorkerSettings(engine="echo")) == "echo"  # type: ignore[arg-type]


def test_describe_error_reports_the_causes_of_an_empty_wrapper() -> None:
    class EngineGenerateError(Exception):
        pass

    try:
        try:
            raise ValueError("grammar compilation failed: unsupported keyword")
        except ValueError as cause:
            raise EngineGenerateError() from cause
    except EngineGenerateError as exc:
        text = describe_error(exc)
    assert (
        text == "EngineGenerateError <- ValueError: grammar compilation failed: unsupported keyword"
    )
    assert describe_error(RuntimeError("plain")) == "RuntimeError: plain"


def _sched(kv: float, running: int, waiting: int) -> object:
    """The three fields of vLLM's SchedulerStats the worker reads."""
    from types import SimpleNamespace

    return SimpleNamespace(kv_cache_usage=kv, num_running_reqs=running, num_waiting_reqs=waiting)


def test_two_engines_in_one_process_keep_their_own_scheduler_stats() -> None:
    """The stat logger vLLM builds for each engine writes to that VllmEngine only (the
    two-worker benchmark runs two in one process; the last stats used to live on the
    class, so each engine reported whichever had logged last)."""
    first = VllmEngine(engine_kwargs(settings()))
    second = VllmEngine(engine_kwargs(settings()))
    assert first.stats().running is None  # nothing logged yet: unknown, not zero
    first._stats_logger(None, 0).record(_sched(0.5, 3, 1), None)
    second._stats_logger(None, 0).record(_sched(0.9, 7, 4), None)
    second._stats_logger(None, 0).record(None, None)  # an iteration without scheduler stats
    assert (first.stats().kv_cache_usage, first.stats().running, first.stats().waiting) == (
        0.5,
        3,
        1,
    )
    assert (second.stats().running, second.stats().waiting) == (7, 4)


def test_a_data_parallel_engine_adds_requests_and_reads_its_fullest_kv_cache() -> None:
    from worker.engines.vllm_engine import combined_stats

    engine = VllmEngine(engine_kwargs(settings()))
    engine._stats_logger(None, 0).record(_sched(0.25, 10, 0), None)
    engine._stats_logger(None, 1).record(_sched(0.75, 6, 2), None)
    engine._stats_logger(None, 0).record(_sched(0.5, 12, 1), None)  # the newest of engine 0
    stats = engine.stats()
    assert (stats.kv_cache_usage, stats.running, stats.waiting) == (0.75, 18, 3)
    assert combined_stats([]).kv_cache_usage is None


def test_the_kv_cache_capacity_is_blocks_times_block_size_once_known() -> None:
    from worker.engines.vllm_engine import kv_cache_tokens

    config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=2373, block_size=16))
    assert kv_cache_tokens(config) == 37_968  # one of two engines at 0.45 on an H100
    unprofiled = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=None, block_size=16))
    assert kv_cache_tokens(unprofiled) is None and kv_cache_tokens(object()) is None
    engine = VllmEngine(engine_kwargs(settings()))
    assert engine.stats().kv_cache_tokens is None  # not started: unknown
    engine._kv_cache_tokens = 37_968
    engine._stats_logger(None, 0).record(_sched(0.5, 3, 1), None)
    assert (engine.stats().kv_cache_tokens, engine.stats().running) == (37_968, 3)


def test_the_step_cap_brings_the_lane_scheduler_in_continuous_mode_only() -> None:
    from worker.engines.vllm_engine import LANE_SCHEDULER

    assert "scheduler_cls" not in engine_kwargs(settings(interactive_step_tokens=0))
    kwargs = engine_kwargs(settings(interactive_step_tokens=512))
    assert kwargs["scheduler_cls"] == LANE_SCHEDULER
    assert VllmEngine.from_settings(settings(interactive_step_tokens=512)).step_tokens == 512
    static = settings(interactive_step_tokens=512, engine_mode="static")
    assert "scheduler_cls" not in engine_kwargs(static)
    assert VllmEngine.from_settings(static).step_tokens == 0
    # an operator's own scheduler class wins, and then no request asks for the cap
    own = settings(interactive_step_tokens=512, engine_args={"scheduler_cls": "my.Sched"})
    assert VllmEngine.from_settings(own).step_tokens == 0
