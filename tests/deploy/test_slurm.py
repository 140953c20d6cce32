"""deploy/slurm/smddp.sbatch, run with bash inside a faked Slurm allocation (the SLURM_* variables an
sbatch job sees) in its dry mode: smddp-launch's Slurm detection must turn it into the expected
mpirun command, with the network chosen explicitly and nothing sensitive printed."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.deploy.helpers import BIN, DEPLOY, base_env, parse_mpirun, run

pytestmark = pytest.mark.deploy

SBATCH = DEPLOY / "slurm/smddp.sbatch"
AGENT = DEPLOY / "slurm/srun-agent"
VENV = BIN.parent


def sbatch(*command: str, path_prefix: Path | None = None, **env: str):
    e = base_env(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu[01-02]",
        SLURM_NTASKS_PER_NODE="8",
        SLURM_TASKS_PER_NODE="8(x2)",
        SLURM_SUBMIT_DIR="/home/alice/project",
        SMDDP_VENV=str(VENV),
        SMDDP_DRY_RUN="1",
    )
    e.update(env)
    if path_prefix:
        e["PATH"] = f"{path_prefix}:{e['PATH']}"
    return run(["bash", str(SBATCH), *command], {k: v for k, v in e.items() if v is not None})


def fake_network(tmp_path: Path) -> Path:
    """getent and ip stand-ins: gpu02 is 10.1.2.12, reached over ib0, which has 10.1.2.11/16."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "getent").write_text(
        textwrap.dedent("""\
        #!/bin/sh
        [ "$1 $2" = "ahostsv4 gpu02" ] || exit 2
        printf '10.1.2.12       STREAM gpu02\\n10.1.2.12       DGRAM  \\n'
        """)
    )
    (bin_ / "ip").write_text(
        textwrap.dedent("""\
        #!/bin/sh
        case "$*" in
        "-o -4 route get 10.1.2.12") echo "10.1.2.12 dev ib0 src 10.1.2.11 uid 0 \\    cache " ;;
        "-o -4 addr show dev ib0") echo "5: ib0    inet 10.1.2.11/16 brd 10.1.255.255 scope global ib0\\       valid_lft forever" ;;
        *) exit 1 ;;
        esac
        """)
    )
    for f in bin_.iterdir():
        f.chmod(0o755)
    return bin_


def test_two_nodes_eight_gpus_with_an_explicit_network():
    out = sbatch("python", "train.py", "--epochs", "3", SMDDP_IFACE="ib0")
    assert out.returncode == 0, out.stderr
    cmd = parse_mpirun(out.stdout.strip())
    assert (cmd.daemons.np, cmd.daemons.hosts) == (2, "gpu01:1,gpu02:1")
    assert (cmd.workers.np, cmd.workers.hosts) == (16, "gpu01:8,gpu02:8")
    assert cmd.daemons.argv[0] == str(VENV / "bin/smddp-daemon")
    assert cmd.daemons.argv[cmd.daemons.argv.index("--iface") + 1] == "ib0"
    assert cmd.prtemca("oob_tcp_if_include") == "ib0"
    assert "btl_tcp_if_include" in cmd.option("--mca")
    assert cmd.workers.argv[-4:] == ["python", "train.py", "--epochs", "3"]
    # PRRTE's own Slurm launcher (srun), its steps sharing the allocation with the job's.
    assert cmd.prtemca("plm_ssh_agent") is None and cmd.prtemca("plm") is None
    assert cmd.prtemca("plm_slurm_args") == "--overlap"
    assert "job 4242: 2 nodes (gpu01 gpu02), 8 workers per node" in out.stderr


def test_four_nodes_from_a_compressed_node_list():
    out = sbatch("python", "train.py", SLURM_JOB_NODELIST="dgx[07-08,10],dgx12", SMDDP_IFACE="10.1.0.0/16")
    assert out.returncode == 0, out.stderr
    cmd = parse_mpirun(out.stdout.strip())
    assert cmd.daemons.hosts == "dgx07:1,dgx08:1,dgx10:1,dgx12:1"
    assert (cmd.workers.np, cmd.workers.hosts) == (32, "dgx07:8,dgx08:8,dgx10:8,dgx12:8")
    assert cmd.prtemca("oob_tcp_if_include") == "10.1.0.0/16"


