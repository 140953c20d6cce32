"""The engine's two Python faces: smddp._engine binds what smddp runs, smddp_rigs._engine_testing what only tests and rigs call; each one's stub is what nanobind's stubgen makes of it as built."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from smddp_rigs import _engine_testing

from smddp import _engine

REPO = Path(__file__).resolve().parents[2]
# Each module, its committed stub, and what stubgen is told beyond the module (make stubs: the same).
FACES = [
    (
        "smddp._engine",
        REPO / "smddp" / "_engine.pyi",
        ["-P", "-p", str(REPO / "smddp" / "engine" / "stubs.pat")],
    ),
    ("smddp_rigs._engine_testing", REPO / "rigs" / "smddp_rigs" / "_engine_testing.pyi", []),
]


@pytest.mark.parametrize(("module", "stub", "extra"), FACES, ids=["_engine", "_engine_testing"])
def test_each_stub_is_its_bindings_as_built(
    module: str, stub: Path, extra: list[str], tmp_path: Path
) -> None:
    """Every name, signature, record field and docstring as the bindings declare them (make stubs
    writes them); a binding changed without its stub fails here."""
    out = tmp_path / stub.name
    cmd = [sys.executable, "-m", "nanobind.stubgen", "-q", *extra, "-m", module, "-o", str(out)]
    subprocess.run(cmd, check=True, timeout=120)
    assert out.read_text() == stub.read_text(), f"{stub.relative_to(REPO)} is stale: make stubs"


def _public(module: ModuleType) -> set[str]:
    return {n for n in dir(module) if not n.startswith("_")}


def test_the_shipped_engine_binds_nothing_only_tests_call() -> None:
    """What the rigs' module binds (layouts, kernels, state machines, a daemon's end of the rings) is not
    in the wheel's module, and the two share nothing but the engine's sources."""
    assert _public(_engine) & _public(_engine_testing) == set()
    assert {"Collective", "NodeState", "DaemonChannel", "reduce"} <= _public(_engine_testing)
    assert {"decode_header", "encode_header", "WorkerChannel", "LocalPlane"} <= _public(_engine)
