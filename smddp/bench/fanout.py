"""Run several commands at once as one (`smddp-bench ddp --launcher torchrun` on simulated nodes: one torchrun per node)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

#: After the first command fails, how long the others get to end by themselves before SIGTERM.
GRACE_S = 20.0


def main(argv: list[str] | None = None) -> int:
    """`python -m smddp.bench.fanout '[["cmd", ...], ...]'`: exit 0 if every command does, else the first failure's status."""
    args = sys.argv[1:] if argv is None else argv
    commands = json.loads(args[0])
    procs = [subprocess.Popen(c) for c in commands]
    status = 0
    failed_at = None
    while any(p.poll() is None for p in procs):
        for p in procs:
            code = p.poll()
            if code and not status:
                status, failed_at = code, time.monotonic()
        if failed_at is not None and time.monotonic() > failed_at + GRACE_S:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            break
        time.sleep(0.05)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.returncode and not status:
            status = p.returncode
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    raise SystemExit(main())