def test_the_default_network_is_the_one_that_reaches_the_next_node(tmp_path):
    out = sbatch("python", "train.py", path_prefix=fake_network(tmp_path))
    assert out.returncode == 0, out.stderr
    cmd = parse_mpirun(out.stdout.strip())
    # A CIDR, not ib0: interface names may differ between nodes, the network does not.
    assert cmd.daemons.argv[cmd.daemons.argv.index("--iface") + 1] == "10.1.0.0/16"
    assert cmd.prtemca("oob_tcp_if_include") == "10.1.0.0/16"
    assert "network for smddp: 10.1.0.0/16 (the route to gpu02" in out.stderr


def test_no_guess_when_the_network_cannot_be_told(tmp_path):
    out = sbatch("python", "train.py", SLURM_JOB_NODELIST="nowhere[1-2]", path_prefix=fake_network(tmp_path))
    assert out.returncode == 2
    assert "set SMDDP_IFACE" in out.stderr and out.stdout == ""


def test_one_node_needs_no_network():
    out = sbatch("python", "train.py", SLURM_JOB_NODELIST="gpu05", SLURM_NTASKS_PER_NODE="4")
    assert out.returncode == 0, out.stderr
    cmd = parse_mpirun(out.stdout.strip())
    assert (cmd.daemons.np, cmd.daemons.hosts, cmd.workers.np, cmd.workers.hosts) == (
        1,
        "gpu05:1",
        4,
        "gpu05:4",
    )
    assert "--iface" not in cmd.daemons.argv


def test_srun_as_the_launch_agent():
    out = sbatch(
        "python", "train.py", SMDDP_IFACE="ib0", SMDDP_LAUNCH_AGENT=str(AGENT), SMDDP_MPI_ARGS="--tag-output"
    )
    assert out.returncode == 0, out.stderr
    cmd = parse_mpirun(out.stdout.strip())
    assert cmd.prtemca("plm_ssh_agent") == str(AGENT)
    assert cmd.prtemca("plm") == "ssh"  # the agent is the ssh launcher's: chosen over the Slurm one
    assert cmd.prtemca("plm_ssh_no_tree_spawn") == "1"
    assert "--tag-output" in cmd.argv[: cmd.argv.index("-np")]


def test_more_launcher_options():
    out = sbatch("python", "train.py", SMDDP_IFACE="ib0", SMDDP_LAUNCH_ARGS="--threads 4  --fusion-mb 32")
    assert out.returncode == 0, out.stderr
    cmd = parse_mpirun(out.stdout.strip())
    assert "SMDDP_FUSION_MB=32" in cmd.option("-x")
    assert cmd.daemons.argv[cmd.daemons.argv.index("--threads") + 1] == "4"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SMDDP_IFACE": "--mpirun=/tmp/evil"}, "SMDDP_IFACE must be"),
        ({"SMDDP_IFACE": "ib0", "SMDDP_LAUNCH_AGENT": "srun-agent"}, "absolute path"),
        ({"SLURM_JOB_NODELIST": None}, "not inside a Slurm allocation"),
        ({"SLURM_NTASKS_PER_NODE": None}, "--ntasks-per-node"),
        ({"SMDDP_VENV": "/nonexistent"}, "SMDDP_VENV"),
    ],
)
def test_refuses_bad_settings(env, message):
    out = sbatch("python", "train.py", **env)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_needs_a_command():
    out = sbatch(SMDDP_IFACE="ib0")
    assert out.returncode == 2 and "usage" in out.stderr


def test_prints_nothing_from_the_environment():
    canary = "c4n4ry-5ecr3t-value"
    out = sbatch("python", "train.py", SMDDP_IFACE="ib0", AWS_SECRET_ACCESS_KEY=canary, HF_TOKEN=canary)
    assert out.returncode == 0
    assert canary not in out.stdout + out.stderr
    text = SBATCH.read_text()
    assert not re.search(r"^\s*set\s+-[a-z]*x", text, re.M), "set -x would print every command and its values"
    assert not re.search(r"^\s*(env|printenv|export -p)\b", text, re.M)


def test_the_header_asks_for_one_worker_per_gpu():
    directives = dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(\S+))?", SBATCH.read_text(), re.M))
    assert directives["ntasks-per-node"] == directives["gpus-per-node"]
    assert "exclusive" in directives
