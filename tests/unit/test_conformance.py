"""The conformance corpus through the contract validator and the renderer (no sockets)."""

from __future__ import annotations

from typing import Any

import pytest

from schemas import ContractError, validate_envelope
from schemas.openai_fields import RULES
from tests.conformance import Case, load
from worker.rendering import PromptRenderer

CASES = load()
SERVED = "qwen3-14b"


def outcome(case: Case, renderer: PromptRenderer) -> str:
    """What a worker answers: "ok", or the param of the failed result."""
    try:
        renderer.render(validate_envelope(case.envelope("conf-1", SERVED)))
    except ContractError as exc:
        return exc.param or "(none)"
    return "ok"


@pytest.fixture(scope="module")
def renderers(qwen3_tokenizer: Any) -> dict[str, PromptRenderer]:
    return {
        "echo": PromptRenderer(None, max_model_len=32_768, served_names={SERVED}),
        "qwen3": PromptRenderer(qwen3_tokenizer, max_model_len=32_768, served_names={SERVED}),
    }


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case_has_its_expected_outcome(case: Case, renderers: dict[str, PromptRenderer]) -> None:
    for name, renderer in renderers.items():
        assert outcome(case, renderer) == case.expect, f"{case.name} on the {name} renderer"


def test_corpus_covers_every_field_of_both_endpoints() -> None:
    for endpoint in ("chat", "completions"):
        sent = {key for case in CASES if case.kind == endpoint for key in case.body}
        ruled = {rule.name for rule in RULES if rule.applies_to(endpoint)}  # type: ignore[arg-type]
        assert ruled - sent == set(), f"{endpoint} fields no corpus body sends"


def test_corpus_holds_the_documentation_examples() -> None:
    sources = [case.source for case in CASES]
    assert len({case.name for case in CASES}) == len(CASES)
    assert sum(s.startswith("OpenAI API reference") for s in sources) >= 8
    assert sum(s.startswith("vLLM docs") for s in sources) >= 8
    assert any(c.ok for c in CASES) and any(not c.ok for c in CASES)
