"""Engines behind one interface (`base.Engine`), chosen by `--engine`."""

from __future__ import annotations

import importlib.util
import os

from worker.config import WorkerSettings
from worker.engines.base import Engine, EngineOutput, EngineRequest, EngineStats, SamplingSpec

__all__ = [
    "Engine",
    "EngineOutput",
    "EngineRequest",
    "EngineStats",
    "SamplingSpec",
    "build_engine",
    "resolve_engine_name",
]


def _gpu_present() -> bool:
    """Asks NVML, not the CUDA runtime: a CUDA context in this process would make vLLM's
    forked engine process fail ("Cannot re-initialize CUDA in forked subprocess")."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_engine_name(settings: WorkerSettings) -> str:
    """`auto` means vLLM when it imports and a GPU is present, else transformers."""
    if settings.engine != "auto":
        return settings.engine
    if importlib.util.find_spec("vllm") is not None and _gpu_present():
        return "vllm"
    return "transformers"


def build_engine(settings: WorkerSettings) -> Engine:
    """Heavy imports (torch, vllm) happen only for the engine that is chosen."""
    name = resolve_engine_name(settings)
    if name == "echo":
        from worker.engines.echo import EchoEngine

        return EchoEngine(
            served_name=settings.served_name(),
            max_model_len=settings.max_model_len or 32_768,
            delay_ms=settings.echo_delay_ms,
        )
    if not settings.model:
        raise ValueError(f"--model is required for engine {name}")
    if name == "transformers":
        from worker.engines.transformers_engine import TransformersEngine

        return TransformersEngine(
            settings.model,
            max_model_len=settings.max_model_len,
            served_name=settings.served_name(),
        )
    from worker.engines.vllm_engine import VllmEngine

    return VllmEngine.from_settings(settings)
