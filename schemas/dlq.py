"""Header names on dead-letter records (the value is the original bytes, unchanged, or
their first bytes when the record would not fit the DLQ: see `TRUNCATED`)."""

from __future__ import annotations

ERROR_CODE = "qbatch.error.code"
ERROR_MESSAGE = "qbatch.error.message"
ERROR_PARAM = "qbatch.error.param"
SOURCE_TOPIC = "qbatch.source.topic"
SOURCE_PARTITION = "qbatch.source.partition"
SOURCE_OFFSET = "qbatch.source.offset"
REQUEST_ID = "qbatch.request_id"
TRUNCATED = "qbatch.value.truncated"
"""`1` when the letter's value is only the first bytes of the record's (it did not fit)."""
VALUE_BYTES = "qbatch.value.bytes"
"""The record value's size as received, on a truncated letter."""
