"""Prefix-aware placement: which partition a bulk line goes to, and in what order.

vLLM's prefix cache only saves the prefill of a shared prompt prefix (a long system
prompt, the same tools, few-shot turns) when lines of one *family* reach the same engine
close together. With Kafka's key partitioner every family is spread over every
partition, so with several workers each one computes every family's prefix, and a
shuffled file interleaves families on each engine. Placement fixes both on the publisher
side: lines of a family go to one partition (one worker's engine) and are published
together.

Nothing here does I/O: the family key is a hash of the request body, the planner a pure
function of the lines it is shown (and of what it planned before), so all of it is
unit-tested without Kafka. `producer.client.QBatchClient.place` applies it.

Decisions:

* **Family** (`family_key`): a hash of the first `prefix_chars` characters of a canonical
  text built in the order a chat template renders a request: the model name, the
  `cache_salt` (vLLM never shares cache across salts), the tools as canonical JSON, then
  each message's role and content (content parts flattened, tool calls as JSON); for a
  completions body, the prompt. The client has no tokenizer or chat template (the bare
  install has neither), so this is a character-level proxy for "hashed on the model's
  template": two lines are one family when their canonical texts agree on the first
  `prefix_chars` characters. A line shorter than that has no family and is placed as
  before (Kafka's key partitioner): there is too little shared prefill to be worth
  steering.
* **`DEFAULT_PREFIX_CHARS` = 4,096** characters, about 1,000 tokens of English (~4 chars a
  token). That is where prefix caching pays clearly (1.69x on a 1,000-token shared prompt
  in the README's measured table) while shorter shared openings ("You are a helpful
  assistant.") stay unsteered; a longer key would only miss families whose lines diverge
  between 1,000 tokens and the key's end.
* **Partition** of a family: a stable hash (sha256, never Python's salted `hash()`) modulo
  the partition count, so the same family from another job or producer lands on the
  same partition and the same worker's cache.
* **The cap** (`max_run`, `DEFAULT_MAX_RUN` = 64 lines): a family is cut into runs of at
  most 64 consecutive lines; run k goes to the family's partition + k. 64 is the worker's
  micro-batch (`batch_max_size`), so a run is about one batch: one prefill of the prefix
  and 63 hits, most of the gain, while a family of thousands of lines is spread over
  every partition instead of queueing on one worker while the others idle, and the lines
  of other jobs on that partition wait behind at most a run of it, not the whole family.
  The planner remembers where each family's run stands across windows, so a family that
  recurs in every chunk still rotates.
* **Order** inside a window: runs interleaved round-robin over the families in order of
  first appearance (run 0 of every family, then run 1 of those that have one, ...), file
  order kept inside a family. A family below the cap is therefore published as one
  contiguous block, in family order; a huge family does not push every other family of
  the window behind all of its lines. Lines without a family keep their place among the
  families' first runs and get partition None.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class PlacementMode(StrEnum):
    """`prefix`: prefix-aware placement; `none`: Kafka's key partitioner, input order."""

    prefix = "prefix"
    none = "none"


DEFAULT_PREFIX_CHARS = 4_096
"""Characters of canonical text a family key hashes (~1,000 tokens)."""
DEFAULT_MAX_RUN = 64
"""Most consecutive lines of one family sent to one partition (the worker's batch size)."""

_SEP = "\x1e"  # between fields: a control character prompts do not use
_SUB = "\x1f"  # between a field's name and its value


def placement_mode(value: str | PlacementMode) -> PlacementMode:
    """`value` as a PlacementMode; ValueError naming the choices otherwise."""
    try:
        return PlacementMode(value)
    except ValueError:
        choices = ", ".join(m.value for m in PlacementMode)
        raise ValueError(f"placement must be one of {choices}, got {value!r}") from None


# ---------------------------------------------------------------- family key


