"""Token-exact chunks with overlap, over a whole text or a stream of text blocks. Pure.

Chunk i covers tokens [i*(size-overlap), i*(size-overlap)+size); the last chunk ends at
the document's last token (it holds more than `overlap` tokens, so it always adds text).
A chunk is a character span of the original document (text[start:end] is exact; a
character that the byte-level tokenizer split over two tokens can be in both chunks).

Streaming (bounded memory on a 1 GB file): blocks are gathered in a buffer that is
tokenized only up to a *safe cut*, a place where tokenizing the pieces gives the very
tokens that tokenizing the whole text gives. For the GPT-2/GPT-4/Qwen family of
pre-tokenizers (a regex split, then byte-level BPE inside each piece) that is the place
just before a space that follows a non-space character (no pre-token crosses it), or,
failing that, just after a newline that precedes a non-space character. Tokens of a cut
piece are kept only until the chunks that need them are emitted, so memory holds about
one chunk plus one block. A buffer with no safe cut in `max_buffer` characters is cut
anyway (a possible one-token seam; only for text without spaces or newlines).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from producer.summarize.tokens import Tokenizer, offsets_many

DEFAULT_MAX_BUFFER = 16 << 20


@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    """0-based position in the document."""
    start: int
    """Character offset of the chunk's first token in the document."""
    end: int
    first_token: int
    tokens: int
    text: str


def check_sizes(size: int, overlap: int) -> None:
    """ValueError unless size > overlap >= 0."""
    if not (isinstance(size, int) and isinstance(overlap, int)) or not size > overlap >= 0:
        raise ValueError(f"chunk size must be > overlap >= 0, got size {size}, overlap {overlap}")


