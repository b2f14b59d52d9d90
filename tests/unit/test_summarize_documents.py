"""Document readers: text files streamed in blocks, JSONL line by line; a bad document is a
per-document error (not_utf8 with its byte offset, empty_document, invalid_line naming the
field), never a crash; a 50 MB file is chunked in bounded memory."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

from producer.summarize import documents
from producer.summarize.chunking import stream_chunks
from producer.summarize.documents import read_docs_jsonl, read_text_file
from tests.summarize_fixtures import WhitespaceTokenizer


def _text(doc: documents.Document) -> str:
    assert doc.blocks is not None and doc.error is None, doc.error
    return "".join(doc.blocks())


def test_text_file_is_one_document_read_in_blocks(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(documents, "BLOCK_BYTES", 7)
    path = tmp_path / "a.md"
    body = "# Titel\n\nnaïve café 日本語 😀 " * 5  # multi-byte characters across block edges
    path.write_text(body, encoding="utf-8")
    doc = read_text_file(path)
    assert doc.custom_id == str(path) and _text(doc) == body
    assert all(len(b.encode()) <= 7 + 3 for b in doc.blocks())  # type: ignore[misc]


def test_bad_text_files_get_a_clear_error(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(documents, "BLOCK_BYTES", 4)
    bad = tmp_path / "bad.txt"
    bad.write_bytes("héllo wörld ".encode() * 2 + b"\xff rest")
    doc = read_text_file(bad)
    assert doc.blocks is None and doc.error is not None
    assert doc.error.code == "not_utf8" and "byte 28" in doc.error.message
    cut = tmp_path / "cut.txt"
    cut.write_bytes("ok é".encode()[:-1])  # a truncated sequence at the very end
    err = read_text_file(cut).error
    assert err is not None and err.code == "not_utf8" and "byte 3" in err.message
    for name, data in (("empty.txt", b""), ("blank.md", b" \n\t\n ")):
        (tmp_path / name).write_bytes(data)
        err = read_text_file(tmp_path / name).error
        assert err is not None and err.code == "empty_document"


def test_jsonl_documents_and_per_line_errors(tmp_path: Path) -> None:
    lines = [
        json.dumps({"custom_id": "a", "text": "first doc"}).encode(),
        b"",
        json.dumps({"custom_id": "b", "text": "second", "instructions": "In French."}).encode(),
        b'{"custom_id": "c", "text": "x", "colour": "red"}',
        b'{"custom_id": "a", "text": "again"}',
        b'{"custom_id": "d", "text": "   "}',
        b'{"custom_id": "e", "text": "caf\xe9"}',
        b"not json",
        b'{"custom_id": "f", "text": 5}',
        b'{"text": "no id"}',
        b"[1, 2]",
    ]
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    docs = list(read_docs_jsonl(path))
    assert [d.custom_id for d in docs] == ["a", "b", "c", "a", "d", None, None, "f", None, None]
    assert _text(docs[0]) == "first doc" and docs[0].instructions is None
    assert _text(docs[1]) == "second" and docs[1].instructions == "In French."
    errors = [(d.error.code, d.error.message) for d in docs[2:] if d.error is not None]
    assert len(errors) == 8
    codes = [code for code, _ in errors]
    assert codes == [
        "invalid_line",
        "invalid_line",
        "empty_document",
        "not_utf8",
        "invalid_line",
        "invalid_line",
        "invalid_line",
        "invalid_line",
    ]
    messages = [m for _, m in errors]
    assert messages[0].startswith("line 4: colour:")
    assert "duplicate 'a' (first on line 1)" in messages[1]
    offset = sum(len(raw) + 1 for raw in lines[:6]) + len(b'{"custom_id": "e", "text": "caf')
    assert messages[3] == f"line 7: not UTF-8 at byte {offset}"
    assert messages[4].startswith("line 8: not JSON")
    assert messages[5].startswith("line 9: text:")
    assert messages[6].startswith("line 10: custom_id:")


def _chunking_peak(tmp_path: Path, megabytes: int) -> tuple[int, int, int]:
    """(peak bytes traced while chunking a file of `megabytes`, chunks, file size)."""
    path = tmp_path / f"big-{megabytes}.txt"
    line = " ".join(f"token{i:05d}extra" for i in range(400)) + "\n"
    size = megabytes << 20
    with path.open("w", encoding="utf-8") as fh:
        for _ in range(size // len(line) + 1):
            fh.write(line)
    size = path.stat().st_size
    doc = read_text_file(path)
    assert doc.error is None and doc.blocks is not None
    tracemalloc.start()
    try:
        count = last_end = 0
        for chunk in stream_chunks(doc.blocks(), WhitespaceTokenizer(), 4096, 256):
            count += 1
            last_end = chunk.end
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert last_end == size - 1  # the last token ends before the final newline
    return peak, count, size


def test_a_big_file_is_chunked_in_memory_that_does_not_grow_with_it(tmp_path: Path) -> None:
    """Four times the file, not four times the memory: the peak is the window's (~7 MB
    at any size; a 50 MB file took 40 s under tracemalloc in CI, so 4 and 16 MB show it)."""
    small_peak, small_chunks, _ = _chunking_peak(tmp_path, 4)
    peak, count, size = _chunking_peak(tmp_path, 16)
    assert count > 4 * small_chunks - 4
    assert peak < small_peak * 1.25, f"peak {peak >> 10} KiB vs {small_peak >> 10} KiB at 4 MB"
    assert peak < size // 2, f"peak {peak >> 20} MiB for a {size >> 20} MiB file"
