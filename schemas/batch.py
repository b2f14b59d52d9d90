"""OpenAI Batch API line formats, for `qbatch bulk` input and output files.

See https://platform.openai.com/docs/guides/batch: input lines carry
`custom_id`, `method`, `url`, `body`; output lines carry `id`, `custom_id`,
`response{status_code, request_id, body}` and `error`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas import limits
from schemas.context import ContextReport
from schemas.request import Endpoint
from schemas.tool_loop import ToolLoopReport


class BatchInputLine(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    custom_id: Annotated[str, Field(min_length=1, max_length=limits.MAX_CUSTOM_ID_CHARS)]
    method: Literal["POST"] = "POST"
    url: Endpoint
    body: dict[str, Any]


class BatchOutputResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status_code: int
    request_id: str
    body: dict[str, Any] | None


class BatchOutputError(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str
    message: str


class BatchOutputLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    custom_id: str | None
    response: BatchOutputResponse | None
    error: BatchOutputError | None
    tool_loop: ToolLoopReport | None = None
    """qbatch's addition for lines run with `tool_loop`: the turns and their calls (a
    reader of the OpenAI shape can ignore it)."""
    context: ContextReport | None = None
    """qbatch's addition for lines with a `context` policy: what was dropped or cut."""
