"""Thread faults stop the worker, and strikes keep a poison record from stopping it again."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest

from worker import failpoints
from worker.supervision import StrikeBook, StrikeStore, Supervisor, Verdict


@dataclass
class Rec:
    """A record as the strike rule sees it: its place and its content's checksum."""

    topic: str
    partition: int
    offset: int
    crc: int = 0xC0FFEE

    def checksum(self) -> int:
        return self.crc

    def suspect(self) -> tuple[str, int, int, int]:
        return (self.topic, self.partition, self.offset, self.crc)


def test_strike_book_verdicts() -> None:
    book = StrikeBook()
    five, six = Rec("t", 0, 5), Rec("t", 0, 6)
    assert book.verdict(five) is Verdict.run
    book.add([five.suspect(), six.suspect(), five.suspect()])  # blamed twice in one fault
    assert book.verdict(five) is Verdict.isolate
    book.add([five.suspect()])
    assert book.verdict(five) is Verdict.quarantine
    assert book.verdict(six) is Verdict.isolate
    assert book.verdict(Rec("t", 1, 5)) is Verdict.run


def test_a_recreated_topic_starts_clean() -> None:
    """Issue 39: strikes were keyed by topic/partition/offset, so after a topic was deleted
    and created again an ordinary request at a quarantined offset was failed unrun. The
    record's checksum is part of its name now."""
    book = StrikeBook()
    poison = Rec("t", 0, 5, crc=1)
    book.add([poison.suspect(), poison.suspect()])
    book.add([poison.suspect()])
    assert book.verdict(poison) is Verdict.quarantine
    assert book.verdict(Rec("t", 0, 5, crc=2)) is Verdict.run


def test_an_entry_of_the_release_before_matches_any_content() -> None:
    book = StrikeBook()
    parsed = StrikeBook.parse("t/0/5")
    assert parsed == ("t", 0, 5, None)
    book.counts[("t", 0, 5)] = {None: 2}
    assert book.verdict(Rec("t", 0, 5, crc=9)) is Verdict.quarantine


@pytest.mark.parametrize("topic", ["plain", "with.dots-and_dashes"])
def test_strike_field_names_round_trip(topic: str) -> None:
    suspect = (topic, 3, 1234, 0xDEADBEEF)
    assert StrikeBook.field_of(suspect) == f"{topic}/3/1234/deadbeef"
    assert StrikeBook.parse(StrikeBook.field_of(suspect)) == suspect
    assert StrikeBook.parse("garbage") is None
    assert StrikeBook.parse("t/x/1/ab") is None


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

    one, two = Rec("t", 0, 1, crc=1), Rec("t", 0, 2, crc=2)
    sup.guard("writer", boom, lambda: [one.suspect(), two.suspect()])()
    sup.guard("dispatcher", boom, lambda: [two.suspect()])()
    assert faults == ["writer: RuntimeError: bad"]
    assert store.data == {"t/0/1/00000001": 1, "t/0/2/00000002": 2}
    again = StrikeStore(store, "k").load()  # what the next worker starts with
    assert again.verdict(two) is Verdict.quarantine
    assert again.verdict(one) is Verdict.isolate


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
