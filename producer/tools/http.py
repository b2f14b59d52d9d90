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
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from producer.tools.registry import (
    DEFAULT_TIMEOUT_S,
    InvalidArguments,
    ToolCallContext,
    ToolSpec,
)
from schemas import json_schema, limits
from schemas.request import FunctionDef

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
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read(limit)
                charset = response.headers.get_content_charset() or "utf-8"
        except urllib.error.HTTPError as exc:
            text = exc.read(300).decode("utf-8", "replace")
            raise RuntimeError(f"HTTP {exc.code}: {text}") from None
        except urllib.error.URLError as exc:
            raise RuntimeError(f"{self.config.url}: {exc.reason}") from None
        return body.decode(charset, "replace")


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
