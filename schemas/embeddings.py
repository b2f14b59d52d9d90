"""`/v1/embeddings`: OpenAI's request body and response, bounded.

One request embeds up to `MAX_EMBED_INPUTS` inputs (OpenAI's 2,048), each a string or a
list of token ids; the result holds one vector per input, in input order. The vectors are
last-token pooled and L2-normalised (what Qwen3-Embedding uses, and vLLM's pooling runner
does for it); `dimensions` keeps the first N components and normalises again (Matryoshka
truncation), only where the served model says it was trained for it.

`encoding_format: base64` sends each vector as the base64 of its little-endian float32
bytes (OpenAI's encoding, which the `openai` SDK decodes): a quarter of the JSON floats'
size, and what `qbatch bulk` asks for when a line does not choose.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas import limits
from schemas.common import StrictModel, field_error

MAX_EMBED_INPUTS = 2_048
"""Inputs in one request (OpenAI's bound)."""
MAX_EMBED_DIMENSIONS = 65_536
"""`dimensions` above this is no model's (the served model's own size is checked too)."""
FLOAT_JSON_BYTES = 24
"""What one float costs in a result's JSON at most (`-1.2345678901234567e-05,`)."""

EmbedText = Annotated[str, Field(min_length=1, max_length=limits.MAX_TEXT_CHARS)]
EmbedIds = Annotated[
    list[Annotated[int, Field(ge=0, lt=limits.TOKEN_ID_BOUND)]],
    Field(min_length=1, max_length=limits.MAX_PROMPT_TOKEN_IDS),
]
EmbedInput = (
    EmbedText
    | EmbedIds
    | Annotated[list[EmbedText], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]
    | Annotated[list[EmbedIds], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]
)
EncodingFormat = Literal["float", "base64"]


class EmbeddingBody(StrictModel):
    """OpenAI's embeddings body. `user` is kept for the caller and changes nothing."""

    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    input: EmbedInput
    encoding_format: EncodingFormat | None = None
    dimensions: Annotated[int, Field(strict=True, ge=1, le=MAX_EMBED_DIMENSIONS)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None

    ENDPOINT: ClassVar[Literal["embeddings"]] = "embeddings"

    @model_validator(mode="before")
    @classmethod
    def _inputs_by_shape(cls, data: Any) -> Any:
        """Name the input at fault (`body.input[3]`): the four shapes' union would report
        every shape's mismatch at `body.input` and hide which item is wrong. Bounded: the
        count is checked before any item is looked at."""
        value = data.get("input") if isinstance(data, dict) else None
        if isinstance(value, str) and not value:
            raise field_error("input", "an input must not be empty (OpenAI refuses it too)")
        if not isinstance(value, list):
            return data  # a single string, or a wrong type the union names
        if not value:
            raise field_error("input", "at least one input is needed")
        if len(value) > MAX_EMBED_INPUTS:
            raise field_error("input", f"{len(value)} inputs: at most {MAX_EMBED_INPUTS}")
        if isinstance(value[0], int) and not isinstance(value[0], bool):
            _check_ids(value, "input")  # one input of token ids
            return data
        kind = str if isinstance(value[0], str) else list
        for i, item in enumerate(value):
            if not isinstance(item, kind):
                raise field_error(
                    f"input[{i}]",
                    "every input of a list is of one kind: strings, or lists of token ids",
                )
            if not item:
                raise field_error(f"input[{i}]", "an input must not be empty")
            if isinstance(item, list):
                _check_ids(item, f"input[{i}]")
        return data

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list, one per vector (a single string or id list is one)."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)  # type: ignore[arg-type]

    def wire_format(self) -> EncodingFormat:
        return self.encoding_format or "float"

    # What every body answers for the code that sizes and samples results: an embedding
    # has no choices, log-probabilities, output budget or cache salt.
    cache_salt: ClassVar[None] = None

    def choices(self) -> int:
        return 1

    def top_logprobs_k(self) -> None:
        return None

    def output_limit(self) -> None:
        return None


def _check_ids(ids: list[Any], field: str) -> None:
    """Token ids, each named where it is wrong (`input[2][7]`)."""
    if len(ids) > limits.MAX_PROMPT_TOKEN_IDS:
        raise field_error(field, f"{len(ids)} token ids: at most {limits.MAX_PROMPT_TOKEN_IDS}")
    for j, tid in enumerate(ids):
        if isinstance(tid, bool) or not isinstance(tid, int):
            raise field_error(f"{field}[{j}]", "a token id is an integer")
        if not 0 <= tid < limits.TOKEN_ID_BOUND:
            raise field_error(f"{field}[{j}]", f"token id {tid} is out of range")


class Embedding(BaseModel):
    model_config = ConfigDict(extra="forbid")

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    """Floats, or with `encoding_format: base64` the base64 of their float32 bytes."""


class EmbeddingUsage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)

    # Not on the wire (OpenAI's embeddings usage has only the two above): what usage
    # accounting reads of every response's usage, so it needs no branch per endpoint.
    completion_tokens: ClassVar[int] = 0
    completion_tokens_details: ClassVar[None] = None
    prompt_tokens_details: ClassVar[None] = None


class EmbeddingList(BaseModel):
    """OpenAI's `CreateEmbeddingResponse`. Field order matters: `data` comes before `model`
    and `usage`, so a reader that needs only the usage skips the vectors unparsed
    (`schemas.result.light_result`)."""

    model_config = ConfigDict(extra="forbid")

    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    id: str | None = None
    """qbatch's own: `embd-{request_id}` (OpenAI's response has no id)."""
    created: int | None = None


def encode_vector(vector: Sequence[float], fmt: EncodingFormat) -> list[float] | str:
    """One vector as the wire carries it."""
    if fmt == "float":
        return [float(x) for x in vector]
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def decode_vector(value: list[float] | str) -> list[float]:
    """The floats of a vector either way it was encoded (what the `openai` SDK does)."""
    if isinstance(value, list):
        return value
    raw = base64.b64decode(value)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def embedding_result_bytes(n_inputs: int, dims: int, fmt: EncodingFormat) -> int:
    """How large an embeddings result can get: what `max_result_bytes` bounds. Each input
    costs its vector, its item's keys and a context report's truncation entry; the rest of
    the envelope (metadata, custom_id, timings, worker) as much as a generation result's."""
    per_vector = (dims * 4 + 2) // 3 * 4 + 8 if fmt == "base64" else dims * FLOAT_JSON_BYTES
    return n_inputs * (per_vector + 112) + limits.RESULT_OVERHEAD_BYTES


__all__ = [
    "MAX_EMBED_DIMENSIONS",
    "MAX_EMBED_INPUTS",
    "Embedding",
    "EmbeddingBody",
    "EmbeddingList",
    "EmbeddingUsage",
    "EncodingFormat",
    "decode_vector",
    "embedding_result_bytes",
    "encode_vector",
]
