"""The served model's tokenizer, for token-exact chunking on the client side.

Why an extra (`pip install 'qbatch[docs]'`) and not the worker: chunk boundaries and the
"does it fit one pass" test must count tokens exactly as the served model does, before
anything is published; the Rust `tokenizers` wheel reads the model's own `tokenizer.json`
and gives per-token character offsets, without torch, transformers or jinja2, so the bare
client stays small. Doing it in the worker would need a new request kind in the contract.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

DOCS_HINT = "pip install 'qbatch[docs]'"
TOKENIZER_ENV = "QBATCH_TOKENIZER"


class Tokenizer(Protocol):
    """What chunking and planning need of a tokenizer."""

    def offsets(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character span in `text` of every token, in order."""
        ...

    def count(self, text: str) -> int:
        """How many tokens `text` is."""
        ...


class TokenizerError(RuntimeError):
    """No tokenizer: the extra is missing, or the path holds no tokenizer.json."""


class FileTokenizer:
    """`tokenizers.Tokenizer` behind the `Tokenizer` protocol; no special tokens are added
    (a chat template adds its own; the planner keeps a margin for them)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def offsets(self, text: str) -> list[tuple[int, int]]:
        encoding = self._inner.encode(text, add_special_tokens=False)
        return [(int(a), int(b)) for a, b in encoding.offsets]

    def offsets_batch(self, texts: list[str]) -> list[list[tuple[int, int]]]:
        """Several texts at once: the Rust library tokenizes them on all cores."""
        encodings = self._inner.encode_batch(texts, add_special_tokens=False)
        return [[(int(a), int(b)) for a, b in e.offsets] for e in encodings]

    def count(self, text: str) -> int:
        return len(self._inner.encode(text, add_special_tokens=False).ids)


def offsets_many(tokenizer: Tokenizer, texts: list[str]) -> list[list[tuple[int, int]]]:
    """`tokenizer.offsets` of each text, in one parallel call where the tokenizer has one
    (`offsets_batch`); planning a nightly job is tokenizing millions of tokens before the
    first request is published, time the GPU would otherwise sit idle."""
    batch = getattr(tokenizer, "offsets_batch", None)
    if batch is not None:
        return list(batch(texts))
    return [tokenizer.offsets(text) for text in texts]


def tokenizer_path(given: str | os.PathLike[str] | None) -> Path:
    """The tokenizer.json named by `given` (a file, or a model directory holding one),
    else by $QBATCH_TOKENIZER; TokenizerError when neither names an existing one."""
    raw = given if given is not None else os.environ.get(TOKENIZER_ENV)
    if not raw:
        raise TokenizerError(
            f"name the served model's tokenizer: --tokenizer PATH or ${TOKENIZER_ENV} "
            "(its tokenizer.json, or the model directory holding it)"
        )
    path = Path(raw)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"no tokenizer.json at {path}")
    return path


def load_tokenizer(given: str | os.PathLike[str] | None = None) -> FileTokenizer:
    """Load the tokenizer (lazily imports `tokenizers`: the `docs` extra)."""
    path = tokenizer_path(given)
    try:
        from tokenizers import Tokenizer as RustTokenizer
    except ImportError:
        raise TokenizerError(f"summarisation needs the tokenizers library: {DOCS_HINT}") from None
    try:
        return FileTokenizer(RustTokenizer.from_file(str(path)))
    except Exception as exc:  # the library raises plain Exceptions on a bad file
        raise TokenizerError(f"{path} is not a tokenizer.json the library reads: {exc}") from None


__all__ = [
    "DOCS_HINT",
    "TOKENIZER_ENV",
    "FileTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "tokenizer_path",
]
