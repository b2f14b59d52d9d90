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
SERVE = {"fastapi", "uvicorn", "starlette", "python_multipart"}


def _name(dep: str) -> str:
    return re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].lower().replace("_", "-")


def test_the_bare_install_has_no_heavy_dependency() -> None:
    base = {_name(d) for d in PROJECT["dependencies"]}
    assert not base & {h.replace("_", "-") for h in HEAVY}
    extras = PROJECT["optional-dependencies"]
    assert {"worker", "cpu", "vllm"} <= set(extras)
    assert "qbatch[worker]" in extras["cpu"] and "qbatch[worker]" in extras["vllm"]


def _imports(path: Path, *, nested: bool = True) -> set[str]:
    """Top-level package names `path` imports (`nested=False`: at module level only,
    the imports that run whenever the module is imported)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    nodes = ast.walk(tree) if nested else _module_level(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def _module_level(tree: ast.Module) -> list[ast.AST]:
    """Statements run at import (module body, also inside if/try), not in functions nor
    under `if TYPE_CHECKING:` (never run)."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        out.append(node)
        if isinstance(node, ast.If | ast.Try | ast.With):
            for name in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, name, []))
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
    return out


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


LAZY_WORKER_IMPORTS = {"producer/cli_tools.py", "producer/tools/http.py"}
"""Client modules of the tool executor (`qbatch tools serve`, HTTP tools): they import the
worker extra inside the functions that need it, and say so when it is missing."""
WORKER_ALIASES = {"producer/tools/__init__.py"}
"""`producer.tools`: the tool-author API under its earlier name, re-exported from
`worker.tool_loop` (the loop's home). Neither the client nor the CLI imports it; the
worker modules it loads import only base dependencies (checked below)."""
TOOL_AUTHOR_MODULES = ("__init__.py", "registry.py", "spec.py", "http.py")
"""What `from producer.tools import ToolRegistry` loads of `worker/tool_loop/`."""
LAZY_DOCS_IMPORTS = {"producer/summarize/tokens.py"}
"""The summarisation tokenizer: the docs extra, imported where it is needed."""
LAZY_SERVE_IMPORTS = {"producer/cli_serve.py", "schemas/documents.py"}
"""`schemas/documents.py` reads a YAML route table or keys file with pyyaml (the serve
extra) when given one; JSON needs nothing more."""
SERVE_PACKAGE = "producer/serve/"
"""`qbatch serve` (the serve extra): only `producer/cli_serve.py` imports it, inside the
command, so its modules may import the serve extra at module level."""


def test_client_and_contract_import_only_base_dependencies() -> None:
    base = _closure({_name(d) for d in PROJECT["dependencies"]})
    extra = _closure({_name(d) for d in PROJECT["optional-dependencies"]["worker"]})
    docs = {_name(d) for d in PROJECT["optional-dependencies"]["docs"]}
    serve = _closure({_name(d) for d in PROJECT["optional-dependencies"]["serve"]})
    dists = metadata.packages_distributions()
    first_party = {"schemas", "producer", "worker", "__future__"}
    for package in ("schemas", "producer"):
        for path in (ROOT / package).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if rel.startswith(SERVE_PACKAGE):
                for module in _imports(path) - first_party - set(sys.stdlib_module_names):
                    owners = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
                    assert owners & (base | serve), f"{rel} imports {module} ({owners})"
                continue
            lazy = rel in LAZY_WORKER_IMPORTS | LAZY_DOCS_IMPORTS | LAZY_SERVE_IMPORTS
            allowed = docs if rel in LAZY_DOCS_IMPORTS else extra
            allowed = serve if rel in LAZY_SERVE_IMPORTS else allowed
            loaded = _imports(path, nested=not lazy)
            for module in loaded - first_party - set(sys.stdlib_module_names):
                owners = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
                assert owners & base, f"{rel} imports {module} ({owners})"
            if rel not in WORKER_ALIASES:
                assert "worker" not in loaded, f"{rel} imports the worker"
            if lazy:  # what the functions import is still declared, by the worker extra
                for module in _imports(path) - first_party - set(sys.stdlib_module_names):
                    owners = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
                    assert owners & (base | allowed), f"{rel} imports {module} ({owners})"


def test_writing_tools_needs_only_base_dependencies() -> None:
    """A registry module (`from producer.tools import ToolRegistry`) imports in a bare
    install: the tool-author modules import only base dependencies at module level."""
    base = _closure({_name(d) for d in PROJECT["dependencies"]})
    dists = metadata.packages_distributions()
    for name in TOOL_AUTHOR_MODULES:
        path = ROOT / "worker" / "tool_loop" / name
        loaded = _imports(path, nested=False) - {"schemas", "worker", "__future__"}
        for module in loaded - set(sys.stdlib_module_names):
            owners = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
            assert owners & base, f"worker/tool_loop/{name} imports {module} ({owners})"
        first_party = {
            node.module
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
        }
        worker_deps = {m for m in first_party if m.startswith("worker.")}
        assert worker_deps <= {f"worker.tool_loop.{n[:-3]}" for n in TOOL_AUTHOR_MODULES}, (
            name,
            worker_deps,
        )


def test_importing_the_client_loads_nothing_heavy() -> None:
    code = (
        "import sys, schemas, producer.cli, producer.client, producer.topic_results\n"
        "import schemas.json_schema, schemas.scripts, schemas.replies\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {HEAVY | SERVE!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
