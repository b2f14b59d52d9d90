"""GPU tests run only where vLLM imports and a CUDA device is present (the device tool)."""

from __future__ import annotations

import importlib.util
import shutil

import pytest


def _gpu() -> bool:
    """Without touching CUDA: a CUDA context made here would break vLLM's forked engine."""
    if importlib.util.find_spec("vllm") is None:
        return False
    return shutil.which("nvidia-smi") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs vLLM and an NVIDIA GPU (run through the device tool)")
    has_gpu = _gpu()
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if not has_gpu:
                item.add_marker(skip)
