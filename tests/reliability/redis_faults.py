"""Two ways a healthy Redis says "not now" to every write, made on demand (issue 39): for
the worker-core regression tests and the chaos soak's `redis_busy` / `redis_misconf`.

- `busy(port, hold_s)`: another client runs a script for `hold_s` with the server's
  busy-reply-threshold lowered to 100 ms: every other command is answered BUSY.
- `misconf(port)`: an RDB save is made to fail (its child killed), so a server with save
  points answers every write, and PING, MISCONF until a save succeeds; reads still work.

Each returns the function that undoes it. Both talk to one node directly (a cluster
master by its port), never through a cluster client.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

import redis

HOG = """
local stop = tonumber(redis.call('TIME')[1]) + tonumber(ARGV[1])
while tonumber(redis.call('TIME')[1]) < stop do end
return 1
"""


def busy(port: int, hold_s: float, threshold_ms: int = 100) -> Callable[[], None]:
    node = redis.Redis(port=port)
    before = node.config_get("busy-reply-threshold")["busy-reply-threshold"]
    node.config_set("busy-reply-threshold", threshold_ms)
    hog = redis.Redis(port=port, socket_timeout=hold_s + 30)
    # TIME has whole seconds: the script ends at the first second boundary past hold_s
    thread = threading.Thread(target=lambda: hog.eval(HOG, 0, max(1, round(hold_s))))
    thread.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # until the server answers BUSY
        try:
            node.ping()
        except redis.ResponseError as exc:
            if str(exc).startswith("BUSY"):
                break
        time.sleep(0.02)

    def undo() -> None:
        thread.join(hold_s + 30)
        node.config_set("busy-reply-threshold", before)
        node.close()
        hog.close()

    return undo


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return kids


def _status(node: redis.Redis) -> str:
    return str(node.info("persistence")["rdb_last_bgsave_status"])


def misconf(port: int, timeout_s: float = 10) -> Callable[[], None]:
    """Needs a node holding at least one key (its save child must still be running when
    it is killed: each key costs it a second here)."""
    node = redis.Redis(port=port)
    save = node.config_get("save")["save"]
    node.config_set("save", "3600 1")  # MISCONF needs save points
    node.config_set("rdb-key-save-delay", 1_000_000)
    node.bgsave()
    pid = int(node.info("server")["process_id"])
    deadline = time.monotonic() + timeout_s
    while _status(node) != "err":
        if time.monotonic() > deadline:
            node.config_set("rdb-key-save-delay", 0)
            node.config_set("save", save)
            raise RuntimeError(f"could not make the save on {port} fail")
        for child in _children(pid):
            os.kill(child, signal.SIGKILL)
        time.sleep(0.05)

    def undo() -> None:
        node.config_set("rdb-key-save-delay", 0)
        end = time.monotonic() + timeout_s
        while _status(node) != "ok" and time.monotonic() < end:
            with contextlib.suppress(redis.ResponseError):  # one already running
                node.bgsave()
            time.sleep(0.1)
        node.config_set("save", save)
        node.close()

    return undo


__all__ = ["busy", "misconf"]
