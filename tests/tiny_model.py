"""Build a tiny Qwen3 with RANDOM weights from the fixture config and the real Qwen3 tokenizer.

The model has the real tokenizer, chat template and vocabulary (151936 ids, so token ids match
the tokenizer) but only 2 layers of width 64 with random weights: what it generates is noise.
It exists to exercise the transformers engine end to end (batching, padding, max_tokens,
decoding) on a laptop CPU in a second, never to judge output quality.

    python -m tests.tiny_model OUT_DIR      # prints the model directory
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["DEFAULT_FIXTURE_DIR", "TINY_OVERRIDES", "build_tiny_qwen3", "is_complete"]

log = logging.getLogger(__name__)

DEFAULT_FIXTURE_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen3-14b"
TOKENIZER_FILES = ("tokenizer_config.json", "vocab.json", "merges.txt")
TINY_OVERRIDES = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "max_window_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "dtype": "float32",
}
_MARKER = ".qbatch-tiny-complete"


def is_complete(model_dir: Path) -> bool:
    """A finished build: the marker is written last, after weights and tokenizer."""
    return (model_dir / _MARKER).is_file() and (model_dir / "config.json").is_file()


def build_tiny_qwen3(
    out_dir: str | os.PathLike[str],
    *,
    fixture_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
) -> Path:
    """Write the tiny random-weight model to `out_dir` (skipped if already built there)."""
    out = Path(out_dir)
    if is_complete(out):
        return out
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    fixture = Path(fixture_dir) if fixture_dir is not None else DEFAULT_FIXTURE_DIR
    config_data = json.loads((fixture / "config.json").read_text(encoding="utf-8"))
    config_data.update(TINY_OVERRIDES)
    config_data.pop("transformers_version", None)
    config_data.pop("model_type", None)
    config = Qwen3Config(**config_data)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-qwen3-", dir=out.parent))
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
        model.eval()
        gen_path = fixture / "generation_config.json"
        if gen_path.is_file():
            model.generation_config = GenerationConfig.from_pretrained(fixture)
        model.save_pretrained(staging)
        for name in TOKENIZER_FILES:
            shutil.copy2(fixture / name, staging / name)
        (staging / "README.md").write_text(
            "Tiny Qwen3 with RANDOM weights (2 layers, width 64), built by tests.tiny_model "
            "for tests. Its output is noise.\n",
            encoding="utf-8",
        )
        (staging / _MARKER).write_text(f"seed={seed}\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.warning("built tiny Qwen3 with RANDOM weights at %s: its output is noise", out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in {"-h", "--help"}:
        print(__doc__, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO)
    print(build_tiny_qwen3(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
