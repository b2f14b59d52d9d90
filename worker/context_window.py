"""Fitting a prompt into its window: the context policy's rules. Pure.

The renderer measures with the served model's own tokenizer and chat template and passes
that in (`measure`, `codec`), so these rules are tested with any tokenizer and no model.

* `sliding_window` drops the oldest *turns* whole. System messages, the latest user message
  and everything after it (the current turn, e.g. a tool loop's calls and results) are
  pinned. The rest is cut into turns, each starting at a user message, so an assistant's
  `tool_calls` and the `tool` messages answering them always go together. The fewest oldest
  turns are dropped (a binary search over how many: a handful of template renders even for
  a conversation of hundreds of turns).
* `truncate_middle` / `truncate_head` cut one message, the longest, by tokens, and put a
  visible marker (`schemas.context.TRUNCATION_MARKER`) where text was cut. Token boundaries
  can merge when text is rejoined, so the cut is re-measured and deepened until it fits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from schemas.context import TRUNCATION_MARKER, ContextStrategy, Truncation
from schemas.errors import ContractError, ErrorCode
from schemas.request import Message, SystemMessage, UserMessage, content_text

__all__ = [
    "Codec",
    "Fitted",
    "WordCodec",
    "cut_ids",
    "fit_ids",
    "fit_messages",
    "fit_text",
    "turn_groups",
]

Measure = Callable[[Sequence[Message]], int]
"""Prompt tokens of a conversation, rendered as the engine would render it."""

T = TypeVar("T")
_MAX_ROUNDS = 6
"""Re-measure and deepen a truncation at most this often (merges cost a few tokens)."""


class Codec(Protocol):
    """Text <-> tokens for one model (a tokenizer's encode/decode without special tokens)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class WordCodec:
    """Whitespace words as tokens: the echo engine's measure (it has no tokenizer)."""

    def __init__(self) -> None:
        self._words: dict[int, str] = {}
        self._ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        out = []
        for word in text.split():
            if word not in self._ids:
                self._ids[word] = len(self._ids)
                self._words[self._ids[word]] = word
            out.append(self._ids[word])
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self._words[i] for i in ids)


@dataclass(slots=True)
class Fitted:
    messages: list[Message]
    dropped: list[int] = field(default_factory=list)
    truncated: list[Truncation] = field(default_factory=list)


def _too_long(message: str, param: str) -> ContractError:
    return ContractError(message, param=param, code=ErrorCode.context_length_exceeded)


# ---------------------------------------------------------------- sliding window


def turn_groups(messages: Sequence[Message]) -> tuple[list[int], list[list[int]]]:
    """(pinned indexes, droppable turns oldest first) of a conversation."""
    last_user = max(
        (i for i, m in enumerate(messages) if isinstance(m, UserMessage)),
        default=len(messages) - 1,
    )
    pinned = [i for i in range(last_user) if isinstance(messages[i], SystemMessage)]
    pinned.extend(range(last_user, len(messages)))
    groups: list[list[int]] = []
    for i in range(last_user):
        if isinstance(messages[i], SystemMessage):
            continue
        if not groups or isinstance(messages[i], UserMessage):
            groups.append([])
        groups[-1].append(i)
    return pinned, groups


def fit_messages(
    strategy: ContextStrategy,
    messages: Sequence[Message],
    window: int,
    measure: Measure,
    codec: Codec,
) -> Fitted:
    """The conversation cut to at most `window` tokens by `strategy` (the caller checked it
    is over); ContractError(context_length_exceeded) when the strategy cannot make it fit."""
    if strategy is ContextStrategy.sliding_window:
        return _slide(messages, window, measure)
    if strategy in (ContextStrategy.truncate_middle, ContextStrategy.truncate_head):
        return _truncate_longest(strategy, messages, window, measure, codec)
    raise ValueError(f"no fitting for strategy {strategy}")


