"""Size bounds of the v1 contract.

They exist so that one hostile or buggy producer cannot make a worker allocate
without bound or smuggle megabytes into Redis. The envelope bound sits below
Kafka's default `message.max.bytes` (1 MiB) so that anything the broker accepts
and we reject is rejected for a reason we can name.
"""

from __future__ import annotations

SCHEMA_VERSION = 1
MAX_ENVELOPE_BYTES = 1_000_000
MAX_MESSAGES = 1_024
MAX_TEXT_CHARS = 900_000
MAX_TOOLS = 128
MAX_TOOL_SCHEMA_BYTES = 64_000
MAX_METADATA_BYTES = 16_384
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_OUTPUT_TOKENS = 262_144
RESULT_OVERHEAD_BYTES = 24_576
"""A result's envelope around its output: ids, metadata (up to 16 KiB), usage, timings."""
MAX_PROMPT_TOKEN_IDS = 262_144
MAX_RESULT_TTL_S = 30 * 86_400
DEFAULT_RESULT_TTL_S = 86_400
ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_CUSTOM_ID_CHARS = 512
PRIORITY_BOUND = 2**31
RESERVED_JOB_SUFFIXES = (":done", ":cancel", ":counted", ":lines")
"""A job_id may not end with these: `{prefix}:job:{job_id}` + suffix names the job's own
stream and cancel flag (see schemas/keys.py), so a job called `vic:done` would be job
`vic`'s stream."""
MAX_JSON_INT_DIGITS = 1_000
"""Integers in free-form JSON (metadata, schemas) beyond this are refused: Python's own
JSON reader gives up at 4,300 digits, so a result echoing one could not be read back."""
MAX_TOOL_TURNS = 16
"""A tool loop runs the model at most this many times (`tool_loop.max_turns`)."""
DEFAULT_TOOL_TURNS = 4
DEFAULT_TOOL_RESULT_BYTES = 16_384
"""A tool's result beyond this many bytes (UTF-8) is refused (`max_result_bytes`)."""
MAX_CHOICES = 16
"""`n`: choices per request (each is a sequence in the engine's batch)."""
MAX_TOP_LOGPROBS = 20
"""`top_logprobs` / completions `logprobs`: vLLM's default `max_logprobs`."""
MAX_LOGIT_BIAS = 1_024
MAX_ALLOWED_TOKEN_IDS = 4_096
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 64
TOKEN_ID_BOUND = 2**31
