"""Worker script: the stand-in driver's interprocess events, as two processes see them.

Role `record` makes an interprocess event and records it on a stream held by a kernel (or failed by
one, --fail); role `wait` opens the event from its handle and makes a stream of its own wait for it.
The waiting stream's next event must not be reached while the recording stream is held, and must be
reached once it is let go (or fail with the recorder's error). The two meet through files in --dir.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

from smddp_rigs.standin import driver_path

NOT_READY = 600


class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def load() -> ctypes.CDLL:
    lib = ctypes.CDLL(driver_path())
    vp, c = ctypes.c_void_p, ctypes
    for name, args in {
        "cuInit": [c.c_uint],
        "cuDevicePrimaryCtxRetain": [c.POINTER(vp), c.c_int],
        "cuCtxSetCurrent": [vp],
        "cuStreamCreate": [c.POINTER(vp), c.c_uint],
        "cuEventCreate": [c.POINTER(vp), c.c_uint],
        "cuEventRecord": [vp, vp],
        "cuEventQuery": [vp],
        "cuStreamWaitEvent": [vp, vp, c.c_uint],
        "cuIpcGetEventHandle": [c.POINTER(Handle), vp],
        "cuIpcOpenEventHandle": [c.POINTER(vp), Handle],
        "smddp_standin_fail": [vp, c.c_int],
    }.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, c.c_int
    lib.smddp_standin_hold.argtypes, lib.smddp_standin_hold.restype = [vp, c.c_int64], c.c_uint64
    lib.smddp_standin_release.argtypes, lib.smddp_standin_release.restype = [c.c_uint64], c.c_int
    ok(lib.cuInit(0), "cuInit")
    ctx = vp()
    ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "retain")
    ok(lib.cuCtxSetCurrent(ctx), "set current")
    return lib


def ok(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what}: CUDA error {code}")


def wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never came")
        time.sleep(0.005)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["record", "wait"])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--fail", action="store_true")
    args = ap.parse_args()
    lib = load()
    vp = ctypes.c_void_p
    stream = vp()
    ok(lib.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
    if args.role == "record":
        ev = vp()
        # Interprocess without DISABLE_TIMING is refused, as CUDA refuses it.
        assert lib.cuEventCreate(ctypes.byref(ev), 0x4) == 1
        ok(lib.cuEventCreate(ctypes.byref(ev), 0x6), "cuEventCreate")
        hold = lib.smddp_standin_hold(stream, 20000)
        if args.fail:
            ok(lib.smddp_standin_fail(stream, 700), "fail")
        ok(lib.cuEventRecord(ev, stream), "cuEventRecord")
        h = Handle()
        ok(lib.cuIpcGetEventHandle(ctypes.byref(h), ev), "cuIpcGetEventHandle")
        (args.dir / "handle.tmp").write_bytes(ctypes.string_at(ctypes.addressof(h), 64))
        (args.dir / "handle.tmp").rename(args.dir / "handle")
        wait_for(args.dir / "waiting")
        time.sleep(0.05)  # the waiter looks again: still held
        (args.dir / "release").write_text("")
        lib.smddp_standin_release(hold)
        wait_for(args.dir / "seen")
        return 0
    wait_for(args.dir / "handle")
    h = Handle()
    ctypes.memmove(ctypes.byref(h), (args.dir / "handle").read_bytes(), 64)
    opened = vp()
    ok(lib.cuIpcOpenEventHandle(ctypes.byref(opened), h), "cuIpcOpenEventHandle")
    after = vp()
    ok(lib.cuEventCreate(ctypes.byref(after), 0x2), "cuEventCreate")
    ok(lib.cuStreamWaitEvent(stream, opened, 0), "cuStreamWaitEvent")
    ok(lib.cuEventRecord(after, stream), "cuEventRecord")
    assert lib.cuEventQuery(opened) == NOT_READY
    (args.dir / "waiting").write_text("")
    while not (args.dir / "release").exists():
        assert lib.cuEventQuery(after) == NOT_READY, "the wait let its stream go while the recorder was held"
        time.sleep(0.002)
    deadline = time.monotonic() + 30
    while (got := lib.cuEventQuery(after)) == NOT_READY and time.monotonic() < deadline:
        time.sleep(0.002)
    (args.dir / "seen").write_text("")
    want = 700 if args.fail else 0
    assert got == want, f"after the recorder let go: {got}, wanted {want}"
    assert lib.cuEventQuery(opened) == want
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
