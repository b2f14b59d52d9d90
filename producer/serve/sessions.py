"""Sign-in sessions of `qbatch serve`'s progress page: a random token in the browser's
cookie, its tenant in Redis under the token's SHA-256, for `SESSION_S`.

The cookie once held the API key itself: anything that could read the cookie (a proxy's
log, a shared machine's profile) held a key to the whole API. A token only shows its
tenant's page, expires on its own, and `POST /logout` ends it at once.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from schemas.keys import RedisKeys
from schemas.redis_conn import reply_text

SESSION_S = 12 * 3600


class Sessions:
    def __init__(self, redis_client: Any, keys: RedisKeys) -> None:
        self.redis = redis_client
        self.keys = keys

    def _key(self, token: str) -> str:
        return self.keys.serve_session(hashlib.sha256(token.encode()).hexdigest())

    def open(self, tenant: str) -> str:
        """A new session for `tenant`: its token (for the cookie)."""
        token = secrets.token_urlsafe(32)
        self.redis.set(self._key(token), tenant, ex=SESSION_S)
        return token

    def tenant(self, token: str) -> str | None:
        if not token or len(token) > 256:
            return None
        found = self.redis.get(self._key(token))
        return reply_text(found) if found is not None else None

    def close(self, token: str) -> None:
        if token and len(token) <= 256:
            self.redis.delete(self._key(token))


__all__ = ["SESSION_S", "Sessions"]
