"""HTTP tools do what their config says and no more (issue 40), against real sockets:
undeclared argument keys and keys the URL already sets are refused, a redirect to
another origin is refused (the configured secret header never leaves the configured
origin), and `timeout_s` bounds the whole call, not each read."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from schemas.tool_loop import ToolErrorKind
from worker.tool_loop.http import load_http_tools
from worker.tool_loop.registry import ToolRegistry
from worker.tool_loop.runner import PendingCall, run_calls


class _Seen(BaseHTTPRequestHandler):
    seen: list[tuple[str, str, str | None]] = []
    other = ""

    def do_GET(self) -> None:
        self.seen.append((self.server.server_address[1], self.path, self.headers.get("X-Secret")))  # type: ignore[index]
        if self.path.startswith("/away"):
            self.send_response(302)
            self.send_header("Location", f"{self.other}/stolen")
            self.end_headers()
            return
        if self.path.startswith("/here"):
            self.send_response(302)
            self.send_header("Location", "/landed")
            self.end_headers()
            return
        if self.path.startswith("/drip"):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(100):  # a byte every 0.1 s: each read is quick, the whole is not
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.1)
            return
        payload = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def servers() -> Iterator[tuple[str, str]]:
    _Seen.seen = []
    made = [ThreadingHTTPServer(("127.0.0.1", 0), _Seen) for _ in range(2)]
    for server in made:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    base, other = (f"http://127.0.0.1:{s.server_address[1]}" for s in made)
    _Seen.other = other
    yield base, other
    for server in made:
        server.shutdown()


def registry_for(tmp_path: Path, base: str) -> ToolRegistry:
    closed = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = [
        {"name": "find", "url": f"{base}/find?tenant=acme", "method": "GET",
         "headers": {"X-Secret": "s3cret"},
         "parameters": {"type": "object", "properties": {"q": {}, "tenant": {}}}},
        {"name": "post", "url": f"{base}/post", "method": "GET", "parameters": closed},
        {"name": "away", "url": f"{base}/away", "method": "GET", "headers": {"X-Secret": "s3cret"}},
        {"name": "here", "url": f"{base}/here", "method": "GET", "headers": {"X-Secret": "s3cret"}},
        {"name": "drip", "url": f"{base}/drip", "method": "GET", "timeout_s": 1},
    ]  # fmt: skip
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": tools}))
    registry = ToolRegistry()
    for spec in load_http_tools(path, env={}):
        registry.add(spec)
    return registry


def test_a_call_cannot_send_what_the_schema_does_not_declare(
    tmp_path: Path, servers: tuple[str, str]
) -> None:
    registry = registry_for(tmp_path, servers[0])
    owner, override, fine = run_calls(
        registry,
        [
            PendingCall("r", 1, "c1", "post", '{"q": "x", "owner": "admin"}'),
            PendingCall("r", 1, "c2", "find", '{"q": "x", "tenant": "evil"}'),
            PendingCall("r", 1, "c3", "find", '{"q": "x"}'),
        ],
    )
    assert owner.error is ToolErrorKind.invalid_arguments and "owner" in owner.content
    assert override.error is ToolErrorKind.invalid_arguments and "tenant" in override.content
    assert fine.ok and json.loads(fine.content)["path"] == "/find?tenant=acme&q=x"
    assert [path for _, path, _ in _Seen.seen] == ["/find?tenant=acme&q=x"]  # only one ran


def test_a_redirect_stays_on_its_origin_and_the_secret_with_it(
    tmp_path: Path, servers: tuple[str, str]
) -> None:
    base, other = servers
    registry = registry_for(tmp_path, base)
    away, here = run_calls(
        registry,
        [PendingCall("r", 1, "c1", "away", "{}"), PendingCall("r", 1, "c2", "here", "{}")],
    )
    assert away.error is ToolErrorKind.exception and "another origin" in away.content
    assert here.ok and json.loads(here.content)["path"] == "/landed"
    other_port = int(other.rsplit(":", 1)[1])
    assert all(port != other_port for port, _, _ in _Seen.seen)  # never reached, no secret


def test_timeout_bounds_the_whole_call(tmp_path: Path, servers: tuple[str, str]) -> None:
    registry = registry_for(tmp_path, servers[0])
    (drip,) = run_calls(registry, [PendingCall("r", 1, "c", "drip", "{}")])
    assert drip.error is ToolErrorKind.timeout
    # the call's thread ends too (it gave up reading at its deadline), long before the
    # endpoint's 100 drips (10 s) would be done
    deadline = time.monotonic() + 3
    while any(t.name.startswith("qbatch-tool") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the tool's thread still runs"
        time.sleep(0.05)
