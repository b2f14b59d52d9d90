"""A summarisation job as rounds of resumable bulk jobs. I/O.

Round n is bulk job `{job}.L{n}`. Level 1 (one map request per chunk) is published in
waves while it is planned: a wave closes at 32, 64, 128 ... 1,024 requests and becomes a
round of its own, so the engine works on the first chunks while later documents are still
being tokenized. After level 1, each round is the next pass of every document still in
progress (level 2 of every document, then 3 ...). A round's input, `L{n}.jsonl` in the
work directory, is generated once from the round's rows in `state.db` (temp file, fsync,
rename; a re-run reuses it), and submitted with `producer.jobs.submit_job`, which resumes
from the job's `submitted` counter. Results are read from the job stream into the
database. A re-run skips the documents already planned, re-submits (a no-op once
submitted) and re-collects every round, so a document whose failed request was re-run by
`qbatch bulk retry {job}.L{n}` continues in a new round; nothing is published twice. The
output (one line per document, input order) is written at the end, atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from producer.bulk import parse_request_id
from producer.client import QBatchClient
from producer.jobs import (
    DEFAULT_JOB_TTL_S,
    JobStore,
    Progress,
    file_sha256,
    submit_job,
)
from producer.line_sources import GeneratedLines
from producer.summarize.chunking import stream_chunks
from producer.summarize.config import Config, Report
from producer.summarize.documents import Document
from producer.summarize.plan import (
    PlanError,
    Summary,
    Task,
    check_budget,
    chunk_sizes,
    map_task,
    reduce_tasks,
    request_body,
)
from producer.summarize.state import DocRow, WorkDB, outcome_of
from producer.summarize.tokens import Tokenizer
from schemas import CHAT_ENDPOINT
from schemas.keys import StreamField

BarFactory = Callable[[str], AbstractContextManager[Progress]]

WAVE_FIRST = 32
"""Requests in the first wave of level 1: the engine has work after planning this much."""
WAVE_MAX = 1_024
PLANNED_META, WAVES_META = "planned", "waves"


def wave_size(round_no: int) -> int:
    """Requests that close wave `round_no` of level 1: 32, 64, 128 ... 1,024 (few rounds for
    a large job, an early start for every job)."""
    return min(WAVE_MAX, WAVE_FIRST << min(round_no - 1, 10))


class Driver:
    def __init__(
        self,
        client: QBatchClient,
        tokenizer: Tokenizer,
        config: Config,
        *,
        bar: BarFactory | None = None,
    ) -> None:
        self.client = client
        self.tok = tokenizer
        self.cfg = config
        self.store = JobStore.of(client, config.job_ttl_s or DEFAULT_JOB_TTL_S)  # unset or 0
        self.bar = bar
        self.db = WorkDB(config.work_dir / "state.db")
        self._submitted: set[int] = set()
        """Rounds this run has published (a wave, while planning): not hashed again."""

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------ planning

    def _open(self) -> None:
        check_budget(self.cfg.budget, self.tok, self.cfg.templates)
        have = self.db.meta("fingerprint")
        want = self.cfg.fingerprint()
        if have is not None and have != want:
            raise PlanError(
                f"{self.cfg.work_dir} holds a summarisation job with other settings or "
                "another --job; remove it or give another --work-dir"
            )
        self.db.set_meta("fingerprint", want)

    def _instructions(self, own: str | None) -> str:
        return own if own is not None else self.cfg.templates.instructions

    def _add_map_tasks(
        self, doc: Document, number: int, round_no: int, line: int
    ) -> tuple[int, int]:
        """Insert a document's level-1 requests as lines `line`.. of round `round_no`;
        returns (chunks, next line). Chunk texts are spooled to a temp file until the
        count is known (the prompt says "part i of n") and go to the database one at a
        time: a 1 GB document never sits in memory."""
        assert doc.blocks is not None
        instructions = self._instructions(doc.instructions)
        size, overlap = chunk_sizes(self.cfg.budget, self.tok, self.cfg.templates, instructions)
        spans: list[tuple[int, int]] = []
        with tempfile.TemporaryFile(dir=self.cfg.work_dir) as spool:
            for chunk in stream_chunks(doc.blocks(), self.tok, size, overlap):
                data = chunk.text.encode("utf-8")
                spans.append((spool.tell(), len(data)))
                spool.write(data)

            def tasks() -> Iterator[Task]:
                for index, (at, length) in enumerate(spans):
                    spool.seek(at)
                    text = spool.read(length).decode("utf-8")
                    yield map_task(self.cfg.templates, instructions, text, index, len(spans))

            return len(spans), self.db.add_tasks(round_no, line, number, tasks())

    def _plan_first(self, documents: Iterable[Document], report: Report) -> None:
        """Plan level 1 in waves and publish each wave as soon as it is planned, so the
        engine starts on the first chunks while the rest are still being cut (planning a
        nightly job is tokenizing every document). A wave is a round of its own (bulk job
        `{job}.L{n}`), committed with its documents; a re-run skips the documents already
        planned and goes on with the next wave."""
        self.db.set_meta(WAVES_META, "1")
        planned = sum(1 for _ in self.db.docs())
        rounds = self.db.rounds()
        round_no = rounds[-1][0] + 1 if rounds else 1
        line = 1
        self.db.begin()
        try:
            for number, doc in enumerate(documents):
                if number < planned:
                    continue
                chunks = 0
                if doc.error is None:
                    chunks, line = self._add_map_tasks(doc, number, round_no, line)
                err = doc.error
                self.db.add_doc(
                    DocRow(
                        number,
                        doc.custom_id,
                        doc.instructions,
                        chunks,
                        err.code if err else None,
                        err.message if err else None,
                    )
                )
                if line - 1 >= wave_size(round_no):
                    self.db.add_round(round_no, line - 1)
                    self.db.commit()
                    report.published += self._submit_round(round_no, line - 1)
                    round_no, line = round_no + 1, 1
                    self.db.begin()
            if line > 1 or not self.db.rounds():
                self.db.add_round(round_no, line - 1)
            self.db.set_meta(PLANNED_META, "1")
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise

    def _advance(self, round_no: int) -> bool:
        """Plan round `round_no` from every document ready for its next level."""
        self.db.begin()
        try:
            line = 1
            for doc in self.db.docs():
                state, rows = self._state(doc)
                if state != "ready":
                    continue
                level = rows[0].level + 1
                summaries = [row.result.content or "" for row in rows if row.result]
                tasks = reduce_tasks(
                    summaries,
                    level,
                    self.tok,
                    self.cfg.templates,
                    self._instructions(doc.instructions),
                    self.cfg.budget,
                )
                line = self.db.add_tasks(round_no, line, doc.doc, tasks)
            if line == 1:
                self.db.rollback()
                return False
            self.db.add_round(round_no, line - 1)
            self.db.commit()
            return True
        except BaseException:
            self.db.rollback()
            raise

    def _state(self, doc: DocRow) -> tuple[str, list[Any]]:
        """('bad'|'pending'|'failed'|'done'|'ready', the rows of its newest level)."""
        if doc.error_code is not None:
            return "bad", []
        rows = self.db.doc_tasks(doc.doc, self.db.top_level(doc.doc))
        if any(row.result is None for row in rows):
            return "pending", rows
        if any(row.result is not None and row.result.status != "succeeded" for row in rows):
            return "failed", rows
        return ("done" if rows[0].final else "ready"), rows

    # ------------------------------------------------------------ rounds

    def round_job(self, round_no: int) -> str:
        return f"{self.cfg.job}.L{round_no}"

    def _round_file(self, round_no: int) -> Path:
        """L{n}.jsonl, generated once from the database."""
        path = self.cfg.work_dir / f"L{round_no}.jsonl"
        if path.is_file():
            return path
        _write_atomically(
            path,
            (
                json.dumps(self._envelope(line, doc, level, idx, final, prompt))
                for line, doc, level, idx, final, prompt in self.db.round_tasks(round_no)
            ),
        )
        return path

    def _envelope(
        self, line: int, doc: int, level: int, idx: int, final: bool, prompt: str
    ) -> dict[str, Any]:
        options = dict(self.cfg.options)
        meta = dict(options.pop("metadata", None) or {})
        meta.update(doc=doc, level=level, index=idx, final=final)
        body = request_body(
            prompt,
            summary_tokens=self.cfg.budget.summary_tokens,
            model=self.cfg.model,
            thinking=self.cfg.thinking,
        )
        return {
            "endpoint": CHAT_ENDPOINT,
            "custom_id": f"d{doc}.l{level}.{idx}",
            "body": body,
            "metadata": meta,
            **{k: v.isoformat() if hasattr(v, "isoformat") else v for k, v in options.items()},
        }

    def _levels_of(self, round_no: int) -> str:
        levels = sorted({level for _l, _d, level, *_ in self.db.round_tasks(round_no)})
        return ",".join(map(str, levels))

    def _submit_round(self, round_no: int, total: int) -> int:
        """Publish a round's requests (resuming; a no-op once it is submitted); returns
        how many were published now."""
        if round_no in self._submitted:
            return 0
        path = self._round_file(round_no)
        job = self.round_job(round_no)
        with self._bar(f"submit {self._label(round_no)}") as on_progress:
            report = submit_job(
                self.client,
                self.store,
                job,
                GeneratedLines(path, job, total),
                input_path=str(path.resolve()),
                sha=file_sha256(path),
                on_progress=on_progress,
                lane=self.cfg.lane,
            )
        self._submitted.add(round_no)
        return report.published

    def _label(self, round_no: int) -> str:
        return f"{self.round_job(round_no)} (level {self._levels_of(round_no)})"

    def _run_round(self, round_no: int, total: int, deadline: float | None) -> tuple[bool, int]:
        """Submit (resuming) and collect one round; (complete, lines published now)."""
        published = self._submit_round(round_no, total)
        with self._bar(f"collect {self._label(round_no)}") as on_progress:
            complete = self._collect(round_no, total, deadline, on_progress)
        return complete, published

    def _bar(self, label: str) -> AbstractContextManager[Progress]:
        if self.bar is not None:
            return self.bar(label)
        from contextlib import nullcontext

        return nullcontext(lambda done, total: None)

    def _collect(
        self, round_no: int, total: int, deadline: float | None, on_progress: Progress
    ) -> bool:
        """Read the round job's stream from the start into the database until every line
        has a result (True) or the deadline passes (False)."""
        job = self.round_job(round_no)
        last = "-"
        while True:
            while entries := self.store.stream(job, last):
                last = entries[-1][0]
                self._take(round_no, job, entries)
            done = self.db.done_in_round(round_no)
            on_progress(done, total)
            if done >= total:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            wait_ms = 1_000 if left is None else max(1, min(1_000, int(left * 1000)))
            self.store.wait_stream(job, last, wait_ms)

    def _take(self, round_no: int, job: str, entries: list[tuple[str, dict[str, str]]]) -> None:
        newest: dict[int, tuple[int, str, str | None]] = {}
        for _eid, fields in entries:
            rid = fields.get(StreamField.request_id, "")
            parsed = parse_request_id(job, rid)
            if parsed is None:
                continue
            line, attempt = parsed
            if line not in newest or newest[line][0] < attempt:
                newest[line] = (attempt, rid, fields.get(StreamField.result))
        have = self.db.attempts(round_no, newest)
        todo = [(line, v) for line, v in sorted(newest.items()) if have.get(line, -1) < v[0]]
        raws = iter(self.store.results([rid for _l, (_a, rid, inline) in todo if not inline]))
        outcomes = []
        for line, (attempt, rid, inline) in todo:
            raw = inline.encode() if inline else next(raws)
            outcomes.append(outcome_of(round_no, line, attempt, rid, raw))
        self.db.put_results(outcomes)

    # ------------------------------------------------------------ run

    def run(self, documents: Iterable[Document]) -> Report:
        """Plan (once), run every round, write the output; resumable at any point."""
        self._open()
        deadline = None if self.cfg.timeout is None else time.monotonic() + self.cfg.timeout
        report = Report(out=str(self.cfg.out))
        if self.db.meta(PLANNED_META) is None and (
            not self.db.rounds() or self.db.meta(WAVES_META) is not None
        ):
            self._plan_first(documents, report)
        done_rounds: set[int] = set()
        while True:
            for round_no, total in self.db.rounds():
                if round_no in done_rounds or total == 0:
                    continue
                complete, published = self._run_round(round_no, total, deadline)
                report.published += published
                if not complete:
                    report.rounds = len(self.db.rounds())
                    return report
                done_rounds.add(round_no)
            rounds = self.db.rounds()
            if not self._advance(rounds[-1][0] + 1):
                break
        report.rounds = len(self.db.rounds())
        report.complete = True
        self._write_output(report)
        return report

    def summaries(self) -> Iterator[Summary]:
        for doc in self.db.docs():
            yield self._summary(doc)

    def _summary(self, doc: DocRow) -> Summary:
        out = Summary(custom_id=doc.custom_id, chunks=doc.chunks)
        if doc.error_code is not None:
            out.status = "failed"
            out.error = {
                "code": doc.error_code,
                "message": doc.error_message,
                "level": None,
                "chunk": None,
                "request_id": None,
            }
            return out
        rows = self.db.doc_tasks(doc.doc)
        for row in rows:
            if row.result is not None:
                out.add_usage(row.result.prompt_tokens, row.result.completion_tokens)
        state, top = self._state(doc)
        out.levels = top[0].level if top else 0
        if state == "done":
            out.summary = top[0].result.content if top[0].result else None
            return out
        out.status = "failed"
        bad = next(
            (r for r in top if r.result is not None and r.result.status != "succeeded"), None
        )
        result = bad.result if bad is not None else None
        out.error = {
            "code": result.error_code if result else "incomplete",
            "message": result.error_message if result else "no result yet",
            "level": bad.level if bad else out.levels,
            "chunk": bad.idx if bad else None,
            "request_id": result.request_id if result else None,
        }
        return out

    def _write_output(self, report: Report) -> None:
        def lines() -> Iterator[str]:
            for summary in self.summaries():
                report.documents += 1
                report.succeeded += summary.ok
                report.failed += not summary.ok
                yield json.dumps(summary.as_dict(), ensure_ascii=False)

        self.cfg.out.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(self.cfg.out, lines())


def _write_atomically(path: Path, lines: Iterable[str]) -> None:
    """Write `lines` to a temp file beside `path`, fsync, rename over it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for line in lines:
                fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


__all__ = ["BarFactory", "Config", "Driver", "Report"]
