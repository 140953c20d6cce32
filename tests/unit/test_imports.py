"""The package's import graph, read from the source: no cycles, and the layers of docs/architecture.md (proto pure; daemon and client never import each other)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("smddp", "smdistributed")


def _modules() -> dict[str, Path]:
    """Every module by name: the Python sources, and the compiled ones by their stubs (smddp._engine)."""
    found = {}
    for top in PACKAGES:
        for path in sorted((REPO / top).rglob("*.py*")):
            if path.suffix not in (".py", ".pyi") or path.with_suffix(".py") in found.values():
                continue
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in it (inside functions too: a cycle through
    a late import is still a cycle), but for imports under `if TYPE_CHECKING:`."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if path.suffix == ".pyi":
            graph[name] = set()  # compiled: it imports none of ours
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
        out: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in modules:
                        out.add(sub)
                    elif base in modules:
                        out.add(base)
        out.discard(name)
        graph[name] = out
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    graph = _graph()
    assert len(graph) > 80  # the whole package was read
    assert _cycles(graph) == []


def test_a_cycle_is_found() -> None:
    """The finder itself: a cycle through three modules, and none where the edges go one way."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def _imports_of(graph: dict[str, set[str]], prefix: str) -> set[str]:
    return {w for v, ws in graph.items() if v == prefix or v.startswith(prefix + ".") for w in ws}


def test_the_layers() -> None:
    graph = _graph()
    proto = _imports_of(graph, "smddp.proto")
    # (smddp._engine: the one frame codec, the engine's, pure functions of bytes; docs/architecture.md)
    assert {m for m in proto if not m.startswith("smddp.proto")} <= {"smddp.errors", "smddp._engine"}, proto
    assert not {m for m in _imports_of(graph, "smddp.daemon") if m.startswith("smddp.client")}
    assert not {m for m in _imports_of(graph, "smddp.client") if m.startswith("smddp.daemon")}
