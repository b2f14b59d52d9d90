"""The result envelope: what a worker writes to `{prefix}:result:{request_id}`.

`response` is a plain OpenAI ChatCompletion or Completion object so that code
written against the OpenAI SDK's types can read it unchanged.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.context import ContextReport
from schemas.embeddings import EmbeddingList
from schemas.errors import ErrorCode, ErrorInfo
from schemas.messages import ToolCall
from schemas.ref import RequestRef
from schemas.tool_loop import ToolLoopReport
from schemas.usage import Usage

if TYPE_CHECKING:
    from schemas.request import RequestEnvelope


class ResultModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Status(StrEnum):
    succeeded = "succeeded"
    failed = "failed"
    expired = "expired"
    cancelled = "cancelled"


FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "abort"]


class AssistantOutput(ResultModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    """None (and left out of the stored JSON) when the turn only called tools."""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(ResultModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ResultModel):
    """OpenAI's `ChatCompletionTokenLogprob`."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResultModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(ResultModel):
    """The legacy completions `logprobs` object (parallel lists, one entry per token)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(ResultModel):
    index: int = 0
    message: AssistantOutput
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(ResultModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    """Engine, model and qbatch version the answer came from (`worker.fingerprint`)."""


class CompletionChoice(ResultModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class Completion(ResultModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallError(ResultModel):
    """A `<tool_call>` block the model emitted that did not parse or validate."""

    index: int
    raw: str
    reason: str
    name: str | None = None
    choice: int = 0
    """The `choices[]` index of the output it was in (with `n` > 1)."""


class Timings(ResultModel):
    """Epoch milliseconds at each stage a request passed, and the spans between them, so
    an operator sees which stage held a request: `queue_ms` (in Kafka), `batch_wait_ms`
    (in the worker until its micro-batch was dispatched), `admission_ms` (the batch's
    dedupe/cancel look-up), `render_ms` (its batch rendered), `engine_wait_ms` (in the
    engine's queue until first scheduled), `prefill_ms` (scheduled to first token),
    `generation_ms` (first token to finished), `inference_ms` (dispatched to finished).
    A stage an engine cannot tell (first scheduled, first token) is left out."""

    submitted: int | None = None
    dequeued: int | None = None
    dispatched: int | None = None
    admitted: int | None = None
    engine_submitted: int | None = None
    scheduled: int | None = None
    first_token: int | None = None
    finished: int | None = None
    queue_ms: float | None = None
    batch_wait_ms: float | None = None
    admission_ms: float | None = None
    render_ms: float | None = None
    engine_wait_ms: float | None = None
    prefill_ms: float | None = None
    generation_ms: float | None = None
    inference_ms: float | None = None

    @classmethod
    def of(
        cls,
        *,
        submitted: int | None,
        dequeued: int | None,
        dispatched: int | None,
        finished: int | None,
        admitted: int | None = None,
        engine_submitted: int | None = None,
        scheduled: int | None = None,
        first_token: int | None = None,
    ) -> Timings:
        return cls(
            submitted=submitted,
            dequeued=dequeued,
            dispatched=dispatched,
            admitted=admitted,
            engine_submitted=engine_submitted,
            scheduled=scheduled,
            first_token=first_token,
            finished=finished,
            queue_ms=_span(submitted, dequeued),
            batch_wait_ms=_span(dequeued, dispatched),
            admission_ms=_span(dispatched, admitted),
            render_ms=_span(admitted, engine_submitted),
            engine_wait_ms=_span(engine_submitted, scheduled),
            prefill_ms=_span(scheduled, first_token),
            generation_ms=_span(first_token, finished),
            inference_ms=_span(dispatched, finished),
        )

    def stages_ms(self) -> dict[str, float]:
        """The spans that are known, by stage name (for the stage histogram)."""
        spans = {
            "queue": self.queue_ms,
            "batch_wait": self.batch_wait_ms,
            "admission": self.admission_ms,
            "render": self.render_ms,
            "engine_wait": self.engine_wait_ms,
            "prefill": self.prefill_ms,
            "generation": self.generation_ms,
        }
        return {k: v for k, v in spans.items() if v is not None}


def _span(a: int | None, b: int | None) -> float | None:
    return float(b - a) if a is not None and b is not None else None


class WorkerInfo(ResultModel):
    id: str
    batch_id: str | None = None
    batch_size: int | None = None
    model: str | None = None
    engine: str | None = None


RESULT_HEAD_BYTES = 400
"""The stored JSON's first bytes always hold `v`, `request_id`, `job_id` and `status`
(ids are at most 128 characters): Redis scripts read those fields from this prefix
(`schemas/lua/result_head.lua`) instead of decoding a result of any size."""

_HEAD = re.compile(
    rb'\{"v":1,"request_id":"[^"]*",(?:"job_id":"([^"]*)",)?(?:"status":"([a-z]+)")?'
)


def result_head(head: bytes) -> tuple[str, str]:
    """(job_id, status) from a stored result's first bytes ('' for what they do not hold):
    the Python twin of `schemas/lua/result_head.lua`, for the pipelines a Redis Cluster
    needs instead of one script."""
    found = _HEAD.match(head)
    if found is None:
        return "", ""
    job, status = found.groups()
    return (job or b"").decode(), (status or b"").decode()


_SUCCEEDED_HEAD = re.compile(
    rb'\{"v":1,"request_id":"[^"]*",(?:"job_id":"[^"]*",)?"status":"succeeded","response":'
)
_RESPONSE_END = b',"tool_call_errors":'
_EMBEDDINGS_HEAD = b'{"object":"list","data":['


def response_span(raw: bytes) -> tuple[int, int] | None:
    """Where the `response` object of a stored *succeeded* result is in its JSON, found
    without parsing it: a result can be megabytes, parsed at ~60x its size in Python
    objects (one such answer OOM-killed `qbatch serve`), while its response goes out as
    it is. The response follows the head and ends where `tool_call_errors` (always
    written) begins; no key of that name lives inside a response, and no string value
    holds an unescaped quote. None for anything else (a failure, an older layout)."""
    found = _SUCCEEDED_HEAD.match(raw)
    if found is None:
        return None
    start = found.end()
    end = raw.find(_RESPONSE_END, start)
    return (start, end) if end > start else None


def light_result(raw: bytes, span: tuple[int, int]) -> ResultEnvelope:
    """The stored result parsed without its response's `choices` (ids, model, usage,
    timings: what accounting needs), at the cost of its small parts only. The choices
    are the first `"choices"` key of the response and end where its top-level `"usage"`
    begins (choices hold no such key). An embeddings response's `data` is skipped the
    same way: it opens the response and ends where its `"model"` begins (vectors hold
    only numbers and base64 strings)."""
    start, end = span
    if raw.startswith(_EMBEDDINGS_HEAD, start):  # the vectors: what it skips for embeddings
        model = raw.rfind(b'],"model":', start, end)
        if model > start:
            return ResultEnvelope.model_validate_json(
                raw[: start + len(_EMBEDDINGS_HEAD)] + raw[model:]
            )
        return ResultEnvelope.model_validate_json(raw)
    choices = raw.find(b',"choices":[', start, end)
    usage = raw.rfind(b',"usage":{', start, end)
    if choices < 0 or usage < choices:
        return ResultEnvelope.model_validate_json(raw)
    return ResultEnvelope.model_validate_json(raw[:choices] + b',"choices":[]' + raw[usage:])


def read_stored(raw: bytes) -> tuple[ResultEnvelope, tuple[int, int] | None]:
    """A stored result for a reader that passes its response on as it is: the result
    (without its response's choices when it succeeded: `light_result`) and where the
    response is in `raw` (None: not a succeeded result of this layout; parsed whole)."""
    span = response_span(raw)
    if span is None:
        return ResultEnvelope.model_validate_json(raw), None
    return light_result(raw, span), span


class ResultEnvelope(ResultModel):
    """Exactly one per request_id; `error` is set whenever status is not succeeded."""

    # Field order matters: `v`, `request_id`, `job_id`, `status` come first in the JSON,
    # so the first RESULT_HEAD_BYTES of a stored result hold them (see there); then
    # `response`, followed by `tool_call_errors` (always written), so a reader can take
    # the response's bytes as they are (`response_span`).
    v: Literal[1] = 1
    request_id: str
    job_id: str | None = None
    status: Status
    response: ChatCompletion | Completion | EmbeddingList | None = None
    tool_call_errors: list[ToolCallError] = Field(default_factory=list)
    error: ErrorInfo | None = None
    custom_id: str | None = None
    metadata: dict[str, Any] | None = None
    tool_loop: ToolLoopReport | None = None
    """Set on the result of a request run with `tool_loop`: its turns and their calls."""
    context: ContextReport | None = None
    """Set when the request had a `context` policy: what was dropped or cut to fit."""
    timings: Timings = Field(default_factory=Timings)
    worker: WorkerInfo | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.succeeded

    @classmethod
    def for_request(
        cls,
        request: RequestEnvelope | RequestRef,
        status: Status,
        *,
        response: ChatCompletion | Completion | EmbeddingList | None = None,
        error: ErrorInfo | None = None,
        tool_call_errors: list[ToolCallError] | None = None,
        timings: Timings | None = None,
        worker: WorkerInfo | None = None,
        context: ContextReport | None = None,
    ) -> ResultEnvelope:
        """The one way a result is made, for every outcome, by worker and producer alike: it
        echoes the request's id, job, custom_id and metadata, so no outcome loses its job."""
        # A RequestEnvelope and a RequestRef both carry the four echoed fields (no RequestRef
        # is built for the common case: this runs once per result).
        if status is not Status.succeeded and error is None:
            raise ValueError(f"a {status} result needs an error")
        return cls(
            request_id=request.request_id,
            job_id=request.job_id,
            custom_id=request.custom_id,
            metadata=request.metadata,
            status=status,
            response=response,
            error=error,
            tool_call_errors=tool_call_errors or [],
            timings=timings or Timings(),
            worker=worker,
            context=context,
        )

    @classmethod
    def failure(
        cls,
        request: RequestEnvelope | RequestRef,
        code: ErrorCode,
        message: str,
        *,
        param: str | None = None,
        status: Status = Status.failed,
        timings: Timings | None = None,
        worker: WorkerInfo | None = None,
    ) -> ResultEnvelope:
        """Shorthand for a result that did not succeed."""
        return cls.for_request(
            request,
            status,
            error=ErrorInfo(code=code, message=message, param=param),
            timings=timings,
            worker=worker,
        )
