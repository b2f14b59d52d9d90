"""Summarisation jobs end to end: real Kafka + Redis, an echo worker (its answer is the
first max_tokens words of the last user message, so every map output, reduce input, level
and chunk count is computable), the real `qbatch` CLI as a subprocess, and the real Qwen3
tokenizer. Plus one run on the CPU transformers engine with the tiny random Qwen3."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.summarize.chunking import chunk_text
from producer.summarize.plan import Budget, reduce_tasks
from producer.summarize.templates import Templates
from producer.summarize.tokens import FileTokenizer, load_tokenizer
from tests.summarize_fixtures import qwen3_tokenizer_json

try:  # tests/integration is a rootdir-relative folder, or a package once it has __init__.py
    from tests.integration.test_producer_flows import job_hash, read_jsonl, topic_records
    from tests.integration.workers import Lane, echo_worker, qbatch, qbatch_popen
except ModuleNotFoundError:
    from test_producer_flows import job_hash, read_jsonl, topic_records  # type: ignore[no-redef]
    from workers import Lane, echo_worker, qbatch, qbatch_popen  # type: ignore[no-redef]

pytestmark = pytest.mark.integration

CONTEXT, SUMMARY, CHUNK, OVERLAP = 150, 8, 60, 6
PLAIN = Templates(map="{text}", reduce="{text}", single="{text}")
SIZES = [
    "--context-tokens",
    str(CONTEXT),
    "--summary-tokens",
    str(SUMMARY),
    "--chunk-tokens",
    str(CHUNK),
    "--overlap-tokens",
    str(OVERLAP),
]


@pytest.fixture
def lane() -> Iterator[Lane]:
    lane = Lane.new("qbs")
    lane.create_topics()
    yield lane
    lane.delete_topics()
    lane.clean_redis()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-tok")
    qwen3_tokenizer_json(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> FileTokenizer:
    return load_tokenizer(tok_dir)


@pytest.fixture
def templates(tmp_path: Path) -> list[str]:
    (tmp_path / "plain.txt").write_text("{text}", encoding="utf-8")
    return [
        "--map-template",
        str(tmp_path / "plain.txt"),
        "--reduce-template",
        str(tmp_path / "plain.txt"),
    ]


def prose(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}, the {tag} sentence number {i} says hello." for i in range(n))


def echo(prompt: str) -> tuple[str, int, int]:
    """The echo engine: (answer, prompt tokens, completion tokens)."""
    words = prompt.split()
    if len(words) > SUMMARY:
        return " ".join(words[:SUMMARY]), len(words), SUMMARY
    return prompt, len(words), len(words)


def expected(text: str, tok: FileTokenizer, custom_id: str) -> dict[str, Any]:
    """The output line the planner and the echo engine must produce, computed here."""
    budget = Budget(CONTEXT, SUMMARY)
    chunks = chunk_text(text, tok, CHUNK, OVERLAP)
    prompt_tokens = completion = 0
    outputs = []
    for c in chunks:
        out, p, q = echo(c.text)
        outputs.append(out)
        prompt_tokens, completion = prompt_tokens + p, completion + q
    levels, final = 1, len(chunks) == 1
    while not final:
        levels += 1
        tasks = reduce_tasks(outputs, levels, tok, PLAIN, PLAIN.instructions, budget)
        assert all(t.prompt == "\n\n".join(outputs[t.covers[0] : t.covers[1]]) for t in tasks)
        outputs = []
        for t in tasks:
            out, p, q = echo(t.prompt)
            outputs.append(out)
            prompt_tokens, completion = prompt_tokens + p, completion + q
        final = tasks[0].final
    return {
        "custom_id": custom_id,
        "status": "succeeded",
        "summary": outputs[0],
        "chunks": len(chunks),
        "levels": levels,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        },
        "error": None,
    }


def round_counters(lane: Lane, job: str, rounds: int) -> list[tuple[int, int, int]]:
    """(total, succeeded, failed) of each round job."""
    out = []
    for n in range(1, rounds + 1):
        h = job_hash(lane, f"{job}.L{n}")
        out.append((int(h["total"]), int(h.get("succeeded", 0)), int(h.get("failed", 0))))
    return out


def test_bulk_summarize_structure_bad_documents_and_rerun(
    lane: Lane, tmp_path: Path, tok_dir: Path, tok: FileTokenizer, templates: list[str]
) -> None:
    long, short = prose(40, "alpha"), "A short note that fits one pass."
    docs = tmp_path / "docs.jsonl"
    docs.write_bytes(
        b"\n".join(
            [
                json.dumps({"custom_id": "long", "text": long}).encode(),
                json.dumps({"custom_id": "empty", "text": " "}).encode(),
                json.dumps({"custom_id": "short", "text": short}).encode(),
                b'{"custom_id": "latin1", "text": "caf\xe9"}',
            ]
        )
        + b"\n"
    )
    out = tmp_path / "out.jsonl"
    args = [
        "bulk",
        "summarize",
        str(docs),
        "--out",
        str(out),
        "--job",
        "sj",
        "--tokenizer",
        str(tok_dir),
        *SIZES,
        *templates,
        "--timeout",
        "120",
    ]
    with echo_worker(lane, log=tmp_path / "worker.log"):
        done = qbatch(lane, *args)
        assert done.returncode == 1, done.stderr
        lines = read_jsonl(out)
        want_long = expected(long, tok, "long")
        assert want_long["levels"] == 3 and want_long["chunks"] > 8  # a real hierarchy
        assert lines[0] == want_long
        assert lines[2] == expected(short, tok, "short") and lines[2]["levels"] == 1
        assert lines[1]["status"] == "failed" and lines[1]["error"]["code"] == "empty_document"
        assert lines[3]["custom_id"] is None and lines[3]["error"]["code"] == "not_utf8"
        assert "line 4: not UTF-8 at byte" in lines[3]["error"]["message"]
        rounds = want_long["levels"]
        counters = round_counters(lane, "sj", rounds)
        assert counters[0] == (want_long["chunks"] + 1, want_long["chunks"] + 1, 0)
        assert all(total == ok and failed == 0 for total, ok, failed in counters)
        work = Path(str(out) + ".work")
        l1 = read_jsonl(work / "L1.jsonl")
        assert [line["metadata"] for line in l1[:2]] == [
            {"doc": 0, "level": 1, "index": 0, "final": False},
            {"doc": 0, "level": 1, "index": 1, "final": False},
        ]
        assert l1[-1]["metadata"] == {"doc": 2, "level": 1, "index": 0, "final": True}
        assert l1[0]["body"]["chat_template_kwargs"] == {"enable_thinking": False}
        # a re-run after completion publishes nothing and writes the same output
        records = topic_records(lane)
        again = qbatch(lane, *args)
        assert again.returncode == 1, again.stderr
        assert read_jsonl(out) == lines
        assert topic_records(lane) == records
        assert round_counters(lane, "sj", rounds) == counters


def test_level_one_is_published_in_waves_while_planning(
    lane: Lane, tmp_path: Path, tok_dir: Path, tok: FileTokenizer, templates: list[str]
) -> None:
    """20 documents of 3 chunks: wave 1 closes at >= 32 map requests (11 documents), wave 2
    holds the rest, the reduce level is the next round; every output as computed here."""
    texts = [prose(8, f"w{n}x") for n in range(20)]
    wants = [expected(text, tok, f"d{n}") for n, text in enumerate(texts)]
    assert {w["chunks"] for w in wants} == {3} and {w["levels"] for w in wants} == {2}
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(json.dumps({"custom_id": f"d{n}", "text": t}) + "\n" for n, t in enumerate(texts))
    )
    out = tmp_path / "out.jsonl"
    args = ["bulk", "summarize", str(docs), "--out", str(out), "--job", "wj",
            "--tokenizer", str(tok_dir), *SIZES, *templates, "--timeout", "120"]  # fmt: skip
    with echo_worker(lane, log=tmp_path / "worker.log"):
        done = qbatch(lane, *args)
        assert done.returncode == 0, done.stderr
        assert read_jsonl(out) == wants
        assert round_counters(lane, "wj", 3) == [(33, 33, 0), (27, 27, 0), (20, 20, 0)]
        work = Path(str(out) + ".work")
        assert {line["metadata"]["doc"] for line in read_jsonl(work / "L1.jsonl")} == set(range(11))
        assert {line["metadata"]["level"] for line in read_jsonl(work / "L2.jsonl")} == {1}
        assert not (work / "L4.jsonl").exists()


def test_a_crash_between_waves_resumes_with_the_unplanned_documents(
    lane: Lane, tmp_path: Path, tok: FileTokenizer
) -> None:
    """The planner dies after wave 1 was committed and published (the input iterator
    raises at document 15); the re-run plans documents 15.. only, publishes nothing twice,
    and the output is what one clean run gives."""
    from producer.summarize.config import Config
    from producer.summarize.documents import read_docs_jsonl
    from producer.summarize.driver import Driver

    texts = [prose(8, f"c{n}x") for n in range(20)]
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(json.dumps({"custom_id": f"d{n}", "text": t}) + "\n" for n, t in enumerate(texts))
    )
    out = tmp_path / "out.jsonl"
    config = Config(
        job="cw",
        work_dir=tmp_path / "work",
        out=out,
        budget=Budget(CONTEXT, SUMMARY, chunk_tokens=CHUNK, overlap_tokens=OVERLAP),
        templates=PLAIN,
        timeout=120,
    )

    def dying(after: int) -> Iterator[Any]:
        for n, doc in enumerate(read_docs_jsonl(docs)):
            if n == after:
                raise RuntimeError("planner killed")
            yield doc

    with echo_worker(lane, log=tmp_path / "worker.log"), lane.client() as client:
        driver = Driver(client, tok, config)
        with pytest.raises(RuntimeError, match="planner killed"):
            driver.run(dying(15))
        driver.close()
        assert job_hash(lane, "cw.L1")["total"] == "33"  # wave 1 (11 documents) went out
        assert not job_hash(lane, "cw.L2")  # wave 2 was rolled back with its documents
        driver = Driver(client, tok, config)
        report = driver.run(read_docs_jsonl(docs))
        driver.close()
    assert report.complete
    assert read_jsonl(out) == [expected(t, tok, f"d{n}") for n, t in enumerate(texts)]
    assert round_counters(lane, "cw", 3) == [(33, 33, 0), (27, 27, 0), (20, 20, 0)]
    assert topic_records(lane) == 33 + 27 + 20


def test_kill_minus_9_mid_level_then_resume(
    lane: Lane, tmp_path: Path, tok_dir: Path, tok: FileTokenizer, templates: list[str]
) -> None:
    text = prose(80, "beta")
    doc = tmp_path / "doc.txt"
    doc.write_text(text, encoding="utf-8")
    out = tmp_path / "out.jsonl"
    args = [
        "summarize",
        str(doc),
        "--out",
        str(out),
        "--job",
        "kj",
        "--tokenizer",
        str(tok_dir),
        *SIZES,
        *templates,
        "--timeout",
        "300",
    ]
    want = expected(text, tok, str(doc))
    with echo_worker(
        lane, "--echo-delay-ms", "150", "--echo-concurrency", "1", log=tmp_path / "worker.log"
    ):
        proc = qbatch_popen(lane, *args)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            h = job_hash(lane, "kj.L1")
            if int(h.get("succeeded", 0)) >= 3:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert int(job_hash(lane, "kj.L1")["succeeded"]) < want["chunks"]  # mid-level
        assert not out.exists()
        done = qbatch(lane, *args)
        assert done.returncode == 0, done.stderr
    assert read_jsonl(out) == [want]
    counters = round_counters(lane, "kj", want["levels"])
    assert counters[0][0] == want["chunks"]
    assert all(total == ok and failed == 0 for total, ok, failed in counters)


def test_bulk_retry_of_a_failed_chunk_then_rerun(
    lane: Lane, tmp_path: Path, tok_dir: Path, tok: FileTokenizer, templates: list[str]
) -> None:
    """A worker with a 30-token context refuses every map prompt of the long document
    (its ~40 words + 8 output tokens do not fit: context_length_exceeded), deterministically,
    and answers the short one; after `bulk retry` on a worker with room, a re-run finishes."""
    long, short = prose(12, "gamma"), "Short enough to pass."
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        json.dumps({"custom_id": "long", "text": long})
        + "\n"
        + json.dumps({"custom_id": "short", "text": short})
        + "\n",
        encoding="utf-8",
    )
    out = tmp_path / "out.jsonl"
    args = [
        "bulk",
        "summarize",
        str(docs),
        "--out",
        str(out),
        "--job",
        "rj",
        "--tokenizer",
        str(tok_dir),
        *SIZES,
        *templates,
        "--timeout",
        "120",
    ]
    with echo_worker(lane, "--max-model-len", "30", log=tmp_path / "w1.log"):
        first = qbatch(lane, *args)
    assert first.returncode == 1, first.stderr
    failed, ok = read_jsonl(out)
    assert ok == expected(short, tok, "short")
    assert failed["status"] == "failed" and failed["summary"] is None and failed["levels"] == 1
    error = failed["error"]
    assert error["code"] == "context_length_exceeded" and error["level"] == 1
    assert error["chunk"] == 0 and error["request_id"] == "rj.L1.1"
    with echo_worker(lane, log=tmp_path / "w2.log"):
        retried = qbatch(lane, "bulk", "retry", "rj.L1", "--failed")
        assert retried.returncode == 0, retried.stderr
        done = qbatch(lane, *args)
        assert done.returncode == 0, done.stderr
    assert read_jsonl(out) == [expected(long, tok, "long"), ok]
    total = len(chunk_text(long, tok, CHUNK, OVERLAP)) + 1
    # the retry took the failed lines' counts back: every line counted once, succeeded
    assert round_counters(lane, "rj", 1) == [(total, total, 0)]


def test_client_summarize_matches_the_cli_plan(
    lane: Lane, tmp_path: Path, tok_dir: Path, tok: FileTokenizer
) -> None:
    text = prose(40, "alpha")
    budget = Budget(CONTEXT, SUMMARY, chunk_tokens=CHUNK, overlap_tokens=OVERLAP)
    with echo_worker(lane, log=tmp_path / "worker.log"), lane.client() as qb:
        summary = qb.summarize(text, tokenizer=tok_dir, budget=budget, templates=PLAIN, timeout=60)
        empty = qb.summarize("  ", tokenizer=tok, budget=budget, templates=PLAIN)
    assert {**summary.as_dict(), "custom_id": "x"} == expected(text, tok, "x")
    assert empty.status == "failed" and empty.error is not None
    assert empty.error["code"] == "empty_document"


@pytest.mark.cpu_model
def test_transformers_engine_tiny_qwen3(
    lane: Lane, tmp_path: Path, tok_dir: Path, tok: FileTokenizer
) -> None:
    torch = pytest.importorskip("torch")
    del torch
    from tests.tiny_model import build_tiny_qwen3

    model = build_tiny_qwen3(tmp_path / "tiny")
    text = prose(10, "delta")
    doc = tmp_path / "doc.md"
    doc.write_text(text, encoding="utf-8")
    out = tmp_path / "out.jsonl"
    n_chunks = len(chunk_text(text, tok, 100, 10))
    assert n_chunks >= 2
    with echo_worker(
        lane, "--engine", "transformers", "--model", str(model), log=tmp_path / "worker.log"
    ):
        done = qbatch(
            lane,
            "summarize",
            str(doc),
            "--out",
            str(out),
            "--tokenizer",
            str(tok_dir),
            "--context-tokens",
            "2048",
            "--summary-tokens",
            "16",
            "--chunk-tokens",
            "100",
            "--overlap-tokens",
            "10",
            "--timeout",
            "240",
        )
    assert done.returncode == 0, done.stderr
    (line,) = read_jsonl(out)
    assert line["status"] == "succeeded" and line["error"] is None
    assert line["chunks"] == n_chunks and line["levels"] == 2  # the summaries fit one reduce
    assert isinstance(line["summary"], str)
    assert line["usage"]["completion_tokens"] <= 16 * (n_chunks + 1)
    assert line["usage"]["prompt_tokens"] > sum(c.tokens for c in chunk_text(text, tok, 100, 10))
