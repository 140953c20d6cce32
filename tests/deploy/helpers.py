"""Shared helpers for the deploy tier: the repository's deploy/ files, the tools that check them, and
reading the mpirun command that smddp-launch --dry-run prints."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent


def tool(name: str, hint: str = "pip install -e '.[dev]' installs it") -> str:
    """A checker's path: beside this Python (the dev extra installs them there), else on PATH.

    Missing, it fails the test under CI (CI must check everything) and skips it elsewhere."""
    found = BIN / name if (BIN / name).exists() else shutil.which(name)
    if found:
        return str(found)
    message = f"{name} not found: {hint}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def run(argv: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, **kwargs)


def base_env(**extra: str) -> dict[str, str]:
    """A small, known environment: no Slurm or SMDDP variables leak in from the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SMDDP_", "PRTE_", "OMPI_"))}
    env.update(extra)
    return env


def shell_scripts() -> list[Path]:
    """Every file under deploy/ that starts with a bash or sh shebang."""
    found = []
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file() and path.suffix not in (".json", ".yaml", ".md", ".py"):
            with path.open("rb") as f:
                first = f.readline()
            if first.startswith(b"#!") and (b"bash" in first or first.rstrip().endswith(b"/sh")):
                found.append(path)
    return found


@dataclass
class AppContext:
    np: int
    hosts: str  # the --host value, "" when none
    argv: list[str]  # the program and its arguments


@dataclass
class MpirunCommand:
    argv: list[str]
    daemons: AppContext
    workers: AppContext

    def option(self, name: str) -> list[str]:
        """The values of every `name VALUE` before the first application context (global options)."""
        head = self.argv[: self.argv.index("-np")]
        return [head[i + 1] for i, word in enumerate(head[:-1]) if word == name]

    def prtemca(self, key: str) -> str | None:
        head = self.argv[: self.argv.index("-np")]
        for i, word in enumerate(head[:-2]):
            if word == "--prtemca" and head[i + 1] == key:
                return head[i + 2]
        return None


def parse_mpirun(text: str) -> MpirunCommand:
    """smddp's two mpirun commands, as --dry-run prints them: the daemons' line, then the workers'.

    Both start with the same global options; `argv` is the daemons' line.
    """
    lines = [line for line in text.strip().splitlines() if line.strip()][-2:]
    assert len(lines) == 2, text
    argvs = [shlex.split(line) for line in lines]
    contexts = []
    for argv in argvs:
        assert Path(argv[0]).name == "mpirun", argv
        ctx = argv[argv.index("-np") :]
        np_, rest = int(ctx[1]), ctx[2:]
        hosts = ""
        if rest[:1] == ["--host"]:
            hosts, rest = rest[1], rest[2:]
        contexts.append(AppContext(np_, hosts, rest))
    heads = [argv[: argv.index("-np")] for argv in argvs]
    assert heads[0] == heads[1], "the daemons' and the workers' mpirun differ in their options"
    return MpirunCommand(argvs[0], *contexts)
