"""Header names on dead-letter records (the value is the original bytes, unchanged)."""

from __future__ import annotations

ERROR_CODE = "qbatch.error.code"
ERROR_MESSAGE = "qbatch.error.message"
ERROR_PARAM = "qbatch.error.param"
SOURCE_TOPIC = "qbatch.source.topic"
SOURCE_PARTITION = "qbatch.source.partition"
SOURCE_OFFSET = "qbatch.source.offset"
REQUEST_ID = "qbatch.request_id"
