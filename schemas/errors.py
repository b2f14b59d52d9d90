"""Error codes and the one rule for turning a validation failure into words.

Every rejection names the field at fault (`param`), so a producer can fix a
bulk file line by line without reading worker logs.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, ValidationError

from schemas.ref import RequestRef


class ErrorCode(StrEnum):
    invalid_request = "invalid_request"
    unknown_model = "unknown_model"
    context_length_exceeded = "context_length_exceeded"
    deadline_exceeded = "deadline_exceeded"
    cancelled = "cancelled"
    engine_error = "engine_error"
    internal_error = "internal_error"
    duplicate_request_id = "duplicate_request_id"
    """The request_id already has a result from another job: ids are global."""
    tool_loop_max_turns = "tool_loop_max_turns"
    """The loop's last allowed turn still called tools (the result holds those calls)."""
    tool_loop_aborted = "tool_loop_aborted"
    """The loop could not go on (a continuation too large for the contract, a turn the
    tool-calls topic refused); the result holds the transcript so far."""
    result_too_large = "result_too_large"
    """The result could be (or came out) larger than `max_result_bytes` allows
    (`schemas.result_size`): n x max_tokens x top_logprobs asks for too much."""


class ErrorInfo(BaseModel):
    """The `error` object of a result that did not succeed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    code: ErrorCode
    message: str
    param: str | None = None


def loc_to_param(loc: tuple[int | str, ...]) -> str:
    """`("body", "messages", 0, "role")` -> `body.messages[0].role`.

    Pydantic inserts union-branch tags (e.g. `user`, `function-after[...]`) into
    locations; they mean nothing to a caller and are dropped. A tag is never followed by
    another tag of the same union, so a tag-like name right after a dropped tag is a field
    (`response_format` -> tag `json_schema` -> field `json_schema`; a text part's `text`).
    """
    out = ""
    after_tag = False
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            after_tag = False
        elif part.startswith("/"):  # the body union's tag, an endpoint path: a body field
            after_tag = True  # follows it, even one named like a tag (`user`)
        elif "[" in part or part.startswith("constrained-"):
            continue
        elif part in _UNION_TAGS and not after_tag:
            after_tag = True
        else:
            out += f".{part}" if out else part
            after_tag = False
    return out


_UNION_TAGS = frozenset(
    {
        "system",
        "user",
        "assistant",
        "tool",
        "developer",
        "str",
        "list[...]",
        "text",
        "json_object",
        "json_schema",
        "int",
        "ChatCompletionBody",
        "CompletionBody",
    }
)


class ContractError(ValueError):
    """A request that breaks the contract: carries code, message and the field at fault.

    `message` always starts with the field (`param: ...`) so that it reads well
    on its own in a result, a DLQ header or a CLI line. `ref` is what could be
    recovered of the request (id, job, custom_id, metadata, TTL), so its `failed`
    result still reaches its caller and its job.
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: ErrorCode = ErrorCode.invalid_request,
        request_id: str | None = None,
        ref: RequestRef | None = None,
    ) -> None:
        if param and not message.startswith(param):
            message = f"{param}: {message}"
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if ref is None and request_id is not None:
            ref = RequestRef(request_id=request_id)
        self.ref = ref

    @property
    def request_id(self) -> str | None:
        return self.ref.request_id if self.ref is not None else None

    def info(self) -> ErrorInfo:
        return ErrorInfo(code=self.code, message=self.message, param=self.param)

    @classmethod
    def from_validation(
        cls,
        exc: ValidationError,
        *,
        prefix: str = "",
        request_id: str | None = None,
        ref: RequestRef | None = None,
    ) -> ContractError:
        """The first error decides `param`; the message lists up to three."""
        errors = exc.errors(include_url=False)
        parts = []
        params: list[str] = []
        for err in errors[:3]:
            param = loc_to_param(tuple(err["loc"]))
            if err["type"] == "field_error":  # schemas.common.field_error: a model's field
                field = str((err.get("ctx") or {}).get("field", ""))
                param = f"{param}.{field}" if param and field else param or field
            if prefix:
                param = f"{prefix}.{param}" if param else prefix
            params.append(param)
            parts.append(f"{param or '(envelope)'}: {err['msg']}")
        more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
        return cls(
            "; ".join(parts) + more,
            param=params[0] or None if params else None,
            request_id=request_id,
            ref=ref,
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (self.message, self.param, self.code, self.ref))


def _rebuild(
    message: str, param: str | None, code: ErrorCode, ref: RequestRef | None
) -> ContractError:
    return ContractError(message, param=param, code=code, ref=ref)
