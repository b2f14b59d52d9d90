"""The code's shape, checked: no product module over ~500 lines, no import cycles (an
import inside a function counts: it only hides the cycle from the interpreter's start),
and service.py wires without doing the work itself."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "producer", "worker")
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """Modules `path` imports anywhere (at module level or inside a function), bar those
    under `if TYPE_CHECKING:`, which never run."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def test_no_product_module_is_over_500_lines() -> None:
    long = {n: len(p.read_text().splitlines()) for n, p in _modules().items()}
    assert {n: c for n, c in long.items() if c > MAX_LINES} == {}


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {n: _imports(p, set(modules)) - {n} for n, p in modules.items()}
    # a package's __init__ importing its own submodules is not a cycle worth reporting
    for name in graph:
        graph[name] = {m for m in graph[name] if not (m.startswith(name + "."))}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_worker_imports_nothing_from_producer() -> None:
    """One direction between the packages: the producer side (the `qbatch` CLI) may start
    worker-side parts (`qbatch tools serve`), the worker never reaches into the producer
    (the tool executor once did, and `producer.cli_tools` back down)."""
    modules = _modules()
    up = {
        name: sorted(m for m in _imports(path, set(modules)) if m.split(".")[0] == "producer")
        for name, path in modules.items()
        if name.split(".")[0] == "worker"
    }
    assert {name: found for name, found in up.items() if found} == {}


def test_service_only_wires() -> None:
    """service.py builds and starts the parts; it has no loop of its own beyond the main
    loop (`_serve`: one intake step a turn until a stop), and imports no Kafka or Redis client
    library. Polling, batching and flushing loops live in the parts that own them."""
    tree = ast.parse((ROOT / "worker" / "service.py").read_text())
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.While | ast.AsyncFor)]
    assert len(loops) == 1, [ast.unparse(n).splitlines()[0] for n in loops]
    imported = {
        (n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
    } | {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"kafka", "redis"}


def test_test_files_have_unique_names() -> None:
    """Test modules in folders without `__init__.py` are imported by their bare name, so two
    `test_x.py` in different folders stop the whole collection ('import file mismatch')
    when run together, as CI does, though each passes on its own."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        if not (path.parent / "__init__.py").exists():
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}
