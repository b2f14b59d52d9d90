"""Documents to summarise: text files (.txt, .md, any UTF-8 text; one document each) and
JSONL (`{custom_id, text, instructions?}` a line). I/O, but nothing held whole: a text
file is read in 1 MiB blocks through an incremental UTF-8 decoder, twice (a first pass
finds a bad byte or an empty document before any of its chunks is published), and a
JSONL file line by line.

A bad document is never a crash: it becomes a `Document` with an `error` (code
`not_utf8` with the byte offset, `empty_document`, `invalid_line` naming the field), and
that document's output line says so.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

BLOCK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class DocError:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Document:
    custom_id: str | None
    blocks: Callable[[], Iterator[str]] | None
    """A fresh iterator over the document's text blocks (None when `error` is set)."""
    instructions: str | None = None
    error: DocError | None = None


def _decoded_blocks(path: Path) -> Iterator[str]:
    """The file's text in blocks; UnicodeDecodeError carries the file's byte offset."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with path.open("rb") as fh:
        while True:
            data = fh.read(BLOCK_BYTES)
            held = len(decoder.getstate()[0])
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as exc:
                raise UnicodeDecodeError(
                    "utf-8", exc.object, exc.start, exc.end, f"byte {offset - held + exc.start}"
                ) from None
            offset += len(data)
            if text:
                yield text
            if not data:
                return


def _check_text(path: Path) -> DocError | None:
    """First pass over a text file: valid UTF-8 and not blank."""
    blank = True
    try:
        for text in _decoded_blocks(path):
            blank = blank and not text.strip()
    except UnicodeDecodeError as exc:
        return DocError("not_utf8", f"{path}: not UTF-8 at {exc.reason}")
    if blank:
        return DocError("empty_document", f"{path}: the document is empty (or only whitespace)")
    return None


def read_text_file(path: Path) -> Document:
    """One text file as one document; custom_id is the path as given."""
    error = _check_text(path)
    if error is not None:
        return Document(str(path), None, error=error)
    return Document(str(path), lambda: _decoded_blocks(path))


class DocLine(BaseModel):
    """One line of a documents JSONL file."""

    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: str = Field(min_length=1, max_length=256)
    text: str
    instructions: str | None = None


def _line_error(number: int, code: str, message: str, cid: str | None = None) -> Document:
    return Document(cid, None, error=DocError(code, f"line {number}: {message}"))


def _parse_line(raw: bytes, number: int, offset: int, seen: dict[str, int]) -> Document:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _line_error(number, "not_utf8", f"not UTF-8 at byte {offset + exc.start}")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return _line_error(number, "invalid_line", f"not JSON: {exc}")
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    cid = cid if isinstance(cid, str) and cid else None
    try:
        line = DocLine.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(line)"
        return _line_error(number, "invalid_line", f"{where}: {first['msg']}", cid)
    if line.custom_id in seen:
        return _line_error(
            number,
            "invalid_line",
            f"custom_id: duplicate {line.custom_id!r} (first on line {seen[line.custom_id]})",
            line.custom_id,
        )
    seen[line.custom_id] = number
    if not line.text.strip():
        return _line_error(number, "empty_document", "text: the document is empty", cid)
    body = line.text
    return Document(line.custom_id, lambda: iter([body]), instructions=line.instructions)


def read_docs_jsonl(path: Path) -> Iterator[Document]:
    """The documents of a JSONL file, line by line (blank lines skipped)."""
    seen: dict[str, int] = {}
    offset = 0
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            start = offset
            offset += len(raw)
            if not raw.strip():
                continue
            yield _parse_line(raw.rstrip(b"\r\n"), number, start, seen)


__all__ = [
    "BLOCK_BYTES",
    "DocError",
    "DocLine",
    "Document",
    "read_docs_jsonl",
    "read_text_file",
]
