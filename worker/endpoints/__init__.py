"""The worker's handler of each endpoint (`schemas.endpoints`), by path.

A new endpoint is a handler module here and one line in `HANDLERS`; the renderer and the
result builder dispatch through `handler_for` and hold no branch per endpoint.
"""

from __future__ import annotations

from schemas.endpoints import ENDPOINTS, Response
from schemas.request import RequestEnvelope
from schemas.result import ToolCallError
from worker.endpoints.base import EndpointHandler, Prompt, RenderedPrompt
from worker.endpoints.chat import ChatHandler
from worker.endpoints.completions import CompletionsHandler
from worker.endpoints.embeddings import EmbeddingsHandler
from worker.engines.base import EngineOutput
from worker.toolcalls import IdFactory

HANDLERS: dict[str, EndpointHandler] = {
    handler.spec.path: handler
    for handler in (ChatHandler(), CompletionsHandler(), EmbeddingsHandler())
}
_missing = [spec.path for spec in ENDPOINTS if spec.path not in HANDLERS]
if _missing:  # a row of the table without a handler: fail at import, not per request
    raise ImportError(f"no worker handler for endpoint(s) {', '.join(_missing)}")


def handler_for(path: str) -> EndpointHandler:
    return HANDLERS[path]


def build_response(
    envelope: RequestEnvelope,
    rendered: RenderedPrompt,
    output: EngineOutput,
    *,
    model: str,
    created: int,
    id_factory: IdFactory | None = None,
    fingerprint: str | None = None,
) -> tuple[Response, list[ToolCallError]]:
    """The response for one finished request, and its tool-call errors (chat only).

    Raises ValueError for an output with finish="error": such a request gets a failed result
    carrying `output.error`, not a response.
    """
    if output.finish == "error":
        raise ValueError(
            f"request {output.key} failed in the engine ({output.error}); it has no response"
        )
    return handler_for(envelope.endpoint).build_response(
        envelope,
        envelope.body,
        rendered,
        output,
        model=model,
        created=created,
        fingerprint=fingerprint,
        id_factory=id_factory,
    )


__all__ = [
    "HANDLERS",
    "EndpointHandler",
    "Prompt",
    "RenderedPrompt",
    "build_response",
    "handler_for",
]
