"""The progress page (`GET /`, issue 17 part 4) in a real browser: `qbatch serve` with an
echo worker and one finished batch, the page opened in headless Chromium (Debian's
`chromium`), and the screenshot checked to be a real, non-blank PNG.

Chromium cannot send `Authorization: Bearer`, and the page never takes a key from a
URL, so a small local proxy adds the header (what a reverse proxy or the sign-in cookie
does in real use). Skipped, with the reason, when chromium is not installed (`.ci/run`
installs it)."""

from __future__ import annotations

import contextlib
import http.server
import os
import shutil
import struct
import subprocess
import tempfile
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.ci_gate import tool_missing
from tests.serve_fixtures import KEY_A, batch_lines, jsonl, wait_batch

try:
    from tests.integration.test_serve import serving
except ModuleNotFoundError:
    from test_serve import serving  # type: ignore[no-redef]

CHROMIUM = os.environ.get("QBATCH_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = [pytest.mark.integration, pytest.mark.browser]
WIDTH, HEIGHT = 1280, 720


@pytest.fixture(scope="module", autouse=True)
def _chromium() -> None:
    """Skipped here without Chromium; failed under CI, which installs it (tests.ci_gate)."""
    if not Path(CHROMIUM).is_file():
        tool_missing(f"no Chromium at {CHROMIUM} (apt-get install -y chromium, or QBATCH_CHROMIUM)")


@pytest.fixture(scope="module", autouse=True)
def _stack(stack: Any) -> None:
    """The local Kafka + Redis (conftest's `stack` starts it or fails loudly)."""


def png_pixels(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, the inflated scanlines) of an 8-bit PNG (stdlib only)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, zlib.decompress(idat)


def test_png_pixels_tells_a_blank_image_from_a_drawn_one() -> None:
    def png(rows: list[bytes]) -> bytes:
        def chunk(kind: bytes, body: bytes) -> bytes:
            crc = zlib.crc32(kind + body)
            return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

        ihdr = struct.pack(">IIBBBBB", len(rows[0]) // 3, len(rows), 8, 2, 0, 0, 0)
        raw = b"".join(b"\x00" + r for r in rows)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw))

    blank = png([b"\xff" * 30] * 10)
    drawn = png([bytes(range(i, i + 30)) for i in range(10)])
    assert len(set(png_pixels(blank)[2])) <= 2
    assert png_pixels(drawn)[:2] == (10, 10) and len(set(png_pixels(drawn)[2])) > 20


class _Proxy(http.server.BaseHTTPRequestHandler):
    upstream = ""

    def do_GET(self) -> None:
        reply = httpx.get(
            self.upstream + self.path, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=10
        )
        self.send_response(reply.status_code)
        self.send_header("Content-Type", reply.headers.get("content-type", "text/html"))
        self.send_header("Content-Length", str(len(reply.content)))
        self.end_headers()
        self.wfile.write(reply.content)

    def log_message(self, *args: Any) -> None:
        return None


@contextlib.contextmanager
def proxy(upstream: str) -> Iterator[str]:
    handler = type("Proxy", (_Proxy,), {"upstream": upstream})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def screenshot(url: str, out: Path) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                f"--screenshot={out}",
                f"--window-size={WIDTH},{HEIGHT}",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )


def test_the_progress_page_renders_in_headless_chromium(tmp_path: Path) -> None:
    with serving(tmp_path) as server:
        client = server.client()
        up = client.files.create(file=("in.jsonl", jsonl(batch_lines(20))), purpose="batch")
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert wait_batch(client, batch.id, {"completed"}).status == "completed"
        upstream = f"http://127.0.0.1:{server.port}"
        with proxy(upstream) as url:
            html = httpx.get(url, timeout=10).text
            assert batch.id in html and 'http-equiv="refresh"' in html
            shot = tmp_path / "page.png"
            run = screenshot(url, shot)
    assert shot.is_file(), f"no screenshot (rc {run.returncode}): {run.stderr[-2000:]}"
    width, height, pixels = png_pixels(shot.read_bytes())
    assert (width, height) == (WIDTH, HEIGHT)
    assert shot.stat().st_size > 5_000 and len(set(pixels)) > 20, "the screenshot is blank"
