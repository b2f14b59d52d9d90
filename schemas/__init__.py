"""qbatch's wire contract (v1): envelopes, results, errors, Redis keys, settings.

Everything that crosses a process boundary is defined here and only here.
"""

from schemas.batch import BatchInputLine, BatchOutputError, BatchOutputLine, BatchOutputResponse
from schemas.decode import decode_request, encode_request, parse_json, valid_id, validate_envelope
from schemas.errors import ContractError, ErrorCode, ErrorInfo
from schemas.keys import DONE_TOKEN, JobField, JobStatus, RedisKeys
from schemas.request import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    AssistantMessage,
    ChatCompletionBody,
    CompletionBody,
    FunctionCall,
    RequestEnvelope,
    SystemMessage,
    Tool,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from schemas.result import (
    AssistantOutput,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    ResultEnvelope,
    Status,
    Timings,
    ToolCallError,
    Usage,
    WorkerInfo,
)
from schemas.settings import ConnectionSettings

__all__ = [
    "CHAT_ENDPOINT",
    "COMPLETIONS_ENDPOINT",
    "DONE_TOKEN",
    "AssistantMessage",
    "AssistantOutput",
    "BatchInputLine",
    "BatchOutputError",
    "BatchOutputLine",
    "BatchOutputResponse",
    "ChatChoice",
    "ChatCompletion",
    "ChatCompletionBody",
    "Completion",
    "CompletionBody",
    "CompletionChoice",
    "ConnectionSettings",
    "ContractError",
    "ErrorCode",
    "ErrorInfo",
    "FunctionCall",
    "JobField",
    "JobStatus",
    "RedisKeys",
    "RequestEnvelope",
    "ResultEnvelope",
    "Status",
    "SystemMessage",
    "Timings",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolMessage",
    "Usage",
    "UserMessage",
    "WorkerInfo",
    "decode_request",
    "encode_request",
    "parse_json",
    "valid_id",
    "validate_envelope",
]