def _get(obj: Any, name: str) -> Any:
    """A field of a validated body (pydantic) or of a raw JSON body (a dict), alike."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _plain(obj: Any) -> Any:
    """A part or sub-object as JSON data, None fields dropped (pydantic or dict alike)."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json", exclude_none=True, by_alias=True)
    if isinstance(obj, Mapping):
        return {k: v for k, v in obj.items() if v is not None}
    return obj


def _content(content: Any) -> str:
    """Message content flattened: text parts' text, other parts as canonical JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        kind = _get(part, "type")
        if kind == "text":
            out.append(str(_get(part, "text") or ""))
        elif kind == "refusal":
            out.append(str(_get(part, "refusal") or ""))
        else:
            out.append(_json(_plain(part)))
    return "".join(out)


def _function(fn: Any) -> dict[str, Any]:
    names = ("name", "description", "parameters", "strict")
    return {name: _get(fn, name) for name in names if _get(fn, name) is not None}


def _tool_calls(calls: Any) -> str:
    """Tool calls as templates render them: names and arguments (ids are not rendered)."""
    return _json(
        [[_get(_get(c, "function"), "name"), _get(_get(c, "function"), "arguments")] for c in calls]
    )


def _prompt(prompt: Any) -> str:
    """A completions prompt: the text, the first of a list of texts, or token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    return " ".join(str(token) for token in prompt or ())


def _pieces(body: Any) -> Iterator[str]:
    """The canonical text, piece by piece, in the order a chat template renders."""
    yield f"model{_SUB}{_get(body, 'model') or ''}"
    salt = _get(body, "cache_salt")
    if salt:
        yield f"{_SEP}salt{_SUB}{salt}"
    messages = _get(body, "messages")
    if messages is None:
        yield f"{_SEP}prompt{_SUB}{_prompt(_get(body, 'prompt'))}"
        return
    tools = _get(body, "tools")
    if tools:
        yield f"{_SEP}tools{_SUB}" + _json([_function(_get(t, "function")) for t in tools])
    for message in messages:
        yield f"{_SEP}{_get(message, 'role')}{_SUB}"
        name = _get(message, "name")
        if name:
            yield f"{name}{_SUB}"
        yield _content(_get(message, "content"))
        calls = _get(message, "tool_calls")
        if calls:
            yield f"{_SUB}calls{_SUB}" + _tool_calls(calls)


def canonical_prefix(body: Any, limit: int) -> str:
    """The first `limit` characters (or fewer, if it is shorter) of a body's canonical
    text; stops building once it has them, so a huge conversation costs no more."""
    pieces: list[str] = []
    size = 0
    for piece in _pieces(body):
        pieces.append(piece)
        size += len(piece)
        if size >= limit:
            break
    return "".join(pieces)[:limit]


