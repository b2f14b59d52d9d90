"""Continuations are the executors' to make: a `loop` is signed, and checked before it runs.

A tool loop's next turn is an envelope with `loop` set (the turn number, the transcript,
the lane, an abort): state only a tool executor should write, yet any producer could set
it and publish, to forge a transcript, buy a continuation's engine priority, or reach
code paths no caller should (a forged 16-turn transcript stopped every executor; one of
2**40-token turns stopped two workers). So the executor signs each continuation's `loop`
(HMAC-SHA256 over the request id and the loop without its signature, `LoopState.sig`)
and the worker answers any envelope whose `loop` is unsigned or signed with another key
`failed`, naming `loop`, without running it.

The key is `QBATCH_LOOP_KEY` when set (the same on executors and workers); otherwise one
random key kept in Redis (`RedisKeys.loop_key`), made by whichever component needs it
first: then anyone who can read the prefix could sign, so a deployment whose producers
read Redis with the same rights should set the key. The body a continuation carries is
not covered: a signed loop names its request, so it cannot be moved to another one.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from schemas.request import RequestEnvelope
from schemas.tool_loop import LoopState


class LoopSigner:
    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a loop key needs at least 16 bytes")
        self._key = key

    def _mac(self, request_id: str, loop: LoopState) -> str:
        text = request_id + "\n" + loop.model_dump_json(exclude={"sig"})
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def sign(self, envelope: RequestEnvelope) -> RequestEnvelope:
        """`envelope` with its loop signed (unchanged without a loop)."""
        loop = envelope.loop
        if loop is None:
            return envelope
        signed = loop.model_copy(update={"sig": self._mac(envelope.request_id, loop)})
        return envelope.model_copy(update={"loop": signed})

    def valid(self, envelope: RequestEnvelope) -> bool:
        """Whether its loop (if any) was signed with this key for this request."""
        loop = envelope.loop
        if loop is None:
            return True
        if loop.sig is None:
            return False
        return hmac.compare_digest(loop.sig, self._mac(envelope.request_id, loop))


def load_signer(setting: Any, redis_client: Any, key_name: str) -> LoopSigner:
    """The deployment's signer: `setting` (a SecretStr, QBATCH_LOOP_KEY) when given, else
    the key in Redis at `key_name` (made now, SET NX, when nobody made it yet)."""
    if setting is not None:
        return LoopSigner(setting.get_secret_value().encode())
    redis_client.set(key_name, secrets.token_hex(32), nx=True)
    stored = redis_client.get(key_name)
    return LoopSigner(stored.encode() if isinstance(stored, str) else bytes(stored))


__all__ = ["LoopSigner", "load_signer"]
