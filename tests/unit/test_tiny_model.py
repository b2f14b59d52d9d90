"""The tiny random-weight Qwen3 builder."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from worker.rendering import load_generation_defaults

pytestmark = [
    pytest.mark.cpu_model,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="torch is not installed (pip install -e '.[cpu]')",
    ),
]


def test_tiny_model_shape_and_files(tiny_qwen3_dir: Path) -> None:
    from tests.tiny_model import is_complete

    assert is_complete(tiny_qwen3_dir)
    config = json.loads((tiny_qwen3_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        64,
        2,
        151936,
    )
    assert config["tie_word_embeddings"] is True
    for name in ("tokenizer_config.json", "vocab.json", "merges.txt", "model.safetensors"):
        assert (tiny_qwen3_dir / name).is_file()
    assert (tiny_qwen3_dir / "model.safetensors").stat().st_size < 60_000_000
    assert "RANDOM" in (tiny_qwen3_dir / "README.md").read_text()
    assert load_generation_defaults(tiny_qwen3_dir) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }


def test_tiny_model_build_is_idempotent(tiny_qwen3_dir: Path) -> None:
    from tests.tiny_model import build_tiny_qwen3

    stamp = (tiny_qwen3_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_qwen3(tiny_qwen3_dir) == tiny_qwen3_dir
    assert (tiny_qwen3_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_tiny_model_loads_with_matching_tokenizer(tiny_qwen3_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir))
    assert len(tok) <= model.config.vocab_size
    assert tok.convert_tokens_to_ids("<tool_call>") < model.config.vocab_size


def test_cli_prints_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_qwen3_dir: Path
) -> None:
    import shutil

    from tests.tiny_model import main

    target = tmp_path / "copy"
    shutil.copytree(tiny_qwen3_dir, target)  # complete already: the CLI must not rebuild
    assert main([str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    assert main([]) == 2