def _slide(messages: Sequence[Message], window: int, measure: Measure) -> Fitted:
    pinned, groups = turn_groups(messages)

    def kept(k: int) -> list[int]:
        return sorted([*pinned, *(i for group in groups[k:] for i in group)])

    floor = measure([messages[i] for i in pinned])
    if floor > window:
        raise _too_long(
            f"even with every earlier turn dropped the prompt is {floor} tokens, over the "
            f"window of {window}: the system messages and the latest user message (and what "
            "follows it) are always kept; use truncate_middle to cut a long message",
            "body.messages",
        )
    lo, hi = 1, len(groups)  # the fewest dropped turns that fit lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if measure([messages[i] for i in kept(mid)]) <= window:
            hi = mid
        else:
            lo = mid + 1
    dropped = sorted(i for group in groups[:lo] for i in group)
    return Fitted([messages[i] for i in kept(lo)], dropped=dropped)


# ---------------------------------------------------------------- truncation


def cut_ids(ids: Sequence[T], remove: int, where: ContextStrategy) -> tuple[list[T], list[T]]:
    """(head, tail) left after removing `remove` items from the middle, or from the head."""
    remove = max(0, min(remove, len(ids)))
    keep = len(ids) - remove
    if where is ContextStrategy.truncate_head:
        return [], list(ids[remove:])
    head = (keep + 1) // 2
    return list(ids[:head]), list(ids[len(ids) - (keep - head) :])


def _marked(head: str, tail: str, removed: int) -> str:
    return head + TRUNCATION_MARKER.format(tokens=removed) + tail


def fit_text(
    strategy: ContextStrategy,
    text: str,
    over: int,
    codec: Codec,
    measure: Callable[[str], int],
    window: int,
    param: str,
) -> tuple[str, int]:
    """`text` cut (with the marker) so that `measure(text)` <= `window`; `over` is how many
    tokens the whole prompt is over now. Returns (text, tokens removed from it)."""
    ids = codec.encode(text)
    marker = len(codec.encode(TRUNCATION_MARKER.format(tokens=len(ids))))
    remove = over + marker
    for _ in range(_MAX_ROUNDS):
        if remove >= len(ids):
            break
        head, tail = cut_ids(ids, remove, strategy)
        cut = _marked(codec.decode(head), codec.decode(tail), remove)
        excess = measure(cut) - window
        if excess <= 0:
            return cut, remove
        remove += excess
    raise _too_long(
        f"cutting {param} ({len(ids)} tokens) cannot bring the prompt under the window of "
        f"{window} tokens: the rest of the prompt alone is too long",
        param,
    )


def _truncate_longest(
    strategy: ContextStrategy,
    messages: Sequence[Message],
    window: int,
    measure: Measure,
    codec: Codec,
) -> Fitted:
    lengths = [
        (len(codec.encode(content_text(getattr(m, "content", None)))), i)
        for i, m in enumerate(messages)
    ]
    longest = max(lengths)[1]
    target = messages[longest]
    out = list(messages)

    def measure_with(text: str) -> int:
        out[longest] = target.model_copy(update={"content": text})
        return measure(out)

    over = measure(messages) - window
    text, removed = fit_text(
        strategy,
        content_text(getattr(target, "content", None)),
        over,
        codec,
        measure_with,
        window,
        f"body.messages[{longest}]",
    )
    out[longest] = target.model_copy(update={"content": text})
    return Fitted(out, truncated=[Truncation(message=longest, tokens_removed=removed)])


def fit_ids(
    strategy: ContextStrategy, ids: Sequence[int], window: int, marker_ids: Sequence[int]
) -> tuple[list[int], int]:
    """A token-id completions prompt cut to `window` ids with the marker's ids in the cut."""
    remove = len(ids) - window + len(marker_ids)
    if strategy is ContextStrategy.sliding_window or remove >= len(ids):
        raise _too_long(
            f"the prompt is {len(ids)} token ids; {strategy} cannot fit it in {window}",
            "body.prompt",
        )
    head, tail = cut_ids(list(ids), remove, strategy)
    return [*head, *marker_ids, *tail], remove