def family_key(body: Any, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str | None:
    """The family of a request body (a validated `schemas` body or its JSON dict): a hex
    digest of the first `prefix_chars` characters of its canonical text, or None when the
    text is shorter (no long shared prefix to steer by; the line is placed as before)."""
    if prefix_chars < 1:
        raise ValueError("prefix_chars must be >= 1")
    text = canonical_prefix(body, prefix_chars)
    if len(text) < prefix_chars:
        return None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def home_partition(family: str, partitions: int) -> int:
    """The partition a family's first run goes to: stable across processes and runs."""
    digest = hashlib.sha256(family.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % partitions


# ---------------------------------------------------------------- planner


@dataclass(frozen=True, slots=True)
class Placed:
    """One line's place: `index` into the window, its request id, the partition (None:
    Kafka's key partitioner) and its family (None: none)."""

    index: int
    request_id: str
    partition: int | None
    family: str | None


class PrefixPlanner:
    """Plans windows of lines (a bulk job's chunks, one `submit_many` call): publication
    order and partition per line. Keep one planner per job so a family's runs go on
    rotating from one window to the next; `plan` is deterministic given the windows it
    has seen (no clock, no randomness, no Python `hash()`)."""

    def __init__(self, max_run: int = DEFAULT_MAX_RUN) -> None:
        if max_run < 1:
            raise ValueError("max_run must be >= 1")
        self.max_run = max_run
        self._runs: dict[str, tuple[int, int]] = {}
        """family -> (its current run number, lines already in that run)."""
        self.placed = 0
        """Lines given a partition so far (lines of some family)."""

    @property
    def families(self) -> int:
        """Families seen so far."""
        return len(self._runs)

    def plan(self, window: Sequence[tuple[str, str | None]], partitions: int) -> list[Placed]:
        """`window`: (request_id, family or None) in input order; `partitions`: the
        topic's partition count. Returns every line once, in publication order."""
        if partitions < 1:
            raise ValueError("partitions must be >= 1")
        members: dict[str, list[int]] = {}
        order: list[str | int] = []  # a family, or the index of a line without one
        for index, (_rid, family) in enumerate(window):
            if family is None:
                order.append(index)
            elif family in members:
                members[family].append(index)
            else:
                members[family] = [index]
                order.append(family)
        groups: list[list[list[Placed]]] = []
        for key in order:
            if isinstance(key, int):
                groups.append([[Placed(key, window[key][0], None, None)]])
            else:
                groups.append(self._runs_of(key, members[key], window, partitions))
        placed: list[Placed] = []
        for round_no in range(max((len(runs) for runs in groups), default=0)):
            for runs in groups:
                if round_no < len(runs):
                    placed.extend(runs[round_no])
        return placed

    def _runs_of(
        self,
        family: str,
        indexes: list[int],
        window: Sequence[tuple[str, str | None]],
        partitions: int,
    ) -> list[list[Placed]]:
        home = home_partition(family, partitions)
        run_no, filled = self._runs.get(family, (0, 0))
        runs: list[list[Placed]] = []
        current: list[Placed] = []
        for index in indexes:
            if filled >= self.max_run:
                run_no, filled = run_no + 1, 0
                if current:
                    runs.append(current)
                    current = []
            partition = (home + run_no) % partitions
            current.append(Placed(index, window[index][0], partition, family))
            filled += 1
        self.placed += len(indexes)
        if current:
            runs.append(current)
        self._runs[family] = (run_no, filled)
        return runs


def plan_window(
    window: Sequence[tuple[str, str | None]],
    partitions: int,
    *,
    max_run: int = DEFAULT_MAX_RUN,
) -> list[Placed]:
    """One window planned by a fresh `PrefixPlanner` (no memory of earlier windows)."""
    return PrefixPlanner(max_run).plan(window, partitions)


def arrange(
    request_ids: Sequence[str],
    families: Sequence[str | None],
    topics: Sequence[str],
    partitions: Callable[[str], int | None],
    planner: PrefixPlanner,
) -> list[tuple[int, int | None]]:
    """(index, partition) of every item, in publication order, each topic planned apart
    (a route table may send a window's lines to several topics). `partitions(topic)` is
    asked only for topics where some line has a family; when it cannot tell (None), that
    topic's lines keep their order and Kafka's key partitioner."""
    by_topic: dict[str, list[int]] = {}
    for index, topic in enumerate(topics):
        by_topic.setdefault(topic, []).append(index)
    out: list[tuple[int, int | None]] = []
    for topic, indexes in by_topic.items():
        count = partitions(topic) if any(families[i] is not None for i in indexes) else None
        if not count:
            out.extend((i, None) for i in indexes)
            continue
        window = [(request_ids[i], families[i]) for i in indexes]
        out.extend((indexes[p.index], p.partition) for p in planner.plan(window, count))
    return out


__all__ = [
    "DEFAULT_MAX_RUN",
    "DEFAULT_PREFIX_CHARS",
    "Placed",
    "PlacementMode",
    "PrefixPlanner",
    "arrange",
    "canonical_prefix",
    "family_key",
    "home_partition",
    "placement_mode",
    "plan_window",
]
