"""The package's layering, read from the imports (``ast``): no import cycle between ``stem_megatron``
modules, none between its top-level parts (``stem_megatron.data``, ``.model``, ``.config``, ...), and no
module grown past a size a reader holds in their head. Runs in a second; nothing is imported."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "stem_megatron"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its body, lazy imports included)."""

    def resolve(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    parts = base.split(".")[: len(base.split(".")) - node.level + 1]
                    module = ".".join(parts + ([module] if module else []))
                targets |= {module} | {f"{module}.{alias.name}" for alias in node.names}
        graph[name] = {r for t in targets if t.split(".")[0] == PACKAGE.name and (r := resolve(t)) and r != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def _part(module: str) -> str:
    """``stem_megatron.data.batches`` -> ``stem_megatron.data``; top-level modules are their own part."""
    return ".".join(module.split(".")[:2])


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    mods = _modules()
    graph = _imports(mods)
    # a package's __init__ importing its own modules is no cycle of the code
    graph = {m: {t for t in ts if mods[t].name != "__init__.py"} for m, ts in graph.items()}
    assert _cycles(graph) == [], "modules import each other in a loop: move the shared piece down a layer"


def test_no_import_cycle_between_top_level_parts():
    parts: dict[str, set[str]] = {}
    for module, targets in _imports(_modules()).items():
        parts.setdefault(_part(module), set()).update(_part(t) for t in targets if _part(t) != _part(module))
    assert _cycles(parts) == [], "top-level parts of stem_megatron import each other: see docs/ARCHITECTURE.md"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_size(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines: split it by concern (limit {MAX_LINES})"
