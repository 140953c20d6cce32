"""Strangers at the door: bad connections are refused and logged while the job's results stay exact."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from smddp.daemon.node import MAX_HANDSHAKES
from smddp.proto.frames import HEADER_SIZE, Header, MsgType, Role
from smddp.proto.handshake import hello
from tests.conftest import BIN, REPO, job_env

pytestmark = pytest.mark.faults

WORKER = str(Path(__file__).parent / "steady_worker.py")
HANDSHAKE_TIMEOUT_S = 10.0  # DaemonConfig.handshake_timeout_s


def start_job(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [str(BIN / "smddp-launch"), "-np", "4", "--local-nodes", "2", *extra]
    cmd += ["--", sys.executable, WORKER, "--out", str(out)]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=job_env()
    )


def endpoints(proc: subprocess.Popen, out: Path) -> dict:
    deadline = time.monotonic() + 60
    while not (out / "endpoints.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "job did not start"
        time.sleep(0.05)
    return json.loads((out / "endpoints.json").read_text())


def stop_job(proc: subprocess.Popen, out: Path) -> str:
    (out / "stop").touch()
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output[-3000:]
    for r in range(4):
        rec = json.loads((out / f"rank{r}.json").read_text())
        assert rec["wrong"] == 0 and rec["done"] > 0, (r, rec)
    return output


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the daemon hung up on us (EOF, or an ERROR frame then EOF) within `seconds`."""
    sock.settimeout(seconds)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def attacks(family: int, address: object, job_id: bytes) -> dict[str, bool]:
    """Each kind of bad connection; True where the daemon refused it in time."""

    def dial() -> socket.socket:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.connect(address)  # type: ignore[arg-type]
        return s

    def challenge(s: socket.socket) -> bytes:
        data = b""
        while len(data) < HEADER_SIZE + 48:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        return data

    results: dict[str, bool] = {}
    s = dial()  # garbage instead of a HELLO
    challenge(s)
    s.sendall(os.urandom(200))
    results["garbage"] = closed_within(s, 5)
    s.close()

    s = dial()  # a header announcing a huge body
    challenge(s)
    s.sendall(Header(MsgType.HELLO, length=60_000).encode())
    results["huge length"] = closed_within(s, 5)
    s.close()

    s = dial()  # a well-formed HELLO with the wrong secret
    data = challenge(s)
    nonce = data[HEADER_SIZE + 16 : HEADER_SIZE + 48]
    s.sendall(
        hello(
            b"\0" * 32,
            job_id,
            Role.DAEMON if family == socket.AF_INET else Role.WORKER,
            0,
            nonce,
            os.urandom(32),
        )
    )
    results["wrong secret"] = closed_within(s, 5)
    s.close()

    s = dial()  # another job's id
    data = challenge(s)
    s.sendall(hello(os.urandom(32), os.urandom(16), Role.WORKER, 0, data[HEADER_SIZE + 16 :], os.urandom(32)))
    results["wrong job"] = closed_within(s, 5)
    s.close()

    # A flood of connections that say nothing, beyond the number of handshakes served at once.
    flood = []
    for _ in range(100):
        try:
            flood.append(dial())
        except OSError:
            break
    time.sleep(0.5)
    # At most MAX_HANDSHAKES are served at once; the rest are closed at once (a few may slip in as
    # earlier handshakes finish).
    refused = sum(closed_within(f, 0.05) for f in flood)
    results["flood refused at the door"] = refused >= len(flood) - MAX_HANDSHAKES - 10
    for f in flood:
        f.close()
    return results


def slow_stranger(family: int, address: object, verdict: dict[str, bool]) -> None:
    """Says nothing (or trickles) past the handshake timeout: must be cut off, not waited for."""
    s = socket.socket(family, socket.SOCK_STREAM)
    s.connect(address)  # type: ignore[arg-type]
    t0 = time.monotonic()
    try:
        s.settimeout(0.5)
        while time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S + 5:
            try:
                s.send(b"\x00")  # one byte every half second
            except OSError:
                break
            try:
                if s.recv(65536) == b"":
                    break
            except TimeoutError:
                pass
            except OSError:
                break
        verdict[f"trickler cut off ({family.name})"] = time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S + 3
    finally:
        s.close()


def test_strangers_are_refused_and_results_stay_exact(tmp_path, clean_host):
    proc = start_job(tmp_path)
    try:
        info = endpoints(proc, tmp_path)
        job_id = bytes.fromhex(info["job_id"])
        verdict: dict[str, bool] = {}
        slow = []
        for ep in info["endpoints"]:
            for family, addr in ((socket.AF_INET, tuple(ep["tcp"])), (socket.AF_UNIX, ep["unix"])):
                t = threading.Thread(target=slow_stranger, args=(family, addr, verdict))
                t.start()
                slow.append(t)
                for name, ok in attacks(family, addr, job_id).items():
                    verdict[f"{name} ({family.name}, node {ep['node']})"] = ok
        for t in slow:
            t.join()
        # Another user cannot even reach the unix socket: its directory is 0700.
        probe = "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])"
        other = subprocess.run(
            ["/usr/bin/python3", "-c", probe, info["endpoints"][0]["unix"]],
            user="nobody",
            capture_output=True,
            text=True,
            timeout=30,
        )
        verdict["other uid kept out"] = other.returncode != 0 and "Permission denied" in other.stderr
    finally:
        output = stop_job(proc, tmp_path)
    bad = [k for k, ok in verdict.items() if not ok]
    assert not bad, bad
    assert "refused connection" in output  # each refusal is logged by the daemon


def test_secret_never_in_argv_environment_or_logs(tmp_path, clean_host):
    cmd = [str(BIN / "smddp-launch"), "-np", "4", "--local-nodes", "2", "--log-level", "DEBUG"]
    cmd += ["--", sys.executable, WORKER, "--out", str(tmp_path), "--secret-file"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=job_env()
    )
    try:
        info = endpoints(proc, tmp_path)
        secret_hex = info["secret"]
        secret = bytes.fromhex(secret_hex)
        exposed = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            for part in ("cmdline", "environ"):
                try:
                    data = Path(f"/proc/{pid}/{part}").read_bytes()
                except OSError:
                    continue
                if secret in data or secret_hex.encode() in data or secret_hex.upper().encode() in data:
                    exposed.append(f"/proc/{pid}/{part}")
    finally:
        output = stop_job(proc, tmp_path)
    assert not exposed, exposed
    assert secret_hex not in output.lower()
    assert "DEBUG" in output or "INFO" in output  # the logs were verbose, and still clean
