"""`pip install qbatch` (no extras) is the client, the CLI and the contract: nothing the
client imports needs torch, transformers, jinja2 or the worker's own dependencies.
(.ci/run also installs the bare package into a fresh venv and runs `qbatch --help`.)"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
HEAVY = {"torch", "transformers", "jinja2", "vllm", "prometheus_client", "structlog", "tenacity"}


def _name(dep: str) -> str:
    return re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].lower().replace("_", "-")


def test_the_bare_install_has_no_heavy_dependency() -> None:
    base = {_name(d) for d in PROJECT["dependencies"]}
    assert not base & {h.replace("_", "-") for h in HEAVY}
    extras = PROJECT["optional-dependencies"]
    assert {"worker", "cpu", "vllm"} <= set(extras)
    assert "qbatch[worker]" in extras["cpu"] and "qbatch[worker]" in extras["vllm"]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def _closure(names: set[str]) -> set[str]:
    """`names` and everything they require (installed metadata, no extras)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def test_client_and_contract_import_only_base_dependencies() -> None:
    base = _closure({_name(d) for d in PROJECT["dependencies"]})
    dists = metadata.packages_distributions()
    first_party = {"schemas", "producer", "worker", "__future__"}
    for package in ("schemas", "producer"):
        for path in (ROOT / package).rglob("*.py"):
            for module in _imports(path) - first_party - set(sys.stdlib_module_names):
                owners = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
                assert owners & base, f"{path.relative_to(ROOT)} imports {module} ({owners})"
            assert "worker" not in _imports(path), f"{path.relative_to(ROOT)} imports the worker"


def test_importing_the_client_loads_nothing_heavy() -> None:
    code = (
        "import sys, schemas, producer.cli, producer.client, producer.topic_results\n"
        "import schemas.json_schema, schemas.scripts, schemas.replies\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {HEAVY!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
