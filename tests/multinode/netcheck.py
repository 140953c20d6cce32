"""Small network probes between simulated nodes: a server on one node, a client on another."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from smddp_rigs.simcluster import SimCluster

PY = sys.executable

# TCP bulk: argv HOST PORT. Takes one connection, counts and hashes every byte, answers the digest.
RECEIVER = r"""
import hashlib, json, socket, sys, time
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
srv.settimeout(30)
conn, _ = srv.accept()
h, n = hashlib.sha256(), 0
while chunk := conn.recv(1 << 20):
    n += len(chunk)
    h.update(chunk)
conn.sendall(h.hexdigest().encode())
conn.close()
print(json.dumps({"bytes": n, "sha256": h.hexdigest()}))
"""

# TCP bulk: argv HOST PORT SIZE. Sends SIZE random bytes; timed until the receiver's digest is back.
SENDER = r"""
import hashlib, json, os, socket, sys, time
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
payload = os.urandom(size)
deadline = time.monotonic() + 20
while True:
    try:
        s = socket.create_connection((host, port), timeout=60)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
t0 = time.monotonic()
s.sendall(payload)
s.shutdown(socket.SHUT_WR)
ack = s.recv(100).decode()  # the receiver's digest: it has every byte
seconds = time.monotonic() - t0
print(json.dumps({"seconds": seconds, "sha256": hashlib.sha256(payload).hexdigest(), "ack": ack}))
"""

# UDP echo: argv HOST. Answers every datagram until "quit".
ECHO_SERVER = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 7700))
s.settimeout(30)
while True:
    data, peer = s.recvfrom(2048)
    if data == b"quit":
        break
    s.sendto(data, peer)
"""

# UDP echo: argv HOST N. Prints N round-trip times in ms (JSON), then tells the server to quit.
ECHO_CLIENT = r"""
import json, socket, sys, time
host, n = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(0.2)
rtts = []
deadline = time.monotonic() + 20
while len(rtts) < n and time.monotonic() < deadline:
    t0 = time.perf_counter()
    s.sendto(b"ping %d" % len(rtts), (host, 7700))
    try:
        data, _ = s.recvfrom(2048)
    except socket.timeout:
        continue  # the server was not up yet, or the first ARP exchange
    if data == b"ping %d" % len(rtts):
        rtts.append((time.perf_counter() - t0) * 1e3)
    time.sleep(0.002)
s.sendto(b"quit", (host, 7700))
print(json.dumps(rtts))
"""


def serve_and_call(
    c: SimCluster, server: tuple[int, list[str]], client: tuple[int, list[str]], timeout: float = 60
) -> tuple[Any, Any]:
    """Run a Python server script on one node and a client script on another; both must exit 0.

    Returns what each printed on stdout, parsed as JSON. The server is killed if the client failed.
    """
    (sn, sargs), (cn, cargs) = server, client
    srv = c.popen(sn, [PY, "-c", *sargs], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        res = c.exec(cn, [PY, "-c", *cargs], capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, res.stderr
        out, err = srv.communicate(timeout=30)
        assert srv.returncode == 0, err
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(timeout=10)
    return json.loads(res.stdout), json.loads(out) if out.strip() else None


def bulk_tcp(c: SimCluster, a: int, b: int, size: int, port: int = 7701) -> tuple[dict, dict]:
    """Send `size` bytes from node a to node b over TCP: (sender's report, receiver's report)."""
    return serve_and_call(
        c, (b, [RECEIVER, c.addr(b), str(port)]), (a, [SENDER, c.addr(b), str(port), str(size)])
    )
