"""Where `submit_job` reads a job's lines from (`LineSource`), and the small encodings
around them.

A `Scan` (a whole file validated in memory, `producer.bulk`), `GeneratedLines` (a file
qbatch wrote, streamed from a position) and a `producer.stream_scan.StreamScan` (any
input, validated in one streaming pass and read again) all give `total`, `invalid` and
`lines_from(position)`. The line-number bitmap is what
`qbatch serve` stores for a job (`RedisKeys.job_lines`). Pure: files, no sockets.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

from producer.bulk import Defaults, InputFormat, Line, Scan, jsonl_lines, parse_line, scan_lines


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


class LineSource(Protocol):
    """What `submit_job` reads: a `Scan` (a whole file validated in memory), a
    `GeneratedLines` streamed from a file written by qbatch itself, or a `StreamScan`."""

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


__all__ = [
    "GeneratedLines",
    "LineSource",
    "bitmap_lines",
    "line_bitmap",
    "read_lines",
    "scan_file",
]
