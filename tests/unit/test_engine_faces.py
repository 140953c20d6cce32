"""The engine's two Python faces: smddp._engine binds what smddp runs, smddp_rigs._engine_testing what only tests and rigs call; each stub says what its module is (the shipped one's generated from its bindings)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from smddp_rigs import _engine_testing

from smddp import _engine

REPO = Path(__file__).resolve().parents[2]
FACES = [(_engine_testing, REPO / "rigs" / "smddp_rigs" / "_engine_testing.pyi")]


def _stub(path: Path) -> dict[str, set[str] | None]:
    """Top-level names of a stub; for each class, its members (None for functions and constants)."""
    out: dict[str, set[str] | None] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            # Public members, as _public lists them: methods and properties, and attributes declared
            # as such (a class other Python classes subclass declares what they share that way).
            names = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} | {
                n.target.id
                for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
            members = {n for n in names if not n.startswith("_")}
            out[node.name] = members
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = None
    return out


def _public(obj: object) -> set[str]:
    """Public names; a record class's (a struct sequence: a tuple whose fields have names) are its fields."""
    if isinstance(obj, type) and issubclass(obj, tuple):
        return set(obj.__match_args__)
    return {n for n in dir(obj) if not n.startswith("_")}


def test_the_engines_stubs_are_its_bindings_as_built(tmp_path: Path) -> None:
    """smddp/_engine.pyi is what nanobind's stubgen makes of the module as built: every name, signature,
    record field and docstring (make stubs writes it); a binding changed without it fails here."""
    out = tmp_path / "_engine.pyi"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "nanobind.stubgen",
            "-q",
            "-P",
            "-p",
            str(REPO / "smddp" / "engine" / "stubs.pat"),
            "-m",
            "smddp._engine",
            "-o",
            str(out),
        ],
        check=True,
        timeout=120,
    )
    committed = (REPO / "smddp" / "_engine.pyi").read_text()
    assert out.read_text() == committed, "smddp/_engine.pyi is stale: make stubs"


@pytest.mark.parametrize(("module", "stub"), FACES, ids=["_engine_testing"])
def test_each_stub_lists_its_module_exactly(module: ModuleType, stub: Path) -> None:
    declared = _stub(stub)
    assert set(declared) == _public(module)
    for name, members in declared.items():
        if members is not None:
            assert members == _public(getattr(module, name)), name


def test_the_shipped_engine_binds_nothing_only_tests_call() -> None:
    """What the rigs' module binds (the codec, layouts, kernels, state machines, a daemon's end of the
    rings) is not in the wheel's module, and the two share nothing but the engine's sources."""
    assert _public(_engine) & _public(_engine_testing) == set()
    assert {"Collective", "NodeState", "DaemonChannel", "reduce"} <= _public(_engine_testing)
