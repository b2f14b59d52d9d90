"""The route table: which worker pool (requests topics) serves which model.

One front (the client, `qbatch bulk`, `qbatch serve`) can feed several worker pools, one
per model, each consuming its own topics. The table maps a model name or alias (what a
request's `body.model` says) to that pool's interactive `topic` and, optionally, its
`bulk_topic` (default: `topic`):

    {"qwen3-8b": {"topic": "qbatch.qwen3-8b", "bulk_topic": "qbatch.qwen3-8b.bulk"},
     "qwen":     {"topic": "qbatch.qwen3-8b", "bulk_topic": "qbatch.qwen3-8b.bulk"},
     "llama-70b": {"topic": "qbatch.llama-70b"}}

It comes from `QBATCH_ROUTES` (that JSON) or a `--routes FILE` (YAML or JSON). No table
(the default) means today's single pool: `--topic` / `--bulk-topic` / lanes, whatever
the model. With a table, a request whose `body.model` is missing or not in it is a
`ContractError` (code `unknown_model`, param `body.model`) before anything is published.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from schemas.documents import DocumentError, read_document
from schemas.errors import ContractError, ErrorCode

MODEL_PARAM = "body.model"


class Route(BaseModel):
    """One worker pool's requests topics."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    topic: str = Field(min_length=1, max_length=249)
    bulk_topic: str | None = Field(
        None, min_length=1, max_length=249, description="Bulk lane topic (default: topic)."
    )

    def topic_for(self, bulk: bool) -> str:
        return (self.bulk_topic or self.topic) if bulk else self.topic


class RouteTable(RootModel[dict[str, Route]]):
    """Model name or alias -> `Route` (at least one entry)."""

    model_config = ConfigDict(frozen=True)

    root: dict[str, Route] = Field(min_length=1)

    @property
    def models(self) -> list[str]:
        """Every name and alias, in the table's order."""
        return list(self.root)

    def route(self, model: object) -> Route:
        """The route of `model` (a body's `model` value); ContractError naming body.model
        when it is missing or nobody serves it."""
        if not isinstance(model, str) or not model:
            raise ContractError(
                f"is required when the front serves several models; one of {self._names()}",
                param=MODEL_PARAM,
                code=ErrorCode.unknown_model,
            )
        found = self.root.get(model)
        if found is None:
            raise ContractError(
                f"model {model!r} is not served here; served models: {self._names()}",
                param=MODEL_PARAM,
                code=ErrorCode.unknown_model,
            )
        return found

    def route_body(self, body: Mapping[str, Any]) -> Route:
        return self.route(body.get("model"))

    def _names(self) -> str:
        names = self.models
        shown = ", ".join(names[:20])
        return shown + (f", ... ({len(names)} in all)" if len(names) > 20 else "")


class RoutesError(ValueError):
    """A route table that cannot be read or is not valid (the message says why)."""


def parse_routes(data: object, source: str = "routes") -> RouteTable:
    try:
        return RouteTable.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise RoutesError(f"{source}: {where or '(table)'}: {first['msg']}") from None


def load_routes(path: Path) -> RouteTable:
    """Read a route table from a YAML (`.yaml`/`.yml`) or JSON file."""
    try:
        data = read_document(path)
    except OSError as exc:
        raise RoutesError(f"{path}: {exc.strerror or exc}") from None
    except DocumentError as exc:
        raise RoutesError(str(exc)) from None
    return parse_routes(data, str(path))


__all__ = ["Route", "RouteTable", "RoutesError", "load_routes", "parse_routes"]
