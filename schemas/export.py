"""Write the JSON Schema files under `schemas/json/` (`python -m schemas.export`).

The files are committed so that non-Python producers can validate against
them; a test fails when they no longer match the models.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel

from schemas.batch import BatchInputLine, BatchOutputLine
from schemas.request import RequestEnvelope
from schemas.result import ResultEnvelope
from schemas.tool_events import ToolTurnEvent

JSON_DIR = Path(__file__).parent / "json"
MODELS: dict[str, type[BaseModel]] = {
    "request-envelope.schema.json": RequestEnvelope,
    "result-envelope.schema.json": ResultEnvelope,
    "batch-input-line.schema.json": BatchInputLine,
    "batch-output-line.schema.json": BatchOutputLine,
    "tool-turn-event.schema.json": ToolTurnEvent,
}


def render(model: type[BaseModel]) -> str:
    schema = model.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main() -> int:
    JSON_DIR.mkdir(exist_ok=True)
    for name, model in MODELS.items():
        (JSON_DIR / name).write_text(render(model))
        print(f"wrote {JSON_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
