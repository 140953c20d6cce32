"""Static checks of deploy/: the shell scripts pass shellcheck, the Dockerfiles pass hadolint, and
what the Dockerfiles copy, install and run is what the rest of deploy/ expects (Docker cannot build
here, so the images themselves are checked by reading them)."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.deploy.helpers import DEPLOY, REPO, run, shell_scripts, tool

pytestmark = pytest.mark.deploy

DOCKERFILES = sorted(p for p in (DEPLOY / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")
SCRIPTS = shell_scripts()


def test_the_files_are_there():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.gpu"]
    assert {p.relative_to(DEPLOY).as_posix() for p in SCRIPTS} == {
        "docker/entrypoint.sh",
        "slurm/smddp.sbatch",
        "slurm/srun-agent",
    }


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_shellcheck(script: Path):
    # Every severity and every optional check but three that only restate style or `set -e`'s rules:
    # SC2250 (braces around every variable), SC2310 and SC2312 (set -e does not apply inside `f ||`
    # and process substitutions: the scripts check what those produce instead).
    out = run(
        [
            tool("shellcheck"),
            "--severity=style",
            "--enable=all",
            "--exclude=SC2250,SC2310,SC2312",
            "--external-sources",
            str(script),
        ]
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_shellcheck_is_the_pinned_version():
    out = run([tool("shellcheck"), "--version"])
    assert "version: 0.11.0" in out.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_scripts_are_executable_strict_bash(script: Path):
    assert script.stat().st_mode & 0o111, f"{script} is not executable"
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "\nset -euo pipefail\n" in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile: Path):
    # Every finding fails, down to style; the one rule ignored in the files (DL3008, pinning apt
    # package versions) says why there.
    out = run([tool("hadolint"), "--failure-threshold", "style", "--no-color", str(dockerfile)])
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_is_the_pinned_version():
    assert "2.15.1" in run([tool("hadolint"), "--version"]).stdout


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize(
    "dockerfile, base, extras",
    [
        ("Dockerfile.gpu", "nvidia/cuda:11.8.0-runtime-ubuntu22.04", "torch,cuda11"),
        ("Dockerfile.cpu", "python:3.11-slim-bookworm", "torch"),
    ],
)
def test_dockerfile_contents(dockerfile: str, base: str, extras: str):
    path = DEPLOY / "docker" / dockerfile
    ins = instructions(path)
    # Two stages on one base: the build (a compiler) and the image (none), which takes the build's
    # /opt/smddp (the virtual environment, and torch's C++ backend built there).
    assert [args for word, args in ins if word == "FROM"] == [f"{base} AS build", base]
    cut = ins.index(("FROM", base))
    build, image = ins[:cut], ins[cut:]
    build_runs = " ".join(args for word, args in build if word == "RUN")
    runs = " ".join(args for word, args in image if word == "RUN")
    assert f'pip install "/src[{extras}]" ninja==' in build_runs and "g++" in build_runs
    assert "smddp torch-backend --build" in build_runs
    assert ("COPY", "--from=build /opt/smddp /opt/smddp") in image
    assert not re.search(r"\b(g\+\+|gcc|clang|build-essential|pip install)\b", runs), runs
    assert "SMDDP_TORCH_BACKEND=native smddp torch-backend" in runs  # (fails the build without it)
    for stage in (build, image):
        envs = " ".join(args for word, args in stage if word == "ENV")
        assert "SMDDP_TORCH_BUILD_DIR=/opt/smddp/torch-backend" in envs
    assert "openssh-server" in runs and "openssh-client" in runs and "tini" in runs
    # No ssh host key is baked into the image: the entrypoint makes them at start.
    assert "rm -f /etc/ssh/ssh_host_*" in runs
    assert "ssh-keygen" not in runs
    assert ("ENTRYPOINT", '["/usr/bin/tini", "--", "/usr/local/bin/smddp-entrypoint"]') in ins
    # Everything copied exists, and the per-Dockerfile .dockerignore lets it into the build context.
    ignore = (path.parent / f"{dockerfile}.dockerignore").read_text()
    allowed = re.findall(r"^!(\S+?)/?$", ignore, re.M)
    copied = []
    for word, args in ins:
        if word == "COPY" and not args.startswith("--from="):
            srcs = [a for a in args.split() if not a.startswith("--")][:-1]
            copied += srcs
    assert "deploy/docker/entrypoint.sh" in copied
    for src in copied:
        assert (REPO / src).exists(), src
        assert any(src == a or src.startswith(a + "/") for a in allowed), (
            f"{src} is excluded by the .dockerignore"
        )
        assert not re.search(r"id_(rsa|ecdsa|ed25519)|\.pem$|\.key$", src), (
            f"a key copied into the image: {src}"
        )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_every_package(dockerfile: Path):
    """Every top-level package pyproject.toml installs is copied to /src before `pip install /src`."""
    # [tool.setuptools.packages.find] include = [...] (read with a pattern: tomllib needs Python 3.11).
    include = re.search(r"^include = \[(.*)\]", (REPO / "pyproject.toml").read_text(), re.M)
    assert include, "pyproject.toml: no packages.find include"
    patterns = {"include": re.findall(r'"([^"]+)"', include.group(1))}
    packages = {
        d.name
        for pattern in patterns["include"]
        for d in REPO.glob(pattern.rstrip("*") + "*")
        if d.is_dir() and (d / "__init__.py").exists()
    }
    copies = {args for word, args in instructions(dockerfile) if word == "COPY"}
    for package in packages:
        assert f"{package} /src/{package}" in copies, f"{dockerfile.name} does not copy {package}/"


@pytest.fixture(scope="module")
def sdist_top(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The files at the top of smddp's sdist that its build reads (not what the sdist build writes)."""
    out = tmp_path_factory.mktemp("sdist")
    argv = [sys.executable, "-m", "build", "--sdist", "-o", str(out), str(REPO)]
    made = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    (sdist,) = out.glob("smddp-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/")[1] for n in t.getnames() if n.count("/") == 1}
    return {n for n in names if n not in ("PKG-INFO", "setup.cfg") and not n.endswith(".egg-info")}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_builds_from_what_the_sdist_holds(dockerfile: Path, sdist_top: set[str]):
    """`pip install /src` builds the engine from the same files a user's install from the sdist does:
    every top-level file the sdist holds (setup.py, MANIFEST.in, ...) is copied to /src. (Without
    setup.py, setuptools built smddp from pyproject.toml alone: no engine in the image.)"""
    assert {"setup.py", "pyproject.toml"} <= sdist_top
    copied = set()
    for word, args in instructions(dockerfile):
        if word == "COPY" and args.split()[-1] == "/src/":
            copied |= set(args.split()[:-1])
    missing = sdist_top - copied - {"smddp", "smdistributed"}
    assert not missing, f"{dockerfile.name} does not copy {sorted(missing)} to /src"


def test_ssh_client_config_parses():
    ssh = tool("ssh", "install the OpenSSH client (apt-get install openssh-client)")
    out = run([ssh, "-G", "-F", str(DEPLOY / "docker/ssh_config"), "worker-0"])
    assert out.returncode == 0, out.stderr
    got = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert got["batchmode"] == "yes"
    assert got["connectionattempts"] == "10"
    assert got["userknownhostsfile"] == "/dev/null"


def test_sshd_config_allows_keys_only():
    lines = dict(
        line.split(None, 1)
        for line in (DEPLOY / "docker/sshd_config").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert lines["PasswordAuthentication"] == "no"
    assert lines["KbdInteractiveAuthentication"] == "no"
    assert lines["PermitRootLogin"] == "prohibit-password"
    assert lines["PermitUserEnvironment"] == "no"
    assert "/opt/smddp/venv/bin" in lines["SetEnv"].split()[0]
