"""The bytes that the results of the requests in the engine can add up to.

A result's size is known before it runs (`schemas.result_size`): up to `max_result_bytes`
each, and a worker builds each one in memory (several times its JSON size in Python
objects) before writing it. Records in flight are bounded in count and in their own bytes;
this bounds what their answers can weigh. The dispatcher reserves each request's estimate
before submitting it and waits while the reservations would pass the limit (a request
whose estimate alone is over it still runs once nothing else is reserved); the writer
frees a reservation once the result is written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class ResultBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._cond = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    def reserve(self, amount: int, stopping: Callable[[], bool] = lambda: False) -> bool:
        """Wait until `amount` fits (or nothing is reserved), then take it. False when
        `stopping()` turned true while waiting (nothing taken)."""
        with self._cond:
            while self._used and self._used + amount > self.limit:
                if stopping():
                    return False
                self._cond.wait(0.1)
            self._used += amount
            return True

    def release(self, amount: int) -> None:
        if amount <= 0:
            return
        with self._cond:
            self._used = max(0, self._used - amount)
            self._cond.notify_all()


__all__ = ["ResultBudget"]
