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


def _hog(client: redis.Redis, seconds: int) -> None:
    with contextlib.suppress(redis.ConnectionError):  # the node killed under the script
        client.eval(HOG, 0, seconds)


def busy(port: int, hold_s: float, threshold_ms: int = 100) -> Callable[[], None]:
    node = redis.Redis(port=port)
    before = node.config_get("busy-reply-threshold")["busy-reply-threshold"]
    node.config_set("busy-reply-threshold", threshold_ms)
    hog = redis.Redis(port=port, socket_timeout=hold_s + 30)
    # TIME has whole seconds: the script ends at the first second boundary past hold_s
    thread = threading.Thread(target=_hog, args=(hog, max(1, round(hold_s))), daemon=True)
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
        # a node killed meanwhile (the soak may kill the same master) restarts with its
        # config file's threshold: nothing left to undo
        with contextlib.suppress(redis.ConnectionError):
            node.config_set("busy-reply-threshold", before)
        node.close()
        hog.close()

    return undo


def _bgsave_children(pid: int) -> list[int]:
    """The BGSAVE child processes of redis-server `pid` (their title says so), never a
    replication child (`redis-rdb-to-slaves`): a replica's full sync must not be hit."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                title = fh.read(64)
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and title.startswith(b"redis-rdb-bgsave"):
            kids.append(int(entry))
    return kids


SAVE_STRETCH_US = 2_000_000


def _status(node: redis.Redis) -> str:
    return str(node.info("persistence")["rdb_last_bgsave_status"])


def misconf(port: int, timeout_s: float = 10) -> Callable[[], None]:
    """Needs a node holding a key: its save child (slowed by `rdb-key-save-delay`, set
    only while the fault is being made) must still run when it is found."""
    node = redis.Redis(port=port)
    save = node.config_get("save")["save"]
    node.config_set("save", "3600 1")  # MISCONF needs save points
    pid = int(node.info("server")["process_id"])
    deadline = time.monotonic() + timeout_s
    # each save lasts ~2 s whatever the node holds (at least 2 ms a key): long enough to be
    # found and killed, and a replica's full sync forked meanwhile is slowed as much only
    delay_us = max(2_000, SAVE_STRETCH_US // max(1, int(node.dbsize())))
    node.config_set("rdb-key-save-delay", delay_us)
    try:
        while _status(node) != "err":
            if time.monotonic() > deadline:
                node.config_set("save", save)
                raise RuntimeError(f"could not make the save on {port} fail")
            children = _bgsave_children(pid)
            for child in children:
                os.kill(child, signal.SIGKILL)
            if not children and not node.info("persistence")["rdb_bgsave_in_progress"]:
                with contextlib.suppress(redis.ResponseError):  # a replication child runs
                    node.bgsave()
            time.sleep(0.01)
    finally:
        node.config_set("rdb-key-save-delay", 0)

    def undo() -> None:
        try:
            end = time.monotonic() + timeout_s
            while _status(node) != "ok" and time.monotonic() < end:
                with contextlib.suppress(redis.ResponseError):  # one already running
                    node.bgsave()
                time.sleep(0.1)
            node.config_set("save", save)
        except redis.ConnectionError:  # killed meanwhile: it restarts from its config file
            pass
        finally:
            node.close()

    return undo


__all__ = ["busy", "misconf"]
