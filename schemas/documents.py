"""Read a small config document (a route table, a keys file) from JSON or YAML."""

from __future__ import annotations

import json
from pathlib import Path


class DocumentError(ValueError):
    """The document is not valid JSON/YAML, or YAML cannot be read here (no pyyaml)."""


def read_document(path: Path) -> object:
    """The parsed `.yaml`/`.yml` (pyyaml: the serve and worker extras) or JSON file.
    OSError when it cannot be read; DocumentError when it does not parse."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError:
            raise DocumentError(
                f"{path}: reading YAML needs pyyaml (pip install 'qbatch[serve]'); "
                "or give it as JSON"
            ) from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise DocumentError(f"{path}: not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise DocumentError(f"{path}: not valid JSON: {exc}") from None


__all__ = ["DocumentError", "read_document"]
