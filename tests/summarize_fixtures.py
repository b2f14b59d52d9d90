"""Test helpers for summarisation: the real Qwen3 tokenizer as a `tokenizer.json`, and a
whitespace tokenizer.

The fixture folder holds Qwen's `vocab.json` and `merges.txt` (no `tokenizer.json`), so
`qwen3_tokenizer_json` assembles the very pipeline Qwen's published `tokenizer.json`
declares (NFC, the Qwen2 split regex, byte-level BPE, no prefix space) with the Rust
`tokenizers` library, and writes it once to a folder. A test cross-checks it against
transformers' own Qwen3 tokenizer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures" / "qwen3-14b"
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def qwen3_tokenizer_json(out_dir: Path) -> Path:
    """Write `out_dir/tokenizer.json` (Qwen3's tokenizer) and return its path."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre

    path = out_dir / "tokenizer.json"
    if path.is_file():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    bpe = models.BPE.from_file(
        str(FIXTURE_DIR / "vocab.json"), str(FIXTURE_DIR / "merges.txt"), unk_token=None
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    config = json.loads((FIXTURE_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = sorted(config["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))
    tok.add_special_tokens(
        [AddedToken(v["content"], special=True, normalized=False) for _, v in added]
    )
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    return path


class WhitespaceTokenizer:
    """A token is a maximal run of non-space characters (offsets exact, no I/O)."""

    def offsets(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for m in re.finditer(r"\S+", text)]

    def count(self, text: str) -> int:
        return len(self.offsets(text))
