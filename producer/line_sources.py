"""Where `submit_job` reads a job's lines from (`LineSource`), and the small encodings
around them.

A `Scan` (a whole file validated in memory, `producer.bulk`), `GeneratedLines` (a file
qbatch wrote, streamed from a position) and `TextLines` (a validated file kept as text)
all give `total`, `invalid` and `lines_from(position)`. The line-number bitmap is what
`qbatch serve` stores for a job (`RedisKeys.job_lines`). Pure: files, no sockets.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from producer.bulk import (
    CustomIds,
    Defaults,
    InputFormat,
    Line,
    Scan,
    detect_line,
    duplicate_line,
    jsonl_lines,
    parse_line,
    request_id_for,
    scan_lines,
)
from schemas import ContractError
from schemas.limits import MAX_ENVELOPE_BYTES


def line_bitmap(numbers: Iterable[int]) -> bytes:
    """Line numbers (>= 1) as a bitmap, bit n most significant first (Redis' SETBIT)."""
    bits = bytearray()
    for n in numbers:
        byte, bit = divmod(n, 8)
        if byte >= len(bits):
            bits.extend(bytes(byte + 1 - len(bits)))
        bits[byte] |= 0x80 >> bit
    return bytes(bits)


def bitmap_lines(bitmap: bytes) -> list[int]:
    return [
        i * 8 + bit
        for i, byte in enumerate(bitmap)
        if byte
        for bit in range(8)
        if byte & (0x80 >> bit)
    ]


def read_lines(path: Path) -> list[str]:
    """A bulk file's lines (UTF-8, a leading byte-order mark skipped; `-` is stdin is not
    supported: a file is needed to resume)."""
    with path.open("r", encoding="utf-8-sig", newline="") as fh:
        return jsonl_lines(fh.read())


def scan_file(
    path: Path, job_id: str, *, attempt: int = 0, defaults: Defaults | None = None
) -> Scan:
    return scan_lines(read_lines(path), job_id, attempt=attempt, defaults=defaults)


_BOM = b"\xef\xbb\xbf"


def iter_file_lines(path: Path, max_bytes: int = MAX_ENVELOPE_BYTES) -> Iterator[tuple[int, str]]:
    """(physical line number, text) of each non-blank line of a JSONL file, read in bounded
    memory: split on `\n` only, as `jsonl_lines`; a leading byte-order mark skipped; a
    line over `max_bytes` is read past without being kept and comes as `OVERLONG`.
    Raises UnicodeDecodeError for a line that is not UTF-8."""
    with path.open("rb") as fh:
        number = 0
        while True:
            chunk = fh.readline(max_bytes + 2)  # + "\r\n": a line at the cap still fits
            if not chunk:
                return
            number += 1
            overlong = not chunk.endswith(b"\n") and len(chunk) >= max_bytes + 2
            if number == 1 and chunk.startswith(_BOM):
                chunk = chunk[len(_BOM) :]
            if overlong:
                while (more := fh.readline(1 << 20)) and not more.endswith(b"\n"):
                    pass  # the rest of the over-long line, dropped as it is read
                yield number, OVERLONG
                continue
            text = chunk.decode("utf-8").strip()
            if text:
                yield number, text


OVERLONG = "\x00overlong"
"""What `iter_file_lines` gives for a line over its limit (parse_line refuses it: not JSON
is the wrong reason, so callers turn it into the size error)."""


@dataclass
class FileScan:
    """A bulk file validated in one streaming pass (`scan_stream`), then read again line by
    line as it is sent: memory independent of the file's size (a whole-file `Scan` held
    ~25x the file: 4.48 GB for 1,000,000 lines). Keeps counts, the first `KEEP_BAD` bad
    and mixed lines for the report, and the lines whose custom_id repeats an earlier one's
    (so the second read answers them the same way)."""

    path: Path
    job_id: str
    format: InputFormat | None = None
    total: int = 0
    invalid: int = 0
    bad: list[Line] = field(default_factory=list)
    mixed: list[Line] = field(default_factory=list)
    mixed_count: int = 0
    duplicates: dict[int, int] = field(default_factory=dict)
    """line -> the earlier line with the same custom_id."""
    defaults: Defaults | None = None
    attempt: int = 0

    def lines_from(self, position: int) -> Iterator[Line]:
        numbered = itertools.islice(iter_file_lines(self.path), position, None)
        for number, text in numbered:
            parsed = self._parse(number, text)
            first = self.duplicates.get(number)
            yield duplicate_line(parsed, first) if first is not None and parsed.ok else parsed

    def _parse(self, number: int, text: str) -> Line:
        if text is OVERLONG:
            rid = request_id_for(self.job_id, number, self.attempt)
            error = ContractError(f"line is over {MAX_ENVELOPE_BYTES} bytes", param="(line)")
            return Line(number, rid, None, error=error)
        return parse_line(
            text, number, self.format, self.job_id, attempt=self.attempt, defaults=self.defaults
        )


KEEP_BAD = 1_000
"""Bad (and mixed-format) lines a `FileScan` keeps for its report; the rest are counted."""


def scan_stream(
    path: Path, job_id: str, *, attempt: int = 0, defaults: Defaults | None = None
) -> FileScan:
    """Validate a bulk file in one pass, in bounded memory (see `FileScan`)."""
    scan = FileScan(path, job_id, defaults=defaults, attempt=attempt)
    ids = CustomIds()
    for number, text in iter_file_lines(path):
        if scan.format is None and text is not OVERLONG:
            scan.format = detect_line(text)
        checked = scan._parse(number, text)
        first = ids.earlier(checked)
        if first is not None:
            scan.duplicates[number] = first
            checked = duplicate_line(checked, first)
        scan.total += 1
        if not checked.ok:
            scan.invalid += 1
            if len(scan.bad) < KEEP_BAD:
                scan.bad.append(checked)
        if checked.mixed:
            scan.mixed_count += 1
            if len(scan.mixed) < KEEP_BAD:
                scan.mixed.append(checked)
    return scan


class LineSource(Protocol):
    """What `submit_job` reads: a `Scan` (a whole file validated in memory), a
    `GeneratedLines` streamed from a file written by qbatch itself, or a `TextLines`
    (a validated file kept as text)."""

    @property
    def total(self) -> int: ...

    @property
    def invalid(self) -> int: ...

    def lines_from(self, position: int) -> Iterator[Line]:
        """The lines after the first `position` non-blank ones, in file order."""
        ...


class GeneratedLines:
    """A native-envelope file qbatch wrote (valid lines, none blank), read line by line
    from a position, so a huge generated file is submitted in bounded memory."""

    def __init__(self, path: Path, job_id: str, total: int, *, attempt: int = 0) -> None:
        self.path = path
        self.job_id = job_id
        self.total = total
        self.invalid = 0
        self.attempt = attempt

    def lines_from(self, position: int) -> Iterator[Line]:
        with self.path.open("r", encoding="utf-8", newline="") as fh:
            texts = (text for text in fh if text.strip())
            for number, text in enumerate(itertools.islice(texts, position, None), position + 1):
                yield parse_line(
                    text.strip(), number, InputFormat.native, self.job_id, attempt=self.attempt
                )


class TextLines:
    """A validated file's request lines kept as text and parsed again as they are sent.

    A `Scan` holds every line as a parsed envelope, ~24x the file's size; a file that
    passed validation (so no bad or repeated line) only needs its text kept until it
    is sent: about its own size. Parsing again gives the same envelopes (same text,
    line number, format and `defaults`)."""

    def __init__(
        self,
        scan: Scan,
        texts: Sequence[str],
        job_id: str,
        *,
        defaults: Defaults | None = None,
        attempt: int = 0,
    ) -> None:
        if scan.bad:
            raise ValueError("TextLines holds only a file whose every line is valid")
        self.format = scan.format
        self.numbered = [(line.line, texts[line.line - 1].strip()) for line in scan.lines]
        self.job_id = job_id
        self.defaults = defaults
        self.attempt = attempt
        self.invalid = 0

    @property
    def total(self) -> int:
        return len(self.numbered)

    @property
    def numbers(self) -> list[int]:
        """The request lines' physical line numbers."""
        return [number for number, _text in self.numbered]

    def lines_from(self, position: int) -> Iterator[Line]:
        for number, text in itertools.islice(self.numbered, position, None):
            yield parse_line(
                text,
                number,
                self.format,
                self.job_id,
                attempt=self.attempt,
                defaults=self.defaults,
            )


__all__ = [
    "FileScan",
    "GeneratedLines",
    "LineSource",
    "TextLines",
    "bitmap_lines",
    "line_bitmap",
    "read_lines",
    "scan_file",
    "scan_stream",
]
