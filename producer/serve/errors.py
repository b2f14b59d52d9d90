"""Errors of `qbatch serve`, in OpenAI's shape: `{"error": {message, type, param, code}}`.

Every failure the API answers goes through `ApiError`, so a client written for OpenAI
(the `openai` SDK maps the status to `BadRequestError`, `AuthenticationError`,
`NotFoundError`, ...) reads qbatch's errors the way it reads OpenAI's. Pure.
"""

from __future__ import annotations

from typing import Any


def error_type(status: int) -> str:
    """OpenAI's `type` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class ApiError(Exception):
    """An answer of `status` with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or error_type(status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def not_found(kind: str, object_id: str) -> ApiError:
    """OpenAI's 404 wording; also what another tenant's id gets (it tells nothing)."""
    return ApiError(404, f"No such {kind} object: {object_id}", code="not_found", param="id")


def openai_param(param: str | None) -> str | None:
    """A contract field path (`body.messages[0].role`) as OpenAI names it (`messages[0].role`)."""
    if param is None or param == "(envelope)":
        return None
    return param.removeprefix("body.")


def openai_code(code: object) -> str:
    """A contract error code as OpenAI names it (`unknown_model` -> `model_not_found`)."""
    text = str(code)
    return "model_not_found" if text == "unknown_model" else text


__all__ = ["ApiError", "error_type", "not_found", "openai_code", "openai_param"]