def token_ranges(n_tokens: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """[start, end) token ranges of the chunks of an `n_tokens`-token document."""
    check_sizes(size, overlap)
    stride = size - overlap
    ranges: list[tuple[int, int]] = []
    start = 0
    while n_tokens > 0:
        if start + size >= n_tokens:
            ranges.append((start, n_tokens))
            break
        ranges.append((start, start + size))
        start += stride
    return ranges


def safe_cut(text: str) -> int:
    """The last position p (0 < p < len(text)) where tokenizing text[:p] and text[p:]
    apart equals tokenizing text whole (see the module docstring), or 0 if none."""
    p = text.rfind(" ")
    while p > 0:
        if not text[p - 1].isspace():
            return p
        p = text.rfind(" ", 0, p)
    p = text.rfind("\n")
    while p >= 0:
        if p + 1 < len(text) and not text[p + 1].isspace():
            return p + 1
        p = text.rfind("\n", 0, p)
    return 0


class _Stream:
    """The state of one streamed document: tokenized spans not yet consumed, the text
    from the next chunk's start on, and the untokenized tail."""

    def __init__(self, tokenizer: Tokenizer, size: int, overlap: int) -> None:
        self.tok = tokenizer
        self.size = size
        self.stride = size - overlap
        self.spans: list[tuple[int, int]] = []  # document char spans of tokens base..
        self.base = 0  # document token index of spans[0]
        self.text = ""  # document text from text_at on (tokenized part + pending)
        self.text_at = 0
        self.tokenized_to = 0  # document char offset where the pending text starts
        self.index = 0

    def feed(self, piece: str, offsets: list[tuple[int, int]] | None = None) -> None:
        """Take `piece` (the text from `tokenized_to` on, ending at a safe cut) and its
        token offsets (tokenized here when not given)."""
        at = self.tokenized_to
        spans = self.tok.offsets(piece) if offsets is None else offsets
        self.spans.extend((at + a, at + b) for a, b in spans)
        self.tokenized_to += len(piece)

    def chunk(self, first: int, end: int) -> Chunk:
        a = self.spans[first - self.base][0]
        b = self.spans[end - 1 - self.base][1]
        text = self.text[a - self.text_at : b - self.text_at]
        return Chunk(self.index, a, b, first, end - first, text)

    def ready(self) -> Iterator[Chunk]:
        """Chunks that are surely not the last (a token exists past their end)."""
        while True:
            first = self.index * self.stride
            if self.base + len(self.spans) <= first + self.size:
                return
            yield self.chunk(first, first + self.size)
            self.index += 1
            self.drop()

    def drop(self) -> None:
        """Forget tokens and text before the next chunk's first token."""
        first = self.index * self.stride
        cut = first - self.base
        if cut <= 0:
            return
        cut = min(cut, len(self.spans))
        keep_from = self.spans[cut][0] if cut < len(self.spans) else self.tokenized_to
        del self.spans[:cut]
        self.base += cut
        self.text = self.text[keep_from - self.text_at :]
        self.text_at = keep_from

    def last(self) -> Iterator[Chunk]:
        n = self.base + len(self.spans)
        while True:
            first = self.index * self.stride
            if n <= first:
                return
            end = min(first + self.size, n)
            yield self.chunk(first, end)
            self.index += 1
            if end == n:
                return


def stream_chunks(
    blocks: Iterable[str],
    tokenizer: Tokenizer,
    size: int,
    overlap: int,
    *,
    max_buffer: int = DEFAULT_MAX_BUFFER,
) -> Iterator[Chunk]:
    """Chunks of the document made of `blocks` (in order), as soon as each is known."""
    check_sizes(size, overlap)
    st = _Stream(tokenizer, size, overlap)
    for block in blocks:
        if block:
            st.text += block
            yield from _tokenize_ready(st, max_buffer)
    pending = st.text[st.tokenized_to - st.text_at :]
    if pending:
        st.feed(pending)
    yield from st.ready()
    yield from st.last()


FEED_CHARS = 1 << 14
"""Text tokenized at a time: bounds the token spans held besides one chunk's."""
FEED_PIECES = 16
"""Pieces of FEED_CHARS tokenized in one parallel call (`tokens.offsets_many`)."""


def _ready_pieces(st: _Stream, max_buffer: int) -> list[str]:
    """The pending text cut at safe cuts into up to FEED_PIECES pieces of about
    FEED_CHARS; [] when no safe cut is there yet."""
    start = st.tokenized_to - st.text_at
    pending = len(st.text) - start
    pieces: list[str] = []
    at = start
    while len(pieces) < FEED_PIECES:
        window = st.text[at : at + FEED_CHARS]
        cut = safe_cut(window)
        if cut == 0:
            break
        pieces.append(window[:cut])
        at += cut
        if len(window) < FEED_CHARS:
            break
    if not pieces and pending > FEED_CHARS:  # no safe cut in a whole window: look further
        window = st.text[start : start + max_buffer]
        cut = safe_cut(window) or (len(window) if pending >= max_buffer else 0)
        if cut:
            pieces.append(window[:cut])
    return pieces


def _tokenize_ready(st: _Stream, max_buffer: int) -> Iterator[Chunk]:
    """Tokenize the pending text up to its last safe cut, some pieces at a time, emitting
    the chunks that become known."""
    while True:
        pieces = _ready_pieces(st, max_buffer)
        if not pieces:
            return
        for piece, offsets in zip(pieces, offsets_many(st.tok, pieces), strict=True):
            st.feed(piece, offsets)
            yield from st.ready()
            if not st.spans:  # nothing kept for a chunk: drop the tokenized text too
                st.text = st.text[st.tokenized_to - st.text_at :]
                st.text_at = st.tokenized_to


def chunk_text(text: str, tokenizer: Tokenizer, size: int, overlap: int) -> list[Chunk]:
    """Chunks of a whole text (the same as streaming it as one block)."""
    return list(stream_chunks([text], tokenizer, size, overlap))


__all__ = ["Chunk", "check_sizes", "chunk_text", "safe_cut", "stream_chunks", "token_ranges"]
