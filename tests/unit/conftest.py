"""Shared unit-test fixtures: the real Qwen3 tokenizer and a tiny random-weight Qwen3, and
`qbatch serve`'s storage backends (`backend`: each test on the local directory and S3)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.storage_fixtures import backend, s3_endpoint  # noqa: F401  (fixtures)

FIXTURE_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "qwen3-14b"
HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="session")
def qwen3_fixture_dir() -> Path:
    return FIXTURE_DIR


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Any:
    """The real Qwen3 tokenizer and chat template (no weights)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(FIXTURE_DIR))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 with RANDOM weights, built once per session (needs torch)."""
    if not HAS_TORCH:
        pytest.skip("torch is not installed (pip install -e '.[cpu]')")
    from tests.tiny_model import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "tiny-qwen3", seed=0)
