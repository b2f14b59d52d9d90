"""Body fields -> a `SamplingSpec`, and a model's sampling defaults. Pure but for reading
`generation_config.json`.

Split from `worker.rendering` because it runs for every request, including the echo
engine's thousands a second: the short path for the common plain request lives here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from schemas.request import ChatCompletionBody, CompletionBody, JsonObjectFormat, JsonSchemaFormat
from worker.engines.base import SamplingSpec

__all__ = ["GENERATION_DEFAULT_KEYS", "load_generation_defaults", "sampling_from_body"]

GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")
"""generation_config.json keys that become defaults for unset body fields (vLLM `auto`)."""


def load_generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults in a model's `generation_config.json` ({} when there is none)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {key: data[key] for key in GENERATION_DEFAULT_KEYS if data.get(key) is not None}


_PLAIN_FIELDS = frozenset(
    {
        "messages",
        "prompt",
        "model",
        "max_tokens",
        "max_completion_tokens",
        *GENERATION_DEFAULT_KEYS,
        "tools",
        "tool_choice",
        "chat_template_kwargs",
        "user",
    }
)
"""Body fields that leave every SamplingSpec field past the five generation defaults at
its default: a request that sets only these (most do) takes `sampling_from_body`'s short
path. An allowlist, so a field added later takes the full path until it is listed."""


@functools.lru_cache(maxsize=4096)
def _plain_spec(*items: tuple[str, Any]) -> SamplingSpec:
    """SamplingSpecs are frozen, so requests that ask the same share one (most requests
    differ at most in max_tokens and temperature; building one is ~2 us of 25 fields)."""
    return SamplingSpec(**dict(items))


def sampling_from_body(
    body: ChatCompletionBody | CompletionBody,
    max_tokens: int,
    generation_defaults: Mapping[str, Any] | None = None,
) -> SamplingSpec:
    """Map OpenAI body fields onto a `SamplingSpec`; unset fields fall back to the defaults."""
    given = body.model_fields_set
    defaults = generation_defaults or {}
    kwargs: dict[str, Any] = {"max_tokens": max_tokens}
    for name in GENERATION_DEFAULT_KEYS:
        value = getattr(body, name) if name in given else None
        if value is None:
            value = defaults.get(name)
        if value is not None:
            kwargs[name] = int(value) if name == "top_k" else float(value)
    if given <= _PLAIN_FIELDS:
        return _plain_spec(*kwargs.items())
    fmt = body.response_format
    if isinstance(fmt, JsonSchemaFormat):
        kwargs["json_schema"] = fmt.json_schema.schema_
    elif isinstance(fmt, JsonObjectFormat):
        kwargs["json_object"] = True
    structured = body.structured_outputs
    if structured is not None:
        kwargs["json_schema"] = structured.json_
        kwargs["json_object"] = bool(structured.json_object)
        kwargs["choice"] = tuple(structured.choice) if structured.choice else None
    return SamplingSpec(
        **kwargs,
        seed=body.seed,
        stop=tuple(body.stop_list()),
        ignore_eos=bool(body.ignore_eos),
        min_tokens=min(body.min_tokens or 0, max_tokens),
        n=body.choices(),
        logprobs=body.top_logprobs_k(),
        min_p=_opt_float(body.min_p),
        repetition_penalty=_opt_float(body.repetition_penalty),
        logit_bias=tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        allowed_token_ids=tuple(body.allowed_token_ids) if body.allowed_token_ids else None,
        bad_words=tuple(body.bad_words or ()),
    )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
