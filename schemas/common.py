"""Building blocks every wire model shares: strict models, bounded text, caller JSON."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from schemas import limits

Text = Annotated[str, Field(max_length=limits.MAX_TEXT_CHARS)]

_INT_BOUND = 10**limits.MAX_JSON_INT_DIGITS


def _finite_json(value: dict[str, Any]) -> dict[str, Any]:
    """Free-form JSON fields hold only what JSON can say. Python's parser (and pydantic's)
    accept `NaN` and `Infinity`, which no JSON reader need understand and which come back
    as null once the result is written, so a request's metadata would not be echoed as
    sent; an integer of thousands of digits Python's own `json` cannot read back; and a
    caller in Python can pass sets, bytes or objects; and a string holding a lone UTF-16
    surrogate (`"\\ud800"` is valid JSON text), which no UTF-8 writer can encode, so the
    worker could not write the request's result or its next tool-loop turn. Rejected at
    the edge, naming where."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        where = path or "(value)"
        if isinstance(item, str):
            _utf8(item, where)
            continue
        if isinstance(item, bool) or item is None:
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(f"{where}: {item} is not a JSON number")
        elif isinstance(item, int):
            if not -_INT_BOUND < item < _INT_BOUND:
                raise ValueError(
                    f"{where}: integer of more than {limits.MAX_JSON_INT_DIGITS} digits"
                )
        elif isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str):
                    raise ValueError(f"{where}: object keys must be strings, got {k!r}")
                _utf8(k, f"{where}: a key")
                stack.append((f"{path}.{k}" if path else k, v))
        elif isinstance(item, list | tuple):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(item))
        else:
            raise ValueError(f"{where}: a {type(item).__name__} is not JSON")
    return value


def _utf8(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where}: a lone surrogate (\\u{ord(text[exc.start]):04x}) is not text"
        ) from None


# A JSON object from the caller that qbatch passes along without a model of its own
# (metadata, tool parameter schemas, response schemas, chat-template arguments).
JsonObject = Annotated[dict[str, Any], AfterValidator(_finite_json)]


class StrictModel(BaseModel):
    """Unknown fields are refused: a misspelt `max_token` must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def field_error(field: str, message: str) -> PydanticCustomError:
    """An error a model-level validator raises about one of its fields: the field travels in
    the error's context, and `ContractError.from_validation` appends it to `param`, so
    `body.top_logprobs` is named rather than `body`."""
    return PydanticCustomError("field_error", "{message}", {"field": field, "message": message})
