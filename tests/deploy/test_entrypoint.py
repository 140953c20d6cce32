"""deploy/docker/entrypoint.sh and deploy/slurm/srun-agent, run on this machine: their dry modes print
what they would exec, and the parts that can run here (waiting for a host, exec, srun's arguments)
run for real against stand-ins."""

from __future__ import annotations

import shlex
import socket
import textwrap
from pathlib import Path

import pytest

from tests.deploy.helpers import BIN, DEPLOY, base_env, parse_mpirun, run

pytestmark = pytest.mark.deploy

ENTRYPOINT = DEPLOY / "docker/entrypoint.sh"
AGENT = DEPLOY / "slurm/srun-agent"


def keys(tmp_path: Path, mode: int = 0o600) -> Path:
    """An ssh directory as the MPI Operator mounts it (fake key contents: only the modes matter)."""
    d = tmp_path / "ssh"
    d.mkdir(parents=True)
    for name, m in (("id_rsa", mode), ("id_rsa.pub", 0o644), ("authorized_keys", 0o644)):
        (d / name).write_text("not a real key\n")
        (d / name).chmod(m)
    return d


def entrypoint(*args: str, dry: bool = True, **env: str):
    e = base_env(SMDDP_ENTRYPOINT_DRY_RUN="1" if dry else "0")
    e.update(env)
    return run([str(ENTRYPOINT), *args], e)


def exec_line(out) -> list[str]:
    """The command the entrypoint would exec (dry mode's last line on stdout)."""
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("exec "), out.stdout
    return shlex.split(line)[1:]


def test_sshd_mode(tmp_path):
    out = entrypoint("sshd", SMDDP_SSH_DIR=str(keys(tmp_path)))
    assert exec_line(out) == ["/usr/sbin/sshd", "-D", "-e", "-p", "22"]
    assert "would run: mkdir -p -m 0755 /run/sshd" in out.stderr
    assert "warning" not in out.stderr


def test_sshd_on_another_port(tmp_path):
    out = entrypoint("sshd", SMDDP_SSH_DIR=str(keys(tmp_path)), SMDDP_SSH_PORT="2222", SMDDP_SSHD="/opt/sshd")
    assert exec_line(out) == ["/opt/sshd", "-D", "-e", "-p", "2222"]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604], ids=oct)
def test_refuses_a_private_key_others_can_read(tmp_path, mode):
    for cmd in (["sshd"], ["launch", "--", "true"]):
        out = entrypoint(*cmd, SMDDP_SSH_DIR=str(keys(tmp_path / cmd[0], mode)), SMDDP_IFACE="auto")
        assert out.returncode == 2
        assert f"has mode {mode:o}" in out.stderr and "0600" in out.stderr


def test_warns_without_keys(tmp_path):
    out = entrypoint("sshd", SMDDP_SSH_DIR=str(tmp_path))
    assert out.returncode == 0
    assert "no private key" in out.stderr and "authorized_keys" in out.stderr


def test_launch_mode_with_a_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# made by the operator\nw-0.j.ns.svc slots=4\nw-1.j.ns.svc slots=4 max_slots=4\n")
    out = entrypoint(
        "launch", "--threads", "4", "--", "python", "train.py", "--lr", "0.1",
        SMDDP_HOSTFILE=str(hostfile), SMDDP_SSH_DIR=str(keys(tmp_path)),
    )  # fmt: skip
    assert exec_line(out) == [
        "smddp-launch", "--hostfile", str(hostfile), "--iface", "eth0",
        "--threads", "4", "--", "python", "train.py", "--lr", "0.1",
    ]  # fmt: skip
    assert "would wait up to 300s for ssh on w-0.j.ns.svc:22" in out.stderr
    assert "would wait up to 300s for ssh on w-1.j.ns.svc:22" in out.stderr


@pytest.mark.parametrize(
    "iface, expected", [("auto", []), ("ib0", ["--iface", "ib0"]), ("10.0.0.0/8", ["--iface", "10.0.0.0/8"])]
)
def test_launch_mode_network(tmp_path, iface, expected):
    out = entrypoint("launch", "-H", "a:2,b:2", "--", "true", SMDDP_IFACE=iface, SMDDP_SSH_DIR=str(tmp_path))
    assert exec_line(out) == ["smddp-launch", *expected, "-H", "a:2,b:2", "--", "true"]


@pytest.mark.parametrize("iface", ["--mpirun=/tmp/x", "eth0 --dry-run", "$(id)"])
def test_launch_mode_refuses_a_strange_network(tmp_path, iface):
    out = entrypoint("launch", "--", "true", SMDDP_IFACE=iface, SMDDP_SSH_DIR=str(tmp_path))
    assert out.returncode == 2 and "SMDDP_IFACE must be" in out.stderr


