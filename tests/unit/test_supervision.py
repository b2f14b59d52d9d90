"""Thread faults stop the worker, and strikes keep a poison record from stopping it again."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from worker import failpoints
from worker.supervision import StrikeBook, StrikeStore, Supervisor, Verdict


def test_strike_book_verdicts() -> None:
    book = StrikeBook()
    assert book.verdict("t", 0, 5) is Verdict.run
    book.add([("t", 0, 5), ("t", 0, 6), ("t", 0, 5)])  # blamed twice in one fault: one strike
    assert book.verdict("t", 0, 5) is Verdict.isolate
    book.add([("t", 0, 5)])
    assert book.verdict("t", 0, 5) is Verdict.quarantine
    assert book.verdict("t", 0, 6) is Verdict.isolate
    assert book.verdict("t", 1, 5) is Verdict.run


@pytest.mark.parametrize("topic", ["plain", "with.dots-and_dashes", "a/b"])
def test_strike_field_names_round_trip(topic: str) -> None:
    suspect = (topic, 3, 1234)
    assert StrikeBook.parse(StrikeBook.field_of(suspect)) == suspect
    assert StrikeBook.parse("garbage") is None


class FakeHash:
    """A dict standing in for one Redis hash (unit test of the counting, not of Redis)."""

    def __init__(self) -> None:
        self.data: dict[str, int] = {}

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        return {k.encode(): str(v).encode() for k, v in self.data.items()}

    def pipeline(self, transaction: bool = False) -> FakeHash:
        return self

    def hincrby(self, key: str, field: str, n: int) -> None:
        self.data[field] = self.data.get(field, 0) + n

    def expire(self, key: str, ttl: int) -> None:
        return

    def execute(self) -> None:
        return


def test_supervisor_reports_the_first_fault_and_strikes_what_was_in_hand() -> None:
    faults: list[str] = []
    store = FakeHash()
    sup = Supervisor(faults.append, StrikeStore(store, "k"))

    def boom() -> None:
        raise RuntimeError("bad")

    sup.guard("writer", boom, lambda: [("t", 0, 1), ("t", 0, 2)])()
    sup.guard("dispatcher", boom, lambda: [("t", 0, 2)])()
    assert faults == ["writer: RuntimeError: bad"]
    assert store.data == {"t/0/1": 1, "t/0/2": 2}
    again = StrikeStore(store, "k").load()  # what the next worker starts with
    assert again.verdict("t", 0, 2) is Verdict.quarantine
    assert again.verdict("t", 0, 1) is Verdict.isolate


def test_failpoints_parse_and_fire(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failpoints, "_POINTS", failpoints._parse("write=r1,write=r2,accept"))
    failpoints.hit("write", ["r3"])
    failpoints.hit("dispatch", ["r1"])
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("write", ["r0", "r2"])
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("accept", [])


def test_backstop_ends_a_stuck_stop() -> None:
    """Whatever is stuck, the process ends once a stop overruns its limit."""
    code = textwrap.dedent(
        """
        import threading, time
        from worker import cli, logs
        logs.configure("error")
        cli._backstop(0.5)
        threading.Event().wait()  # stuck for good
        """
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], timeout=30, capture_output=True)
    assert proc.returncode == 3, proc.stderr
    assert time.monotonic() - started < 15
