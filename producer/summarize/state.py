"""The work directory's sqlite database: documents, the requests of every round, and the
newest result of each request. I/O (stdlib sqlite3), idempotent.

Every write is an upsert or an insert inside the transaction that creates a round, so a
run killed anywhere leaves either the whole round or none of it; results keep the
highest attempt of a line, so a `qbatch bulk retry` result replaces the failed one.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from producer.summarize.plan import Task
from schemas import ResultEnvelope

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS docs(
  doc INTEGER PRIMARY KEY, custom_id TEXT, instructions TEXT, chunks INTEGER NOT NULL,
  error_code TEXT, error_message TEXT);
CREATE TABLE IF NOT EXISTS rounds(round INTEGER PRIMARY KEY, total INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tasks(
  round INTEGER NOT NULL, line INTEGER NOT NULL, doc INTEGER NOT NULL, level INTEGER NOT NULL,
  idx INTEGER NOT NULL, final INTEGER NOT NULL, prompt TEXT NOT NULL,
  PRIMARY KEY(round, line));
CREATE INDEX IF NOT EXISTS tasks_by_doc ON tasks(doc, level, idx);
CREATE TABLE IF NOT EXISTS results(
  round INTEGER NOT NULL, line INTEGER NOT NULL, attempt INTEGER NOT NULL, status TEXT NOT NULL,
  content TEXT, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
  error_code TEXT, error_message TEXT, request_id TEXT NOT NULL,
  PRIMARY KEY(round, line));
"""


@dataclass(frozen=True, slots=True)
class Outcome:
    """The newest result of one request."""

    round: int
    line: int
    attempt: int
    status: str
    content: str | None
    prompt_tokens: int
    completion_tokens: int
    error_code: str | None
    error_message: str | None
    request_id: str


@dataclass(frozen=True, slots=True)
class DocRow:
    doc: int
    custom_id: str | None
    instructions: str | None
    chunks: int
    error_code: str | None
    error_message: str | None


@dataclass(frozen=True, slots=True)
class TaskRow:
    round: int
    line: int
    level: int
    idx: int
    final: bool
    result: Outcome | None