def test_launch_mode_really_runs_smddp_launch(tmp_path):
    """Not dry: the entrypoint execs the real smddp-launch, whose own --dry-run prints mpirun."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    out = entrypoint(
        "launch", "--dry-run", "--", "python", "train.py", dry=False,
        SMDDP_HOSTFILE=str(hostfile), SMDDP_WAIT_FOR_HOSTS_S="0", SMDDP_IFACE="eth1",
        SMDDP_SSH_DIR=str(keys(tmp_path)), SMDDP_LAUNCH=str(BIN / "smddp-launch"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    cmd = parse_mpirun(out.stdout.strip())
    assert (cmd.daemons.hosts, cmd.workers.np, cmd.workers.hosts) == (
        "node-a:1,node-b:1",
        4,
        "node-a:2,node-b:2",
    )
    assert cmd.prtemca("oob_tcp_if_include") == "eth1"


def test_launch_mode_waits_for_sshd(tmp_path):
    """Not dry: the wait really connects; with the port listening it goes on to exec."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("127.0.0.1 slots=1\n")
        out = entrypoint(
            "launch", "--", "python", "train.py", dry=False,
            SMDDP_HOSTFILE=str(hostfile), SMDDP_SSH_PORT=str(port), SMDDP_WAIT_FOR_HOSTS_S="10",
            SMDDP_SSH_DIR=str(keys(tmp_path)), SMDDP_LAUNCH="echo",
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["--hostfile", str(hostfile), "--iface", "eth0", "--", "python", "train.py"]


def test_launch_mode_gives_up_on_a_host_that_never_answers(tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\n")
    out = entrypoint(
        "launch", "--", "true", dry=False,
        SMDDP_HOSTFILE=str(hostfile), SMDDP_SSH_PORT=str(port), SMDDP_WAIT_FOR_HOSTS_S="1",
        SMDDP_SSH_DIR=str(keys(tmp_path)), SMDDP_LAUNCH="echo",
    )  # fmt: skip
    assert out.returncode == 2
    assert f"ssh on 127.0.0.1:{port} not reachable after 1s" in out.stderr
    assert out.stdout == ""


def test_other_commands_are_execd_as_they_are(tmp_path):
    assert exec_line(entrypoint("bash", "-c", "echo 'a b'")) == ["bash", "-c", "echo 'a b'"]
    out = entrypoint("sh", "-c", 'echo "$0"', "ran", dry=False)
    assert (out.returncode, out.stdout) == (0, "ran\n")


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([], {}, "usage"),
        (["launch"], {"SMDDP_IFACE": "auto"}, "usage"),
        (["sshd"], {"SMDDP_SSH_PORT": "22; id"}, "SMDDP_SSH_PORT"),
        (["launch", "--", "true"], {"SMDDP_HOSTFILE": "/nonexistent"}, "cannot read hostfile"),
        (["launch", "--", "true"], {"SMDDP_WAIT_FOR_HOSTS_S": "soon"}, "SMDDP_WAIT_FOR_HOSTS_S"),
        (["true"], {"SMDDP_ENTRYPOINT_DRY_RUN": "yes"}, "must be 0 or 1"),
    ],
)
def test_refuses_bad_settings(tmp_path, args, env, message):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("h slots=1\n")
    env = {"SMDDP_SSH_DIR": str(tmp_path), "SMDDP_HOSTFILE": str(hostfile), **env}
    out = entrypoint(*args, **env)
    assert out.returncode == 2 and message in out.stderr, out.stderr


# -- srun-agent ---------------------------------------------------------------------------------


def agent(*args: str, **env: str):
    e = base_env(SLURM_JOB_ID="77")
    e.update(env)
    return run([str(AGENT), *args], {k: v for k, v in e.items() if v is not None})


def test_agent_reads_ssh_options_as_ssh_does():
    # How PRRTE's ssh launcher calls its agent: options, the host, then the remote command's words.
    out = agent(
        "-x",
        "-o",
        "ConnectTimeout=5",
        "-p22",
        "-l",
        "root",
        "gpu02",
        "PATH=/v/bin:$PATH",
        ";",
        "prted",
        "--x",
        "a b",
        SMDDP_AGENT_DRY_RUN="1",
    )
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout)
    assert argv[:2] == ["exec", "srun"]
    assert "--jobid=77" in argv and "--nodelist=gpu02" in argv and "--overlap" in argv
    assert argv[-3:] == ["/bin/sh", "-c", "PATH=/v/bin:$PATH ; prted --x a b"]


def test_agent_runs_srun_with_the_joined_command(tmp_path):
    """Not dry: a stand-in srun runs the command string with sh, as srun would on the node."""
    srun = tmp_path / "srun"
    srun.write_text(
        textwrap.dedent("""\
        #!/bin/sh
        for a in "$@"; do case "$a" in --*) printf '%s\\n' "$a" ;; esac; done > "$0.args"
        while [ "$1" != /bin/sh ]; do shift; done
        exec "$@"
        """)
    )
    srun.chmod(0o755)
    out = agent("user@gpu07", "echo", "started on", "$SLURM_JOB_ID", SMDDP_SRUN=str(srun))
    assert (out.returncode, out.stdout) == (0, "started on 77\n"), out.stderr
    assert "--nodelist=gpu07" in (tmp_path / "srun.args").read_text().split()


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([], {}, "usage"),
        (["-p", "22"], {}, "usage"),
        (["gpu02"], {}, "interactive login"),
        (["gpu02", "true"], {"SLURM_JOB_ID": None}, "not inside a Slurm allocation"),
    ],
)
def test_agent_refuses(args, env, message):
    out = agent(*args, SMDDP_AGENT_DRY_RUN="1", **env)
    assert out.returncode == 255 and message in out.stderr
