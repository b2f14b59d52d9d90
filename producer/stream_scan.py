"""A JSONL input of any size, validated in one streaming pass and read again as it is
sent: memory independent of the file's size (issues 39 and 40).

A whole-file `Scan` (`producer.bulk.scan_lines`) holds every line parsed, ~25x the file:
`qbatch bulk submit` took 4.48 GB for 1,000,000 lines, and `qbatch serve` was killed
validating a 70 MB upload. Here the input is a *source*, a function that opens it again
as an iterator of byte chunks (a local file, or a stored file's stream), so it can be
read twice without a copy in memory: once to validate (`scan_stream`: counts, the first
`KEEP_BAD` bad lines, the lines whose custom_id repeats an earlier one's, its sha256, a
visitor that sees every line), and again, line by line, as it is published
(`StreamScan.lines_from`). Lines split on `\\n` only (as `jsonl_lines`); one over the
envelope bound is read past without being kept. Pure: the source does the I/O.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from producer.bulk import (
    CustomIds,
    Defaults,
    InputFormat,
    Line,
    detect_line,
    duplicate_line,
    parse_line,
    request_id_for,
)
from schemas import ContractError
from schemas.limits import MAX_ENVELOPE_BYTES

Source = Callable[[], Iterable[bytes]]
"""Opens the input again, as byte chunks of any size."""

KEEP_BAD = 1_000
"""Bad (and mixed-format) lines a `StreamScan` keeps for its report; the rest are counted."""
OVERLONG = "\x00overlong"
"""What `iter_lines` gives for a line over its limit (parse_line would call it "not JSON":
the wrong reason, so `StreamScan` turns it into the size error)."""
_BOM = b"\xef\xbb\xbf"


def file_source(path: Path, block: int = 1 << 20) -> Source:
    def chunks() -> Iterator[bytes]:
        with path.open("rb") as fh:
            while chunk := fh.read(block):
                yield chunk

    return chunks


def iter_lines(
    chunks: Iterable[bytes], max_bytes: int = MAX_ENVELOPE_BYTES, errors: str = "strict"
) -> Iterator[tuple[int, str]]:
    """(physical line number, text) of each non-blank line, in bounded memory: at most one
    line of `max_bytes` (+ its line break) is held; a longer one is dropped as it is read
    and comes as `OVERLONG`. A leading byte-order mark is skipped. Raises
    UnicodeDecodeError for a line that is not UTF-8 (`errors="replace"`: decoded with
    U+FFFD instead, for a server that answers such a line rather than the file)."""
    limit = max_bytes + 2  # "\r\n": a line at the cap still fits
    pending = bytearray()
    overlong = False
    number = 0
    for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if not overlong:
                pending += piece
                if len(pending) > limit:
                    overlong, pending = True, bytearray()
            if end < 0:
                break
            number += 1
            if overlong:
                yield number, OVERLONG
            elif found := _text(pending, number, errors):
                yield number, found
            pending, overlong, start = bytearray(), False, end + 1
    if overlong or pending:
        number += 1
        if overlong:
            yield number, OVERLONG
        elif found := _text(pending, number, errors):
            yield number, found


class LineNotUtf8(UnicodeDecodeError):
    """A line that is not UTF-8; `line` is its physical line number."""

    line: int


def _text(raw: bytearray, number: int, errors: str) -> str:
    if number == 1 and raw.startswith(_BOM):
        raw = raw[len(_BOM) :]
    try:
        return raw.decode("utf-8", errors).strip()
    except UnicodeDecodeError as exc:
        bad = LineNotUtf8(exc.encoding, exc.object, exc.start, exc.end, exc.reason)
        bad.line = number
        raise bad from None


@dataclass
class StreamScan:
    """An input validated by `scan_stream`; a `producer.line_sources.LineSource`."""

    source: Source
    job_id: str
    format: InputFormat | None = None
    total: int = 0
    invalid: int = 0
    bad: list[Line] = field(default_factory=list)
    mixed: list[Line] = field(default_factory=list)
    mixed_count: int = 0
    duplicates: dict[int, int] = field(default_factory=dict)
    """line -> the earlier line with the same custom_id."""
    numbers: array[int] = field(default_factory=lambda: array("I"))
    """The request lines' physical line numbers (4 bytes each)."""
    sha256: str = ""
    over_limit: bool = False
    """The scan stopped at `max_lines` + 1 request lines."""
    defaults: Defaults | None = None
    attempt: int = 0
    errors: str = "strict"
    """How bytes that are not UTF-8 are decoded (`iter_lines`)."""

    def lines_from(self, position: int) -> Iterator[Line]:
        lines = iter_lines(self.source(), errors=self.errors)
        for number, text in itertools.islice(lines, position, None):
            parsed = self.parse(number, text)
            first = self.duplicates.get(number)
            yield duplicate_line(parsed, first) if first is not None and parsed.ok else parsed

    def parse(self, number: int, text: str) -> Line:
        if text is OVERLONG:
            rid = request_id_for(self.job_id, number, self.attempt)
            error = ContractError(f"line is over {MAX_ENVELOPE_BYTES} bytes", param="(line)")
            return Line(number, rid, None, error=error)
        return parse_line(
            text, number, self.format, self.job_id, attempt=self.attempt, defaults=self.defaults
        )


def scan_stream(
    source: Source | Path,
    job_id: str,
    *,
    attempt: int = 0,
    defaults: Defaults | None = None,
    visit: Callable[[Line], None] | None = None,
    max_lines: int | None = None,
    errors: str = "strict",
) -> StreamScan:
    """Validate an input in one pass, in bounded memory (see `StreamScan`). `visit` sees
    every line as checked (a batch's error list is built so); `max_lines`: stop after that
    many request lines and one more (`over_limit`)."""
    if isinstance(source, Path):
        source = file_source(source)
    scan = StreamScan(source, job_id, defaults=defaults, attempt=attempt, errors=errors)
    ids = CustomIds()
    digest = hashlib.sha256()

    def hashed() -> Iterator[bytes]:
        for chunk in source():
            digest.update(chunk)
            yield chunk

    for number, text in iter_lines(hashed(), errors=errors):
        if max_lines is not None and scan.total >= max_lines:
            scan.over_limit = True
            break
        if scan.format is None and text is not OVERLONG:
            scan.format = detect_line(text)
        checked = scan.parse(number, text)
        first = ids.earlier(checked)
        if first is not None:
            scan.duplicates[number] = first
            checked = duplicate_line(checked, first)
        scan.total += 1
        scan.numbers.append(number)
        if not checked.ok:
            scan.invalid += 1
            if len(scan.bad) < KEEP_BAD:
                scan.bad.append(checked)
        if checked.mixed:
            scan.mixed_count += 1
            if len(scan.mixed) < KEEP_BAD:
                scan.mixed.append(checked)
        if visit is not None:
            visit(checked)
    scan.sha256 = digest.hexdigest()
    return scan


__all__ = [
    "KEEP_BAD",
    "OVERLONG",
    "LineNotUtf8",
    "Source",
    "StreamScan",
    "file_source",
    "iter_lines",
    "scan_stream",
]