class WorkDB:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------ meta

    def meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (key, value))

    # ------------------------------------------------------------ rounds

    def rounds(self) -> list[tuple[int, int]]:
        return [
            (int(r), int(t))
            for r, t in self.db.execute("SELECT round, total FROM rounds ORDER BY round")
        ]

    def begin(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self.db.execute("COMMIT")

    def rollback(self) -> None:
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")

    def add_doc(self, row: DocRow) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO docs VALUES(?, ?, ?, ?, ?, ?)",
            (
                row.doc,
                row.custom_id,
                row.instructions,
                row.chunks,
                row.error_code,
                row.error_message,
            ),
        )

    def add_tasks(self, round_no: int, first_line: int, doc: int, tasks: Iterable[Task]) -> int:
        """Insert `tasks` as lines first_line.. of round `round_no`; returns the next line."""
        line = first_line
        for task in tasks:
            self.db.execute(
                "INSERT INTO tasks VALUES(?, ?, ?, ?, ?, ?, ?)",
                (round_no, line, doc, task.level, task.index, int(task.final), task.prompt),
            )
            line += 1
        return line

    def add_round(self, round_no: int, total: int) -> None:
        self.db.execute("INSERT INTO rounds VALUES(?, ?)", (round_no, total))

    def round_tasks(self, round_no: int) -> Iterator[tuple[int, int, int, int, bool, str]]:
        """(line, doc, level, idx, final, prompt) of a round, in line order."""
        for line, doc, level, idx, final, prompt in self.db.execute(
            "SELECT line, doc, level, idx, final, prompt FROM tasks WHERE round=? ORDER BY line",
            (round_no,),
        ):
            yield int(line), int(doc), int(level), int(idx), bool(final), str(prompt)

    # ------------------------------------------------------------ results

    def attempts(self, round_no: int, lines: Iterable[int]) -> dict[int, int]:
        wanted = list(lines)
        found: dict[int, int] = {}
        for start in range(0, len(wanted), 500):
            part = wanted[start : start + 500]
            marks = ",".join("?" * len(part))
            for line, attempt in self.db.execute(
                f"SELECT line, attempt FROM results WHERE round=? AND line IN ({marks})",
                (round_no, *part),
            ):
                found[int(line)] = int(attempt)
        return found

    def put_results(self, outcomes: Iterable[Outcome]) -> None:
        """Upsert, keeping the highest attempt of each line."""
        self.db.executemany(
            "INSERT INTO results VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(round, line) DO UPDATE SET attempt=excluded.attempt, "
            "status=excluded.status, content=excluded.content, "
            "prompt_tokens=excluded.prompt_tokens, completion_tokens=excluded.completion_tokens, "
            "error_code=excluded.error_code, error_message=excluded.error_message, "
            "request_id=excluded.request_id WHERE excluded.attempt > results.attempt",
            [
                (
                    o.round,
                    o.line,
                    o.attempt,
                    o.status,
                    o.content,
                    o.prompt_tokens,
                    o.completion_tokens,
                    o.error_code,
                    o.error_message,
                    o.request_id,
                )
                for o in outcomes
            ],
        )

    def done_in_round(self, round_no: int) -> int:
        row = self.db.execute("SELECT count(*) FROM results WHERE round=?", (round_no,)).fetchone()
        return int(row[0])

    # ------------------------------------------------------------ documents

    def docs(self) -> Iterator[DocRow]:
        for row in self.db.execute("SELECT * FROM docs ORDER BY doc"):
            yield DocRow(int(row[0]), row[1], row[2], int(row[3]), row[4], row[5])

    def doc_tasks(self, doc: int, level: int | None = None) -> list[TaskRow]:
        """A document's requests (of one level, or all), in level and index order."""
        sql = (
            "SELECT t.round, t.line, t.level, t.idx, t.final, r.attempt, r.status, r.content, "
            "r.prompt_tokens, r.completion_tokens, r.error_code, r.error_message, r.request_id "
            "FROM tasks t LEFT JOIN results r ON r.round=t.round AND r.line=t.line "
            "WHERE t.doc=?"
            + (" AND t.level=?" if level is not None else "")
            + " ORDER BY t.level, t.idx"
        )
        args = (doc, level) if level is not None else (doc,)
        rows = []
        for rnd, line, lvl, idx, final, attempt, *rest in self.db.execute(sql, args):
            result = None if attempt is None else Outcome(int(rnd), int(line), int(attempt), *rest)
            rows.append(TaskRow(int(rnd), int(line), int(lvl), int(idx), bool(final), result))
        return rows

    def top_level(self, doc: int) -> int:
        row = self.db.execute("SELECT max(level) FROM tasks WHERE doc=?", (doc,)).fetchone()
        return int(row[0] or 0)


def outcome_of(round_no: int, line: int, attempt: int, rid: str, raw: bytes | None) -> Outcome:
    if raw is None:  # the result key expired before it was collected
        return Outcome(
            round_no,
            line,
            attempt,
            "failed",
            None,
            0,
            0,
            "result_missing",
            "the result expired from Redis before it was collected; bulk retry it",
            rid,
        )
    result = ResultEnvelope.model_validate_json(raw)
    usage = result.response.usage if result.response is not None else None
    content = None
    choices = getattr(result.response, "choices", None)  # an embeddings response has none
    if choices:
        choice = choices[0]
        content = getattr(getattr(choice, "message", None), "content", None)
        if content is None:
            content = getattr(choice, "text", None)
    err = result.error
    return Outcome(
        round_no,
        line,
        attempt,
        result.status.value,
        content,
        usage.prompt_tokens if usage else 0,
        usage.completion_tokens if usage else 0,
        err.code.value if err else None,
        err.message if err else None,
        rid,
    )


__all__ = ["DocRow", "Outcome", "TaskRow", "WorkDB", "outcome_of"]
