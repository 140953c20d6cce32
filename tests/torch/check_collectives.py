"""Worker script: every torch.distributed collective on backend "smddp", checked against exact expectations."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import smddp
import smddp.torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]


def refused(fn: Any, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except smddp.torch.UnsupportedCollectiveError as e:
        return str(e)
    return "NOT REFUSED"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = {
        k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    }
    dist.init_process_group(backend="smddp")  # the one line: everything else comes from smddp-launch
    r, w = dist.get_rank(), dist.get_world_size()
    checks: dict[str, bool] = {}
    out: dict[str, Any] = {
        "env": env,
        "rank": r,
        "world": w,
        "smddp": [smddp.rank(), smddp.size(), smddp.local_rank(), smddp.local_size()],
        "backend": dist.get_backend(),
        "checks": checks,
    }
    for dt in DTYPES:
        name = str(dt).removeprefix("torch.")
        # SUM of (rank + 1): small integers, exact in every dtype.
        t = torch.full((1000,), r + 1, dtype=dt)
        dist.all_reduce(t)
        checks[f"sum_{name}"] = bool((t == w * (w + 1) // 2).all())
        t = torch.full((7,), r + 1, dtype=dt)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        checks[f"max_{name}"] = bool((t == w).all())
        t = torch.full((7,), r + 1, dtype=dt)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        checks[f"min_{name}"] = bool((t == 1).all())
        t = torch.arange(6, dtype=dt) if r == w - 1 else torch.zeros(6, dtype=dt)
        dist.broadcast(t, src=w - 1)
        checks[f"broadcast_{name}"] = bool((t == torch.arange(6, dtype=dt)).all())
        outs = [torch.zeros(3, dtype=dt) for _ in range(w)]
        dist.all_gather(outs, torch.full((3,), r, dtype=dt))
        checks[f"all_gather_{name}"] = all(bool((o == i).all()) for i, o in enumerate(outs))
    t = torch.full((4,), float(2 * r + 2))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    checks["avg"] = bool((t == float(w + 1)).all())
    # A blocking all-reduce (asyncOp false, as dist.all_reduce passes it) of one tensor runs whole in
    # the call and returns no Work (torch's all_reduce then waits for none), on the host and on the
    # device route alike (there the caller's stream is ordered after the copy back); several host
    # tensors get a Work complete when returned, with a completed future; an asynchronous one's Work
    # is in flight. (Under the stand-in device runtime these tensors are device memory: several of
    # them get a Work in flight.)
    device_route = os.environ.get("SMDDP_DEVICE_RUNTIME", "auto") not in ("auto", "cupy")
    pg = dist.distributed_c10d._get_default_group()
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    # The C++ backend (smddp.torch.backend_kind() "native") answers every call with a Work of torch's
    # own type: one complete at return where the call was blocking.
    native = smddp.torch.backend_kind() == "native"  # (also where it hands every call to the Python group)
    out["backend_kind"] = smddp.torch.backend_kind()
    t = torch.full((5,), float(r + 1))
    work = pg.allreduce([t], opts)
    at_return = work.is_completed() if native else work is None
    checks["blocking_done_at_return"] = at_return and bool((t == w * (w + 1) // 2).all())
    two = [torch.full((5,), float(r + 1)), torch.full((3,), float(r + 2))]
    work = pg.allreduce(two, opts)
    kind = "Work" if native else "SmddpWork" if device_route else "_DoneWork"
    done = type(work).__name__ == kind and (device_route or work.is_completed()) and work.wait()
    total = w * (w + 1) // 2
    checks["blocking_done_at_return_two"] = done and bool(
        (two[0] == total).all() and (two[1] == total + w).all()
    )
    checks["blocking_future"] = bool((work.get_future().wait()[1] == total + w).all())
    opts.asyncOp = True
    work = pg.allreduce([torch.ones(5)], opts)
    checks["async_is_a_work_in_flight"] = (
        type(work).__name__ == ("Work" if native else "SmddpWork") and work.wait()
    )
    # Non-contiguous tensors are reduced through a copy and written back.
    m = torch.ones(4, 6)
    col = m[:, 1]
    dist.all_reduce(col)
    checks["non_contiguous"] = bool((m[:, 1] == w).all()) and bool((m[:, 0] == 1).all())
    # A parameter that requires grad (DLPack refuses those; the backend detaches).
    p = torch.nn.Parameter(torch.full((3,), float(r)))
    dist.broadcast(p, src=0)
    checks["requires_grad"] = bool((p.detach() == 0).all())
    o = torch.zeros(2 * w)
    dist.all_gather_into_tensor(o, torch.full((2,), float(r)))
    checks["all_gather_into_tensor"] = o.tolist() == [float(i // 2) for i in range(2 * w)]
    o = torch.zeros(2)
    dist.reduce_scatter_tensor(o, torch.arange(2.0 * w))
    checks["reduce_scatter_tensor"] = o.tolist() == [float(w * (2 * r)), float(w * (2 * r + 1))]
    o = torch.zeros(2)
    dist.reduce_scatter(o, [torch.full((2,), float(i + r)) for i in range(w)])
    checks["reduce_scatter"] = o.tolist() == [float(w * r + w * (w - 1) // 2)] * 2
    t = torch.full((3,), float(r + 1))
    dist.reduce(t, dst=0)
    checks["reduce"] = t.tolist() == ([float(w * (w + 1) // 2)] * 3 if r == 0 else [float(r + 1)] * 3)
    g = [torch.zeros(2) for _ in range(w)] if r == 0 else None
    dist.gather(torch.full((2,), float(r)), g, dst=0)
    checks["gather"] = r != 0 or [x.tolist() for x in g or []] == [[float(i)] * 2 for i in range(w)]
    s = torch.zeros(2)
    dist.scatter(s, [torch.full((2,), float(i)) for i in range(w)] if r == 0 else None, src=0)
    checks["scatter"] = s.tolist() == [float(r)] * 2
    dist.barrier()
    # async_op=True: several in flight, waited in reverse order.
    ts = [torch.full((100,), float(i + r)) for i in range(8)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for wk in reversed(works):
        wk.wait()
    checks["async_in_flight"] = all(bool((t == w * i + w * (w - 1) / 2).all()) for i, t in enumerate(ts))
    checks["async_completed"] = all(wk.is_completed() and wk.is_success() for wk in works)
    # One contiguous host tensor, blocking or not (DDP's buckets are these): the engine takes it by its
    # address, with no numpy view of it made (the backend's _HOST.buf, here counted).
    host = smddp.torch.backend._HOST
    views: list[Any] = []
    host.buf = lambda t: views.append(t) or type(host).buf(host, t)  # type: ignore[method-assign]
    try:
        ta = torch.full((300,), float(r + 1))
        tb = torch.full((5,), r + 1, dtype=torch.int64)
        tc = torch.full((9,), float(r))
        wa = dist.all_reduce(ta, async_op=True)
        dist.all_reduce(tb)
        fc = dist.all_reduce(tc, async_op=True).get_future()
        sums = wa.wait() and fc.wait()[0] is tc
    finally:
        del host.buf
    checks["one_tensor_by_address"] = (
        sums
        and ta.tolist() == [float(w * (w + 1) // 2)] * 300
        and tb.tolist() == [w * (w + 1) // 2] * 5
        and tc.tolist() == [float(w * (w - 1) // 2)] * 9
        and (device_route or views == [])
    )
    fut = dist.all_reduce(torch.ones(3), async_op=True).get_future()
    checks["future_value"] = fut.wait()[0].tolist() == [float(w)] * 3
    # A host Work is completed where it is consumed: by its waiter, else (once polled, asked for its
    # future or dropped) on its own. Each way must land the result.
    t3 = torch.ones(3)
    wk = dist.all_reduce(t3, async_op=True)
    waited = wk.wait() and wk.is_completed() and t3.tolist() == [float(w)] * 3
    checks["future_after_wait"] = waited and wk.get_future().wait()[0].tolist() == [float(w)] * 3
    t3 = torch.ones(3)
    wk = dist.all_reduce(t3, async_op=True)
    deadline = time.monotonic() + 60
    while not wk.is_completed() and time.monotonic() < deadline:  # polled, never waited
        time.sleep(0.001)
    checks["polled"] = wk.is_completed() and wk.is_success() and t3.tolist() == [float(w)] * 3
    dropped = torch.ones(3)
    dist.all_reduce(dropped, async_op=True)  # its Work dropped at once: the result still lands
    deadline = time.monotonic() + 60
    while dropped.tolist() != [float(w)] * 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    checks["dropped_lands"] = dropped.tolist() == [float(w)] * 3
    m2 = torch.ones(4, 6)
    wk = dist.all_reduce(m2[:, 2], async_op=True)  # a copy written back by whoever completes it
    fut = wk.get_future()
    checks["non_contiguous_future"] = (
        fut.wait()[0].tolist() == [float(w)] * 4 and m2[:, 2].tolist() == [float(w)] * 4
    )
    m2 = torch.ones(4, 6)
    wk = dist.all_reduce(m2[:, 3], async_op=True)
    checks["non_contiguous_wait"] = wk.wait() and m2[:, 3].tolist() == [float(w)] * 4
    # The *_object helpers.
    objs: list[Any] = [None] * w
    dist.all_gather_object(objs, {"rank": r, "s": "x" * r})
    checks["all_gather_object"] = objs == [{"rank": i, "s": "x" * i} for i in range(w)]
    lst: list[Any] = [f"from {r}", r] if r == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    checks["broadcast_object_list"] = lst == ["from 0", 0]
    got: list[Any] = [None]
    dist.scatter_object_list(got, [i * 10 for i in range(w)] if r == 0 else None, src=0)
    checks["scatter_object_list"] = got == [r * 10]
    gl: list[Any] | None = [None] * w if r == 0 else None
    dist.gather_object(("g", r), gl, dst=0)
    checks["gather_object"] = r != 0 or gl == [("g", i) for i in range(w)]
    # What smddp does not run itself goes to the group's side group (gloo here), with the values
    # those calls must give; the job goes on below on smddp itself.
    routed: dict[str, bool] = {}
    x8 = torch.full((2,), r + 1, dtype=torch.int8)
    dist.all_reduce(x8)
    routed["int8"] = x8.tolist() == [w * (w + 1) // 2] * 2
    xb = torch.tensor([r == 0, True, False])
    dist.all_reduce(xb)  # SUM of bools is a logical or
    routed["bool"] = xb.tolist() == [True, True, False]
    xp = torch.full((3,), float(r + 1))
    dist.all_reduce(xp, op=dist.ReduceOp.PRODUCT)
    routed["product"] = xp.tolist() == [float(math.factorial(w))] * 3
    # A coalesced all-reduce is one all-reduce per tensor on every path: with an op the side group runs
    # (it once got the product of every element of every tensor), with or without a group argument,
    # through the group's own allreduce of several tensors, and with an op smddp runs.
    want = [math.prod(2.0 * i + 1 for i in range(w)), math.prod(2.0 * i + 2 for i in range(w))]
    for how in ("group", "default", "pg.allreduce"):
        pc = [torch.tensor([2.0 * r + 1]), torch.tensor([2.0 * r + 2])]
        if how == "pg.allreduce":
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.PRODUCT
            work = dist.group.WORLD.allreduce(pc, opts)
            if work is not None:
                work.wait()
        else:
            dist.all_reduce_coalesced(pc, dist.ReduceOp.PRODUCT, dist.group.WORLD if how == "group" else None)
        routed[f"coalesced_product_{how}"] = [t.item() for t in pc] == want
    sc = [torch.tensor([2.0 * r + 1]), torch.tensor([2.0 * r + 2, 1.0])]
    dist.all_reduce_coalesced(sc, dist.ReduceOp.SUM)
    checks["coalesced_sum"] = [t.tolist() for t in sc] == [[float(w * w)], [float(w * (w + 1)), float(w)]]
    xa = torch.tensor([r | 8, 15], dtype=torch.int32)
    dist.all_reduce(xa, op=dist.ReduceOp.BAND)
    routed["band"] = xa.tolist() == [functools.reduce(lambda a, b: a & b, [i | 8 for i in range(w)]), 15]
    a2a = torch.empty(w)
    dist.all_to_all_single(a2a, torch.arange(w, dtype=torch.float32) + 10 * r)
    routed["all_to_all_single"] = a2a.tolist() == [float(r + 10 * i) for i in range(w)]
    lists = [torch.empty(1) for _ in range(w)]
    dist.all_to_all(lists, [torch.tensor([float(100 * r + i)]) for i in range(w)])
    routed["all_to_all"] = [t.item() for t in lists] == [float(100 * i + r) for i in range(w)]
    if r % 2 == 0:
        dist.send(torch.tensor([r + 0.5]), dst=r + 1)
        routed["send_recv"] = True
    else:
        got_p2p = torch.empty(1)
        dist.recv(got_p2p, src=r - 1)
        routed["send_recv"] = got_p2p.item() == r - 0.5
    pair = dist.new_group([0, 1])  # a subgroup: every call of it goes to its side group
    if r < 2:
        xs = torch.full((2,), float(r + 1))
        dist.all_reduce(xs, group=pair)
        routed["subgroup"] = xs.tolist() == [3.0, 3.0] and dist.get_backend(pair) == "smddp"
    else:
        routed["subgroup"] = True
    out["routed"] = routed
    dist.barrier()  # every rank has routed (and recorded) its calls
    if r == 0:
        st = subprocess.run(
            [
                sys.executable,
                "-m",
                "smddp.launcher.cli",
                "status",
                "--job",
                os.environ["SMDDP_JOB_ID"],
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        out["status"] = st.stdout
    t = torch.ones(5)
    dist.all_reduce(t)
    checks["after_routed"] = bool((t == w).all())
    dist.destroy_process_group()
    with open(os.path.join(args.out, f"rank{r}.json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
