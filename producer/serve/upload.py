"""`POST /v1/files`: a multipart upload parsed as it streams, straight into storage.

Why not the framework's form parser: it spools a whole file part to a temporary file
before the handler runs, so a limit could only be checked after an oversize upload had
been received in full. Here the body is fed chunk by chunk to python-multipart's parser
and the file part's bytes go to a storage `Upload` that counts them: past the tenant's
limit the upload stops (413) with nothing kept. Text fields (`purpose`) are small and
bounded. Once received, `check_jsonl` checks the file is JSONL before it is stored.
"""

from __future__ import annotations

import json
from pathlib import Path

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from producer.serve.errors import ApiError
from producer.serve.storage import FileStore, Upload
from producer.stream_scan import OVERLONG, LineNotUtf8, file_source, iter_lines
from schemas.limits import MAX_ENVELOPE_BYTES

MAX_FIELD_BYTES = 4_096
MAX_FIELDS = 16


def _bad(message: str) -> ApiError:
    return ApiError(400, message, code="invalid_multipart")


class FormReceiver:
    """Receives one `multipart/form-data` body: text fields and at most one file (`file`)."""

    def __init__(self, content_type: str, storage: FileStore, limit: int) -> None:
        kind, params = parse_options_header(content_type)
        boundary = params.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise _bad("expected a multipart/form-data body with fields 'file' and 'purpose'")
        self.storage = storage
        self.limit = limit
        self.fields: dict[str, str] = {}
        self.upload: Upload | None = None
        self.filename: str | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._name = b""
        self._value = b""
        self._field: str | None = None
        self._data = bytearray()
        self._in_file = False
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._part_begin,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
                "on_header_field": self._header_field,
                "on_header_value": self._header_value,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
            },
        )

    # ------------------------------------------------------------ parser callbacks

    def _part_begin(self) -> None:
        self._headers = []
        self._field = None
        self._data = bytearray()
        self._in_file = False

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._name += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers.append((self._name.lower(), self._value))
        self._name = b""
        self._value = b""

    def _headers_finished(self) -> None:
        disposition = next((v for k, v in self._headers if k == b"content-disposition"), b"")
        _kind, options = parse_options_header(disposition)
        name = options.get(b"name")
        if name is None:
            raise _bad("a multipart part has no name")
        self._field = name.decode("utf-8", "replace")
        if b"filename" in options:
            if self._field != "file" or self.upload is not None:
                raise _bad("exactly one file part, named 'file', is expected")
            self.filename = options[b"filename"].decode("utf-8", "replace")
            self.upload = self.storage.begin(self.limit)
            self._in_file = True
        elif len(self.fields) >= MAX_FIELDS:
            raise _bad(f"more than {MAX_FIELDS} form fields")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            assert self.upload is not None
            self.upload.write(data[start:end])  # UploadTooLarge past the limit
            return
        self._data += data[start:end]
        if len(self._data) > MAX_FIELD_BYTES:
            raise _bad(f"form field {self._field!r} is over {MAX_FIELD_BYTES} bytes")

    def _part_end(self) -> None:
        if not self._in_file and self._field is not None:
            self.fields[self._field] = self._data.decode("utf-8", "replace")

    # ------------------------------------------------------------ feeding

    def feed(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except FormParserError as exc:
            raise _bad(f"malformed multipart body: {exc}") from None

    def finish(self) -> None:
        try:
            self._parser.finalize()
        except FormParserError as exc:
            raise _bad(f"malformed multipart body: {exc}") from None

    def discard(self) -> None:
        if self.upload is not None:
            self.upload.discard()


def check_jsonl(path: Path) -> str | None:
    """Why the file is not JSONL (UTF-8, one JSON object a non-blank line), or None.
    Only the format: what each line asks for is checked when a batch validates it.

    Read a line at a time, each at most a request's size (`MAX_ENVELOPE_BYTES`): a file
    of one 120 MB line was read and parsed whole (~23x its size) and killed the server.
    A longer line is refused, as its request would be; nesting past the parser's depth is
    "not JSON"."""
    count = 0
    try:
        for number, text in iter_lines(file_source(path)()):
            if text is OVERLONG:
                return f"line {number} is over {MAX_ENVELOPE_BYTES:,} bytes (a request's limit)"
            try:
                obj = json.loads(text)
            except (ValueError, RecursionError) as exc:
                why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
                return f"line {number} is not JSON: {why}"
            if not isinstance(obj, dict):
                return f"line {number} is not a JSON object"
            count += 1
    except LineNotUtf8 as exc:
        return f"line {exc.line} is not UTF-8 (byte {exc.start})"
    return None if count else "the file holds no lines"


__all__ = ["FormReceiver", "check_jsonl"]
