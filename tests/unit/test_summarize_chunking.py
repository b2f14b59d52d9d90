"""Token-exact chunking (producer.summarize.chunking): ranges, overlap, the last chunk,
streaming equal to whole-text chunking, on a whitespace tokenizer and the real Qwen3 one."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from producer.summarize.chunking import (
    check_sizes,
    chunk_text,
    safe_cut,
    stream_chunks,
    token_ranges,
)
from producer.summarize.tokens import TokenizerError, load_tokenizer, tokenizer_path
from tests.summarize_fixtures import WhitespaceTokenizer, qwen3_tokenizer_json

WS = WhitespaceTokenizer()
MIXED = (
    "Qwen3's tokenizer splits words, numbers 1234567 and punctuation... like this!\n"
    "Zweite Zeile: naïve café, 日本語のテキストと😀絵文字。  Two  spaces,\ttabs,\n\n"
    "a new paragraph — with «quotes» and <|im_start|> lookalikes; x=y+z.\r\n"
)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return load_tokenizer(qwen3_tokenizer_json(tmp_path_factory.mktemp("qwen3-tok")))


@pytest.mark.parametrize(
    ("n", "size", "overlap", "expected"),
    [
        (0, 4, 1, []),
        (3, 4, 1, [(0, 3)]),
        (4, 4, 1, [(0, 4)]),
        (5, 4, 1, [(0, 4), (3, 5)]),
        (10, 4, 1, [(0, 4), (3, 7), (6, 10)]),
        (11, 4, 1, [(0, 4), (3, 7), (6, 10), (9, 11)]),
        (9, 3, 0, [(0, 3), (3, 6), (6, 9)]),
        (6, 5, 4, [(0, 5), (1, 6)]),
    ],
)
def test_token_ranges_are_exact(
    n: int, size: int, overlap: int, expected: list[tuple[int, int]]
) -> None:
    assert token_ranges(n, size, overlap) == expected


@pytest.mark.parametrize(("size", "overlap"), [(4, 4), (4, 5), (4, -1), (0, 0)])
def test_sizes_must_be_size_gt_overlap_ge_0(size: int, overlap: int) -> None:
    with pytest.raises(ValueError, match="size must be > overlap"):
        check_sizes(size, overlap)
    with pytest.raises(ValueError):
        list(stream_chunks(["a b"], WS, size, overlap))


def test_whitespace_chunks_are_char_spans_with_exact_overlap() -> None:
    text = " ".join(f"w{i}" for i in range(10))
    chunks = chunk_text(text, WS, 4, 1)
    assert [c.text for c in chunks] == ["w0 w1 w2 w3", "w3 w4 w5 w6", "w6 w7 w8 w9"]
    assert [(c.index, c.first_token, c.tokens) for c in chunks] == [(0, 0, 4), (1, 3, 4), (2, 6, 4)]
    assert all(text[c.start : c.end] == c.text for c in chunks)
    # the last chunk ends at the last token, even when it is short
    short = chunk_text(text + " w10", WS, 4, 1)
    assert short[-1].text == "w9 w10" and short[-1].tokens == 2 and short[-1].first_token == 9


def test_tiny_and_empty_documents() -> None:
    assert chunk_text("", WS, 4, 1) == []
    assert chunk_text("   \n ", WS, 4, 1) == []
    (only,) = chunk_text("  hello  ", WS, 4, 1)
    assert (only.text, only.start, only.end, only.tokens) == ("hello", 2, 7, 1)


def test_safe_cut_positions() -> None:
    assert safe_cut("abc def ghi") == 7  # before the last space after a word
    assert safe_cut("abc def   ") == 7  # not inside a run of spaces
    assert safe_cut("abc\ndef") == 4  # after a newline, before a word
    assert safe_cut("abcdef") == 0
    assert safe_cut(" abc") == 0


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64])
def test_streaming_equals_whole_on_whitespace_tokens(block: int) -> None:
    rng = random.Random(block)
    words = ["".join(rng.choice("abcxyz") for _ in range(rng.randint(1, 6))) for _ in range(300)]
    text = "".join(w + rng.choice([" ", "  ", "\n", "\t "]) for w in words)
    blocks = [text[i : i + block] for i in range(0, len(text), block)]
    assert list(stream_chunks(blocks, WS, 17, 5)) == chunk_text(text, WS, 17, 5)


def test_qwen3_chunks_follow_the_tokenizer_exactly(qwen3) -> None:  # type: ignore[no-untyped-def]
    text = MIXED * 20
    spans = qwen3.offsets(text)
    size, overlap = 50, 7
    chunks = chunk_text(text, qwen3, size, overlap)
    assert [(c.first_token, c.first_token + c.tokens) for c in chunks] == token_ranges(
        len(spans), size, overlap
    )
    for c in chunks:
        assert c.start == spans[c.first_token][0]
        assert c.end == spans[c.first_token + c.tokens - 1][1]
        assert c.text == text[c.start : c.end]
    for a, b in itertools.pairwise(chunks):
        assert b.first_token == a.first_token + size - overlap
        shared = text[spans[b.first_token][0] : spans[a.first_token + size - 1][1]]
        assert a.text.endswith(shared) and b.text.startswith(shared)
    assert chunks[-1].end == len(text.rstrip("\n")) or chunks[-1].end == spans[-1][1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qwen3_streaming_equals_whole(qwen3, seed: int) -> None:  # type: ignore[no-untyped-def]
    """Block-wise tokenization gives the very tokens of whole-text tokenization."""
    rng = random.Random(seed)
    text = "".join(
        rng.choice(MIXED.split(" ")) + rng.choice([" ", "  ", "\n", ""]) for _ in range(2_000)
    )
    cuts = sorted(rng.sample(range(1, len(text)), 60))
    blocks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole = chunk_text(text, qwen3, 64, 9)
    streamed = list(stream_chunks(blocks, qwen3, 64, 9))
    assert streamed == whole
    assert sum(c.tokens for c in whole) - 9 * (len(whole) - 1) == qwen3.count(text)


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    assert tokenizer_path(tmp_path) == tmp_path / "tokenizer.json"
    with pytest.raises(TokenizerError, match=r"not a tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_the_fixture_tokenizer_is_qwen3s(qwen3, qwen3_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The tokenizer.json built from the fixture's vocab and merges tokenizes as
    transformers' Qwen3 tokenizer does."""
    text = MIXED * 3
    assert qwen3.count(text) == len(qwen3_tokenizer.encode(text, add_special_tokens=False))
    assert qwen3._inner.encode(text, add_special_tokens=False).ids == qwen3_tokenizer.encode(
        text, add_special_tokens=False
    )
