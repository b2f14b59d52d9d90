"""The conformance corpus: request bodies with their expected outcome.

`tests/fixtures/conformance/bodies.jsonl` holds one case a line: `name`, `source` (the
documentation page an example comes from, or what a qbatch case checks), `endpoint`,
`body`, and `expect`: `"ok"` (a succeeded result) or the `param` a failed result names.
Bodies that name a `model` get the served one in its place (the documentation examples
name OpenAI's or another vLLM deployment's models), unless `keep_model` is set.

The unit tests run every case through the contract validator and the renderer
(`tests/unit/test_conformance.py`); the integration tests publish them all to a real
worker (`tests/integration/test_conformance_pipeline.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parent / "fixtures" / "conformance" / "bodies.jsonl"
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    endpoint: str
    body: dict[str, Any]
    expect: str
    keep_model: bool = False

    @property
    def ok(self) -> bool:
        return self.expect == "ok"

    @property
    def kind(self) -> str:
        """`chat` or `completions`: the endpoint's name in `schemas.openai_fields`."""
        return ENDPOINTS[self.endpoint]

    def envelope(self, request_id: str, served: str) -> dict[str, Any]:
        body = dict(self.body)
        if "model" in body and not self.keep_model:
            body["model"] = served
        return {"request_id": request_id, "endpoint": self.endpoint, "body": body}


def load() -> list[Case]:
    with CORPUS.open(encoding="utf-8") as fh:
        return [Case(**json.loads(line)) for line in fh if line.strip()]
