"""The context policy: pure window rules (word tokens) and the renderer applying them with
the real Qwen3 tokenizer and chat template."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from schemas.context import TRUNCATION_MARKER, ContextStrategy
from schemas.decode import validate_envelope
from schemas.errors import ContractError, ErrorCode
from schemas.request import AssistantMessage, Message, RequestEnvelope, ToolMessage, UserMessage
from worker import context_window as cw
from worker.rendering import DEFAULT_OUTPUT_RESERVE, PromptRenderer

MESSAGES = TypeAdapter(list[Message])


def msgs(*items: dict[str, Any]) -> list[Any]:
    return MESSAGES.validate_python(list(items))


def words(messages: Any) -> int:
    return sum(
        len((m.content or "").split()) if isinstance(m.content, str | None) else 0 for m in messages
    )


def call(cid: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


def tool(cid: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": cid, "content": text}


CONVERSATION = msgs(
    {"role": "system", "content": "sys " * 5},  # 0 pinned
    {"role": "user", "content": "u1 " * 10},  # 1 turn A
    {"role": "assistant", "content": "a1 " * 10},  # 2 turn A
    {"role": "user", "content": "u2 " * 10},  # 3 turn B
    call("c1"),  # 4 turn B
    tool("c1", "t1 " * 10),  # 5 turn B
    {"role": "assistant", "content": "a2 " * 10},  # 6 turn B
    {"role": "user", "content": "u3 " * 10},  # 7 turn C
    {"role": "assistant", "content": "a3 " * 10},  # 8 turn C
    {"role": "user", "content": "latest " * 10},  # 9 pinned (the latest user message)
    call("c2"),  # 10 pinned (after it)
    tool("c2", "t2 " * 10),  # 11 pinned
)


def test_turns_start_at_user_messages_and_pin_system_and_the_current_turn() -> None:
    pinned, groups = cw.turn_groups(CONVERSATION)
    assert pinned == [0, 9, 10, 11]
    assert groups == [[1, 2], [3, 4, 5, 6], [7, 8]]


@pytest.mark.parametrize(
    ("window", "dropped"),
    [
        (90, [1, 2]),
        (75, [1, 2]),
        (74, [1, 2, 3, 4, 5, 6]),
        (45, [1, 2, 3, 4, 5, 6]),
        (44, [1, 2, 3, 4, 5, 6, 7, 8]),
        (25, [1, 2, 3, 4, 5, 6, 7, 8]),
    ],
)
def test_sliding_window_drops_the_fewest_oldest_turns(window: int, dropped: list[int]) -> None:
    assert words(CONVERSATION) == 95  # pinned 25, turns A 20, B 30, C 20
    fitted = cw.fit_messages(
        ContextStrategy.sliding_window, CONVERSATION, window, words, cw.WordCodec()
    )
    assert fitted.dropped == dropped
    kept = [i for i in range(len(CONVERSATION)) if i not in dropped]
    assert fitted.messages == [CONVERSATION[i] for i in kept]
    assert words(fitted.messages) <= window


def test_sliding_window_that_cannot_fit_the_pinned_part_says_so() -> None:
    with pytest.raises(ContractError) as info:
        cw.fit_messages(ContextStrategy.sliding_window, CONVERSATION, 24, words, cw.WordCodec())
    assert info.value.code is ErrorCode.context_length_exceeded
    assert info.value.param == "body.messages"
    assert "25 tokens" in info.value.message


@settings(max_examples=150, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.integers(1, 20), st.booleans(), st.integers(1, 20)), min_size=1, max_size=12
    ),
    window=st.integers(5, 200),
)
def test_tool_pairs_never_split_and_the_system_prompt_stays(
    turns: list[tuple[int, bool, int]], window: int
) -> None:
    items: list[dict[str, Any]] = [{"role": "system", "content": "s " * 3}]
    for n, (user, calls, reply) in enumerate(turns):
        items.append({"role": "user", "content": "u " * user})
        if calls:
            items += [call(f"c{n}"), tool(f"c{n}", "t " * reply)]
        items.append({"role": "assistant", "content": "a " * reply})
    items.append({"role": "user", "content": "q"})
    conversation = msgs(*items)
    if words(conversation) <= window:
        return
    try:
        fitted = cw.fit_messages(
            ContextStrategy.sliding_window, conversation, window, words, cw.WordCodec()
        )
    except ContractError:
        assert words([conversation[0], conversation[-1]]) > window
        return
    kept = fitted.messages
    assert words(kept) <= window
    assert kept[0] == conversation[0] and kept[-1] == conversation[-1]
    assert isinstance(kept[1], UserMessage) or len(kept) == 2  # a turn is dropped whole
    ids_called = {c.id for m in kept if isinstance(m, AssistantMessage) for c in m.tool_calls or ()}
    ids_answered = {m.tool_call_id for m in kept if isinstance(m, ToolMessage)}
    assert ids_called == ids_answered
    # the fewest: keeping one more turn would not fit
    if fitted.dropped:
        pinned, groups = cw.turn_groups(conversation)
        last = [g for g in groups if g[0] in fitted.dropped][-1]
        more = sorted(
            [*pinned, *(i for g in groups if g[0] not in fitted.dropped for i in g), *last]
        )
        assert words([conversation[i] for i in more]) > window


@pytest.mark.parametrize(
    "strategy", [ContextStrategy.truncate_middle, ContextStrategy.truncate_head]
)
def test_truncation_cuts_the_longest_message_by_tokens_with_a_marker(
    strategy: ContextStrategy,
) -> None:
    long_text = " ".join(f"w{i}" for i in range(100))
    conversation = msgs(
        {"role": "system", "content": "be brief"}, {"role": "user", "content": long_text}
    )
    fitted = cw.fit_messages(strategy, conversation, 60, words, cw.WordCodec())
    assert words(fitted.messages) <= 60
    [cut] = fitted.truncated
    assert cut.message == 1
    text = fitted.messages[1].content
    assert fitted.messages[0] == conversation[0]
    marker = TRUNCATION_MARKER.format(tokens=cut.tokens_removed)
    assert marker in text
    head, tail = text.split(marker)
    kept = head.split() + tail.split()
    assert len(kept) == 100 - cut.tokens_removed
    if strategy is ContextStrategy.truncate_head:
        assert head == "" and tail.split() == [f"w{i}" for i in range(cut.tokens_removed, 100)]
    else:
        assert head.split()[0] == "w0" and tail.split()[-1] == "w99"
        assert abs(len(head.split()) - len(tail.split())) <= 1


def test_cut_ids_middle_and_head() -> None:
    ids = list(range(10))
    assert cw.cut_ids(ids, 4, ContextStrategy.truncate_middle) == ([0, 1, 2], [7, 8, 9])
    assert cw.cut_ids(ids, 3, ContextStrategy.truncate_middle) == ([0, 1, 2, 3], [7, 8, 9])
    assert cw.cut_ids(ids, 4, ContextStrategy.truncate_head) == ([], [4, 5, 6, 7, 8, 9])
    assert cw.cut_ids(ids, 0, ContextStrategy.truncate_middle) == (ids[:5], ids[5:])


# ---------------------------------------------------------------- through the renderer


def envelope(
    body: dict[str, Any], context: dict[str, Any] | None, endpoint: str | None = None
) -> RequestEnvelope:
    data: dict[str, Any] = {"request_id": "ctx-1", "body": body, "context": context}
    if endpoint:
        data["endpoint"] = endpoint
    return validate_envelope(data)


@pytest.fixture()
def qwen(qwen3_tokenizer: Any) -> PromptRenderer:
    return PromptRenderer(qwen3_tokenizer, max_model_len=2048, served_names={"q"})


def long_chat(turns: int, words_per: int = 40) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for n in range(turns):
        items.append({"role": "user", "content": f"question {n} " + "lorem ipsum " * words_per})
        items += [call(f"call{n}"), tool(f"call{n}", "result " * words_per)]
        items.append({"role": "assistant", "content": f"answer {n} " + "dolor sit " * words_per})
    items.append({"role": "user", "content": "And now?"})
    return items


def test_sliding_window_on_qwen3_measures_with_the_template(
    qwen: PromptRenderer, qwen3_tokenizer: Any
) -> None:
    body = {"messages": long_chat(12), "max_tokens": 100}
    roomy = PromptRenderer(qwen3_tokenizer, max_model_len=100_000, served_names={"q"})
    plain = roomy.render(envelope(body, None))
    out = qwen.render(envelope(body, {"strategy": "sliding_window", "max_prompt_tokens": 900}))
    report = out.context
    assert report is not None and report.window == 900
    assert report.prompt_tokens_before == plain.prompt_tokens > 900
    assert report.prompt_tokens_after == out.prompt_tokens <= 900
    assert out.prompt_tokens == len(qwen3_tokenizer.encode(out.text, add_special_tokens=False))
    assert report.messages_dropped == len(report.dropped) > 0
    assert out.text.startswith("<|im_start|>system\nYou are terse.")
    assert "And now?" in out.text
    assert "question 0 " not in out.text and "question 11 " in out.text
    assert out.sampling.max_tokens == 100
    # one more (older) turn would not have fitted
    n_dropped_turns = report.messages_dropped // 4
    assert report.dropped == list(range(1, 1 + 4 * n_dropped_turns))


def test_the_window_is_never_larger_than_the_context_minus_max_tokens(qwen: PromptRenderer) -> None:
    body = {"messages": long_chat(12), "max_tokens": 1500}
    out = qwen.render(envelope(body, {"strategy": "sliding_window", "max_prompt_tokens": 4000}))
    assert out.context is not None and out.context.window == 2048 - 1500
    assert out.prompt_tokens <= 548
    assert out.prompt_tokens + out.sampling.max_tokens <= 2048
    unset = qwen.render(envelope({"messages": long_chat(12)}, {"strategy": "sliding_window"}))
    assert unset.context is not None
    assert unset.context.window == 2048 - min(DEFAULT_OUTPUT_RESERVE, 2048 // 4)


def test_truncate_middle_on_qwen3_cuts_one_message_with_a_visible_marker(
    qwen: PromptRenderer,
) -> None:
    document = " ".join(f"sentence {i} of the report." for i in range(800))
    body = {"messages": [{"role": "user", "content": "Summarise:\n" + document}], "max_tokens": 200}
    out = qwen.render(envelope(body, {"strategy": "truncate_middle"}))
    report = out.context
    assert report is not None and report.window == 2048 - 200
    assert report.prompt_tokens_before > 2048
    assert out.prompt_tokens <= report.window
    assert report.prompt_tokens_after == out.prompt_tokens
    [cut] = report.truncated
    assert cut.message == 0 and cut.tokens_removed >= report.prompt_tokens_before - report.window
    assert TRUNCATION_MARKER.format(tokens=cut.tokens_removed) in out.text
    assert "sentence 0 of" in out.text and "sentence 799 of" in out.text


def test_truncating_a_completions_prompt_text_and_ids(qwen: PromptRenderer) -> None:
    text = "word " * 3000
    out = qwen.render(
        envelope(
            {"prompt": text, "max_tokens": 48}, {"strategy": "truncate_head"}, "/v1/completions"
        )
    )
    assert out.context is not None and out.prompt_tokens <= 2000
    assert out.text.startswith("\n[... ") and out.context.truncated[0].message is None
    ids = list(range(100, 2600))
    out = qwen.render(
        envelope(
            {"prompt": ids, "max_tokens": 48},
            {"strategy": "truncate_middle", "max_prompt_tokens": 1000},
            "/v1/completions",
        )
    )
    assert out.token_ids is not None and len(out.token_ids) == 1000
    assert out.token_ids[:10] == ids[:10] and out.token_ids[-10:] == ids[-10:]


def test_error_strategy_refuses_past_max_prompt_tokens_and_default_keeps_todays_rule(
    qwen: PromptRenderer,
) -> None:
    body = {"messages": long_chat(3), "max_tokens": 10}
    with pytest.raises(ContractError) as info:
        qwen.render(envelope(body, {"strategy": "error", "max_prompt_tokens": 100}))
    assert info.value.code is ErrorCode.context_length_exceeded
    assert info.value.param == "body.messages"
    fits = qwen.render(envelope(body, {"strategy": "error"}))
    assert fits.context is not None and fits.context.messages_dropped == 0
    assert fits.context.prompt_tokens_after == fits.prompt_tokens
    with pytest.raises(ContractError) as info:
        qwen.render(envelope({"messages": long_chat(30), "max_tokens": 10}, None))
    assert info.value.code is ErrorCode.context_length_exceeded


def test_sliding_window_is_refused_for_completions_and_bad_policies_name_the_field() -> None:
    with pytest.raises(ContractError) as info:
        envelope({"prompt": "x"}, {"strategy": "sliding_window"}, "/v1/completions")
    assert info.value.param == "context.strategy"
    for bad, param in [
        ({"strategy": "shrink"}, "context.strategy"),
        ({"max_prompt_tokens": 0}, "context.max_prompt_tokens"),
        ({"strategy": "error", "extra": 1}, "context.extra"),
    ]:
        with pytest.raises(ContractError) as info:
            envelope({"messages": [{"role": "user", "content": "x"}]}, bad)
        assert info.value.param == param


def test_echo_renderer_counts_conversation_words() -> None:
    echo = PromptRenderer(None, max_model_len=100, served_names={"echo"})
    body = {
        "messages": [
            {"role": "user", "content": "old " * 60},
            {"role": "assistant", "content": "x " * 30},
            {"role": "user", "content": "new words"},
        ],
        "max_tokens": 10,
    }
    out = echo.render(envelope(body, {"strategy": "sliding_window"}))
    assert out.context is not None
    assert (out.context.prompt_tokens_before, out.context.prompt_tokens_after) == (92, 2)
    assert out.context.dropped == [0, 1] and out.text == "new words"
