"""HTTP tools from a config file: a call becomes one request to an endpoint.

```yaml
tools:
  - name: get_weather
    description: Current weather for a city.
    url: https://weather.internal/v1/current
    method: GET                 # GET: arguments as query parameters; else a JSON body
    headers:
      Authorization: "Bearer ${WEATHER_TOKEN}"   # ${VAR} from the executor's environment
    parameters:                 # JSON Schema of the arguments (checked before the call)
      type: object
      properties: {city: {type: string}}
      required: [city]
    timeout_s: 5
    max_result_bytes: 16384
    sensitive: false
```

Every request carries `Idempotency-Key: {request_id}:{turn}:{call_id}`, stable across
redeliveries, so an endpoint that honours the header does not act twice for one call. A
non-2xx answer is a tool error the model sees (status and the start of the body). A
missing `${VAR}` fails loading, not the first call.

What a model can make a call do is what the config says, no more (issue 40):

- **Closed schemas**: an argument the schema's `properties` do not declare is a tool
  error (unless the schema sets `additionalProperties`), and so is one named like a
  query parameter the configured URL already carries (`?tenant=acme&tenant=evil`);
- **No redirect to another origin**: a redirect to another scheme, host or port is a tool
  error, so the configured headers (secrets) only ever go to the configured origin;
- **A deadline for the whole call**: `timeout_s` bounds the call from connect to its last
  byte (an endpoint dripping a byte at a time held its thread for ever: the socket
  timeout is per read).
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from schemas import json_schema, limits
from schemas.request import FunctionDef
from worker.tool_loop.spec import (
    DEFAULT_TIMEOUT_S,
    InvalidArguments,
    ToolCallContext,
    ToolError,
    ToolSpec,
)

IDEMPOTENCY_HEADER = "Idempotency-Key"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class HttpToolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=limits.TOOL_NAME_PATTERN)
    description: str = ""
    url: str = Field(pattern=r"^https?://")
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "POST"
    headers: dict[str, str] = Field(default_factory=dict)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=600)
    max_result_bytes: int = Field(limits.DEFAULT_TOOL_RESULT_BYTES, ge=1)
    sensitive: bool = False

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        FunctionDef(name="x", parameters=value)  # the same checks a request's tools get
        return value


class ToolsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tools: list[HttpToolConfig]


def expand_env(text: str, env: Mapping[str, str]) -> str:
    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise ValueError(f"environment variable {name} is not set")
        return env[name]

    return _VAR.sub(sub, text)


class HttpTool(ToolSpec):
    def __init__(self, config: HttpToolConfig, env: Mapping[str, str]) -> None:
        self.config = config
        self.name = config.name
        self.description = config.description
        self.parameters = config.parameters
        self.timeout_s = config.timeout_s
        self.max_result_bytes = config.max_result_bytes
        self.sensitive = config.sensitive
        self.headers = {k: expand_env(v, env) for k, v in config.headers.items()}
        self._validator = json_schema.validator(config.parameters)

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        declared = self.parameters.get("properties")
        if isinstance(declared, dict) and "additionalProperties" not in self.parameters:
            undeclared = sorted(set(arguments) - set(declared))
            if undeclared:
                raise InvalidArguments(
                    f"{undeclared[0]}: not an argument of this tool (its schema declares "
                    f"{', '.join(sorted(declared)) or 'none'})"
                )
        fixed = set(urllib.parse.parse_qs(urllib.parse.urlsplit(self.config.url).query))
        if self.config.method == "GET" and fixed & set(arguments):
            name = sorted(fixed & set(arguments))[0]
            raise InvalidArguments(f"{name}: set by the tool's URL, not by a call")
        try:
            found = json_schema.errors(self._validator, dict(arguments))
        except json_schema.TooCostly as exc:
            raise InvalidArguments(
                f"too costly to check against the tool's schema ({exc})"
            ) from None
        errors = sorted(found, key=lambda e: e.path)
        if errors:
            first = errors[0]
            where = ".".join(str(p) for p in first.absolute_path) or "(arguments)"
            raise InvalidArguments(f"{where}: {first.message}")
        return dict(arguments)

    def invoke(self, validated: Any, call: ToolCallContext) -> str:
        headers = {**self.headers, IDEMPOTENCY_HEADER: call.idempotency_key}
        url, data = self.config.url, None
        if self.config.method == "GET":
            query = {k: v if isinstance(v, str) else json.dumps(v) for k, v in validated.items()}
            if query:
                url += ("&" if "?" in url else "?") + urllib.parse.urlencode(query)
        else:
            data = json.dumps(validated).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, headers=headers, method=self.config.method)
        limit = self.max_result_bytes + 1  # one byte more tells "too large" from "fits"
        deadline = time.monotonic() + self.timeout_s
        try:
            with _OPENER.open(request, timeout=self.timeout_s) as response:
                body = _read_by(response, limit, deadline)
                charset = response.headers.get_content_charset() or "utf-8"
        except urllib.error.HTTPError as exc:
            text = exc.read(300).decode("utf-8", "replace")
            raise ToolError(f"HTTP {exc.code}: {text}") from None
        except urllib.error.URLError as exc:
            # not the URL: an env-expanded token in it would reach the transcript
            raise ToolError(f"the endpoint could not be reached: {exc.reason}") from None
        return body.decode(charset, "replace")


class _SameOrigin(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to the same scheme, host and port."""

    def redirect_request(
        self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> Any:
        if _origin(newurl) != _origin(req.full_url):
            raise urllib.error.URLError(f"redirect to another origin ({_origin(newurl)}) refused")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or default


_OPENER = urllib.request.build_opener(_SameOrigin)


def _read_by(response: Any, limit: int, deadline: float) -> bytes:
    """Up to `limit` bytes of the body, all of them before `deadline` (TimeoutError past
    it): each read may wait only what is left of the call's time."""
    sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
    body = bytearray()
    while len(body) < limit:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the endpoint did not answer within the tool's timeout_s")
        if sock is not None:
            sock.settimeout(left)
        chunk = response.read1(min(65_536, limit - len(body)))
        if not chunk:
            break
        body += chunk
    return bytes(body)


def load_http_tools(path: str | Path, env: Mapping[str, str] | None = None) -> list[HttpTool]:
    """The tools of a YAML (.yaml/.yml) or JSON file; every error names the file."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        parsed = ToolsFile.model_validate(data)
        environ = os.environ if env is None else env
        return [HttpTool(cfg, environ) for cfg in parsed.tools]
    except (ValueError, ValidationError) as exc:
        raise ValueError(f"{path}: {exc}") from None


__all__ = ["IDEMPOTENCY_HEADER", "HttpTool", "HttpToolConfig", "expand_env", "load_http_tools"]
