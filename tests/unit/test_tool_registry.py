"""Tools as code: schemas derived from signatures, HTTP tools from a config file (run
against a real local HTTP server), and loading a registry by reference."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from producer.tools import ToolCallContext, ToolRegistry
from schemas.tool_loop import ToolErrorKind
from worker.tool_loop.http import IDEMPOTENCY_HEADER, expand_env, load_http_tools
from worker.tool_loop.registry import InvalidArguments, load_registry, parse_arguments
from worker.tool_loop.runner import PendingCall, run_calls


def context(name: str = "t", **arguments: Any) -> ToolCallContext:
    return ToolCallContext(
        request_id="r1", turn=2, call_id="call_x", name=name, arguments=arguments
    )


def test_a_function_tool_gets_its_schema_and_description_from_the_signature() -> None:
    registry = ToolRegistry()

    @registry.tool(timeout_s=2)
    def get_weather(city: str, unit: str = "c", days: int = 1) -> dict[str, Any]:
        """Current weather for a city."""
        return {"city": city}

    (entry,) = registry.openai_tools()
    function = entry["function"]
    assert function["name"] == "get_weather"
    assert function["description"] == "Current weather for a city."
    params = function["parameters"]
    assert params["required"] == ["city"]
    assert params["properties"]["city"] == {"type": "string"}
    assert params["properties"]["days"] == {"type": "integer", "default": 1}
    assert params["additionalProperties"] is False
    spec = registry.get("get_weather")
    assert spec is not None and spec.timeout_s == 2 and not spec.sensitive
    assert get_weather("Oslo") == {"city": "Oslo"}  # the decorator returns the function


def test_arguments_are_validated_against_the_signature() -> None:
    registry = ToolRegistry()

    @registry.tool
    def add(a: int, b: int = 0) -> int:
        return a + b

    spec = registry.get("add")
    assert spec is not None
    assert spec.invoke(spec.validate({"a": 2, "b": 3}), context("add")) == 5
    for bad in ({}, {"a": "two"}, {"a": 1, "c": 1}):
        with pytest.raises(InvalidArguments):
            spec.validate(bad)


def test_registration_mistakes_fail_at_import_not_at_the_first_call() -> None:
    registry = ToolRegistry()

    @registry.tool
    def once() -> str:
        return ""

    with pytest.raises(ValueError, match="twice"):
        registry.tool(once)
    with pytest.raises(TypeError, match=r"\*args"):
        registry.tool(lambda *a: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        registry.tool(name="has space")(lambda: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        registry.tool(name="z", timeout_s=0)(lambda: None)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="nope"):
        registry.openai_tools("once", "nope")


def test_parse_arguments_wants_a_json_object() -> None:
    assert parse_arguments("") == {}
    assert parse_arguments('{"a": 1}') == {"a": 1}
    for bad in ("[1]", "{", "3", "[" * 100_000):
        with pytest.raises(InvalidArguments):
            parse_arguments(bad)


def test_load_registry_by_reference() -> None:
    from tests import tool_fixtures

    assert load_registry("tests.tool_fixtures:registry") is tool_fixtures.registry
    for bad in ("tests.tool_fixtures", ":registry", "tests.tool_fixtures:"):
        with pytest.raises(ValueError, match="module:attribute"):
            load_registry(bad)
    with pytest.raises(TypeError, match="not a ToolRegistry"):
        load_registry("tests.tool_fixtures:json")


def test_the_idempotency_key_names_the_call_not_the_delivery() -> None:
    assert context().idempotency_key == "r1:2:call_x"


class _Handler(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        self.seen.append(
            {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}
        )
        if self.path.startswith("/fail"):
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"down for maintenance")
            return
        if self.path.startswith("/big"):
            payload = b"y" * 5000
        else:
            payload = json.dumps({"ok": True, "path": self.path, "body": body}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def http_base() -> Iterator[str]:
    _Handler.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def write_config(tmp_path: Path, base: str, suffix: str = ".yaml") -> Path:
    tools = [
        {
            "name": "lookup",
            "description": "Look a thing up.",
            "url": f"{base}/lookup",
            "method": "GET",
            "headers": {"Authorization": "Bearer ${TOKEN}"},
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
                "required": ["q"],
            },
        },
        {"name": "create", "url": f"{base}/create", "method": "POST", "sensitive": True},
        {"name": "fails", "url": f"{base}/fail"},
        {"name": "big", "url": f"{base}/big", "method": "GET", "max_result_bytes": 100},
    ]
    path = tmp_path / f"tools{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"tools": tools}))
    else:
        import yaml

        path.write_text(yaml.safe_dump({"tools": tools}))
    return path


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_http_tools_call_their_endpoint_with_headers_and_an_idempotency_key(
    tmp_path: Path, http_base: str, suffix: str
) -> None:
    registry = ToolRegistry(permission=lambda call: True)
    for spec in load_http_tools(write_config(tmp_path, http_base, suffix), env={"TOKEN": "s3"}):
        registry.add(spec)
    calls = [
        PendingCall("r1", 1, "c1", "lookup", '{"q": "a b", "n": 2}'),
        PendingCall("r1", 1, "c2", "create", '{"x": [1]}'),
        PendingCall("r1", 1, "c3", "lookup", '{"n": 2}'),
        PendingCall("r1", 1, "c4", "fails", "{}"),
        PendingCall("r1", 1, "c5", "big", "{}"),
    ]
    ok_get, ok_post, invalid, failed, too_big = run_calls(registry, calls)
    assert ok_get.ok and json.loads(ok_get.content)["path"] == "/lookup?q=a+b&n=2"
    assert ok_post.ok and json.loads(json.loads(ok_post.content)["body"]) == {"x": [1]}
    assert invalid.error is ToolErrorKind.invalid_arguments and "q" in invalid.content
    assert failed.error is ToolErrorKind.exception and "HTTP 503" in failed.content
    assert "down for maintenance" in failed.content
    assert too_big.error is ToolErrorKind.result_too_large
    by_path = {s["path"].split("?")[0]: s for s in _Handler.seen}
    assert set(by_path) == {"/lookup", "/create", "/fail", "/big"}  # the invalid call never ran
    assert by_path["/lookup"]["headers"]["Authorization"] == "Bearer s3"
    assert by_path["/lookup"]["headers"][IDEMPOTENCY_HEADER] == "r1:1:c1"
    assert by_path["/create"]["headers"][IDEMPOTENCY_HEADER] == "r1:1:c2"
    assert by_path["/create"]["headers"]["Content-Type"] == "application/json"


def test_an_unreachable_endpoint_is_a_tool_error(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tools": [{"name": "gone", "url": "http://127.0.0.1:9/x"}]}))
    registry = ToolRegistry()
    for spec in load_http_tools(path, env={}):
        registry.add(spec)
    (record,) = run_calls(registry, [PendingCall("r", 1, "c", "gone", "{}")])
    assert record.error is ToolErrorKind.exception and "could not be reached" in record.content
    assert "127.0.0.1:9" not in record.content  # a URL may hold an expanded token


def test_a_bad_config_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps({"tools": [{"name": "x", "url": "http://h", "headers": {"A": "${NOPE}"}}]})
    )
    with pytest.raises(ValueError, match=r"t\.json.*NOPE"):
        load_http_tools(path, env={})
    for tool in (
        {"name": "x", "url": "file:///etc/passwd"},
        {"name": "x", "url": "http://h", "timeout_s": 0},
        {"name": "x", "url": "http://h", "surprise": 1},
        {"name": "x y", "url": "http://h"},
        {"name": "x", "url": "http://h", "parameters": {"type": "nonsense"}},
    ):
        path.write_text(json.dumps({"tools": [tool]}))
        with pytest.raises(ValueError, match=r"t\.json"):
            load_http_tools(path, env={})


def test_expand_env() -> None:
    assert expand_env("Bearer ${A}-${B_2}", {"A": "x", "B_2": "y"}) == "Bearer x-y"
    assert expand_env("no vars $A {A}", {}) == "no vars $A {A}"
    with pytest.raises(ValueError, match="MISSING"):
        expand_env("${MISSING}", {})


def test_string_annotations_resolve_in_the_tools_module() -> None:
    """Most modules use `from __future__ import annotations`; found on the H200, where a
    `Literal` parameter failed with "not fully defined"."""
    from tests.unit._future_tools import registry

    (entry,) = registry.openai_tools()
    city = entry["function"]["parameters"]["properties"]["city"]
    assert city == {"enum": ["Oslo", "Paris"], "type": "string"}
    spec = registry.get("forecast")
    assert spec is not None
    with pytest.raises(InvalidArguments):
        spec.validate({"city": "Rome"})
    with pytest.raises(TypeError, match="does not resolve"):
        ToolRegistry().tool(_unresolvable())


def _unresolvable() -> Any:
    def tool(x: NotDefinedAnywhere) -> None:  # type: ignore[name-defined]  # noqa: F821
        return None

    tool.__annotations__["x"] = "NotDefinedAnywhere"
    return tool


def test_a_bare_tool_loop_flag_means_the_default_turn_limit() -> None:
    from producer.cli_common import bare_tool_loop
    from schemas.limits import DEFAULT_TOOL_TURNS

    d = str(DEFAULT_TOOL_TURNS)
    assert bare_tool_loop(["bulk", "run", "f", "--tool-loop", "--registry", "m:r"]) == [
        "bulk", "run", "f", "--tool-loop", d, "--registry", "m:r",
    ]  # fmt: skip
    assert bare_tool_loop(["bulk", "run", "f", "--tool-loop"])[-1] == d
    assert bare_tool_loop(["bulk", "run", "--tool-loop", "f"]) == [
        "bulk", "run", "--tool-loop", d, "f",
    ]  # fmt: skip
    assert bare_tool_loop(["submit", "--tool-loop", "6"]) == ["submit", "--tool-loop", "6"]
    assert bare_tool_loop(["submit", "--tool-loop", "-1"]) == ["submit", "--tool-loop", "-1"]
    assert bare_tool_loop(["submit", "--tool-loop=3"]) == ["submit", "--tool-loop=3"]


def test_the_openai_tools_list_is_a_copy() -> None:
    registry = ToolRegistry()

    @registry.tool
    def count(n: int) -> int:
        return n

    offered = registry.openai_tools("count")
    offered[0]["function"]["parameters"]["properties"]["n"] = {"type": "string"}
    (again,) = registry.openai_tools("count")
    assert again["function"]["parameters"]["properties"]["n"] == {"type": "integer"}
    (record,) = run_calls(registry, [PendingCall("r", 1, "c", "count", '{"n": 3}')])
    assert record.ok and record.content == "3"
