"""The context policy end to end: real Kafka + Redis + an echo worker (context 200 words).

The echo engine counts whitespace words as tokens and answers with the last user message,
so what the policy kept and cut is checkable from the result alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas import Status
from schemas.context import TRUNCATION_MARKER
from schemas.errors import ErrorCode

try:
    from tests.integration.workers import Lane, echo_worker, qbatch
except ModuleNotFoundError:
    from workers import Lane, echo_worker, qbatch  # type: ignore[no-redef]

pytestmark = pytest.mark.integration

CONTEXT = 200


@pytest.fixture
def lane(stack: object) -> Iterator[Lane]:
    with Lane.private("qbctx", partitions=2) as lane:
        yield lane


def conversation(turns: int) -> list[dict[str, object]]:
    items: list[dict[str, object]] = [{"role": "system", "content": "terse " * 5}]
    for n in range(turns):
        items.append({"role": "user", "content": f"q{n} " * 10})
        items.append({"role": "assistant", "content": f"a{n} " * 10})
    items.append({"role": "user", "content": "latest question"})
    return items


def test_policies_through_the_worker(lane: Lane, tmp_path: Path) -> None:
    long_doc = " ".join(f"w{i}" for i in range(400))
    with (
        echo_worker(lane, "--max-model-len", str(CONTEXT), log=tmp_path / "w.log"),
        lane.client() as qb,
    ):
        slide = qb.submit(
            {"messages": conversation(20), "max_tokens": 20},
            context={"strategy": "sliding_window", "max_prompt_tokens": 100},
        )
        cut = qb.submit(
            {"messages": [{"role": "user", "content": long_doc}], "max_tokens": 50},
            context={"strategy": "truncate_middle"},
        )
        head = qb.submit(
            {"prompt": long_doc, "max_tokens": 50}, context={"strategy": "truncate_head"}
        )
        # no policy: today's rule (the echo counts its prompt: the last user message)
        refused = qb.submit({"messages": [{"role": "user", "content": long_doc}]})
        capped = qb.submit(
            {"messages": conversation(3), "max_tokens": 20},
            context={"strategy": "error", "max_prompt_tokens": 30},
        )
        found = qb.wait_many([slide, cut, head, refused, capped], timeout=60)

    r = found[slide]
    assert r is not None and r.status is Status.succeeded and r.context is not None
    # 5 system words + 2 latest + 20 turns of 20 words: keep the newest 4 turns (87 <= 100)
    assert r.context.window == 100
    assert (r.context.prompt_tokens_before, r.context.prompt_tokens_after) == (407, 87)
    assert r.context.messages_dropped == 32 and r.context.dropped == list(range(1, 33))
    assert r.response.choices[0].message.content == "latest question"  # type: ignore[union-attr]

    r = found[cut]
    assert r is not None and r.status is Status.succeeded and r.context is not None
    [t] = r.context.truncated
    assert t.message == 0 and r.context.window == CONTEXT - 50
    assert r.context.prompt_tokens_after <= 150
    text = r.response.choices[0].message.content  # type: ignore[union-attr]
    # the echo answers the first max_tokens words of what it was sent: the cut's head
    assert text.split()[0] == "w0" and len(text.split()) == 50

    r = found[head]
    assert r is not None and r.status is Status.succeeded and r.context is not None
    assert r.context.truncated[0].message is None
    removed = r.context.truncated[0].tokens_removed
    marker_words = TRUNCATION_MARKER.format(tokens=removed).split()
    text = r.response.choices[0].text  # type: ignore[union-attr]
    assert text.split()[: len(marker_words)] == marker_words
    assert text.split()[len(marker_words)] == f"w{removed}"

    r = found[refused]
    assert r is not None and r.status is Status.failed and r.context is None
    assert r.error is not None and r.error.code is ErrorCode.context_length_exceeded
    r = found[capped]
    assert r is not None and r.status is Status.failed
    assert r.error is not None and r.error.code is ErrorCode.context_length_exceeded
    assert "max_prompt_tokens" in r.error.message


def test_a_bulk_default_policy_and_the_cli_flags(lane: Lane, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    with src.open("w") as fh:
        for i in range(3):
            line = {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": conversation(20), "max_tokens": 20},
            }
            fh.write(json.dumps(line) + "\n")
    out = tmp_path / "out.jsonl"
    with echo_worker(lane, "--max-model-len", str(CONTEXT), log=tmp_path / "w.log"):
        done = qbatch(
            lane,
            "bulk",
            "run",
            str(src),
            "--out",
            str(out),
            "--context-strategy",
            "sliding_window",
            "--max-prompt-tokens",
            "100",
            "--timeout",
            "60",
        )
        assert done.returncode == 0, done.stderr
        one = qbatch(
            lane,
            "submit",
            "--body",
            json.dumps({"messages": conversation(20), "max_tokens": 20}),
            "--context-strategy",
            "sliding_window",
            "--wait",
        )
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 3 and all(x["response"]["status_code"] == 200 for x in lines)
    assert all(x["context"]["window"] == 100 for x in lines)
    assert all(x["context"]["prompt_tokens_after"] == 87 for x in lines)
    assert one.returncode == 0, one.stderr
    result = json.loads(one.stdout)
    assert result["context"]["strategy"] == "sliding_window"
    assert result["context"]["window"] == CONTEXT - 20
    assert result["context"]["messages_dropped"] > 0
