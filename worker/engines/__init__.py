"""Engines behind one interface (`base.Engine`), chosen by `--engine`, from one registry.

Heavy imports (torch, vllm, transformers) happen only for the engine that is chosen: the
registry names each engine's module and class, imported when built.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from worker.config import WorkerSettings
from worker.engines.base import Engine, EngineOutput, EngineRequest, EngineStats, SamplingSpec

__all__ = [
    "EMBED_ENGINES",
    "ENGINES",
    "Engine",
    "EngineOutput",
    "EngineRequest",
    "EngineStats",
    "SamplingSpec",
    "build_engine",
    "engine_class",
    "resolve_engine_name",
]

ENGINES: dict[str, str] = {
    "echo": "worker.engines.echo:EchoEngine",
    "transformers": "worker.engines.transformers_engine:TransformersEngine",
    "vllm": "worker.engines.vllm_engine:VllmEngine",
}
"""`--engine` name -> `module:Class` of an `Engine` subclass (`--task generate`)."""
EMBED_ENGINES: dict[str, str] = {
    "echo": "worker.engines.echo:EchoEngine",
    "transformers": "worker.engines.transformers_embed:TransformersEmbedder",
    "vllm": "worker.engines.vllm_embed:VllmEmbedder",
}
"""The same for `--task embed`: an engine runs one task, chosen at start."""


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


def engine_class(name: str, task: str = "generate") -> type[Engine]:
    table = EMBED_ENGINES if task == "embed" else ENGINES
    try:
        module_name, _, class_name = table[name].partition(":")
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(table)}") from None
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise TypeError(f"{table[name]} is not an Engine")
    return cls


def build_engine(settings: WorkerSettings) -> Engine:
    """The engine `settings` choose for their task, built (not started)."""
    return engine_class(resolve_engine_name(settings), settings.task).from_settings(settings)
