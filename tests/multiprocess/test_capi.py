"""The engine's C function table (smddp/engine/capi.h) driven from C in real smddp-launch jobs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import smddp_launch

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).parent
OK, PENDING, FAILED, INVALID, CLOSED = 0, 1, 2, 3, 4


@pytest.mark.parametrize(("world", "nodes"), [(2, 1), (4, 2)], ids=["W2-N1", "W4-N2"])
def test_every_collective_through_the_c_table(
    world: int, nodes: int, tmp_path: Path, clean_host: None
) -> None:
    """Every dtype, op and kind of the host tests, started from C through the table and completed by
    wait(), by the done callback alone (the client's DONE thread, no Python), or by both at once:
    the same bits as the independent reference on every rank (across nodes, the pieces cut as the
    Python calls cut them). A wait that times out says PENDING and a later one completes it; 200 in
    flight complete by their callbacks alone; six bad arguments are refused before anything is sent and
    the job goes on; a mismatch fails every rank's work with the error (class and text) the Python
    calls raise, and the table refuses everything after it."""
    # Pieces of 256 KiB across nodes: the 1 MiB cases go in several, each its own SUBMIT.
    args = [str(HERE / "check_capi.py"), "--out", str(tmp_path), "--nnodes", str(nodes)]
    proc = smddp_launch(world, nodes, args, extra=["--pipeline-kb", "256"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, d in enumerate(runs):
        version, size, rank, w = d["info"]
        assert (version, rank, w) == (1, r, world) and size >= 72
        recs = d["records"]
        assert len(recs) > 150
        bad = [rec for rec in recs if rec["status"] != OK or not rec["ok"]]
        assert not bad, f"rank {r}: {len(bad)} wrong, first: {bad[:2]}"
        assert {rec["mode"] for rec in recs} == {0, 1, 2}
        assert d["late"] == {"first": PENDING if r == 0 else OK, "status": OK, "ok": True}
        if r == 0:  # (abandoned: failed with the front end's error; the late result never written)
            assert d["abandon"] == {
                "first": FAILED,
                "status": FAILED,
                "why": "capi_probe gave up",
                "class": "CollectiveTimeoutError",
                "ok": False,
                "untouched": True,
            }, d["abandon"]
        else:
            assert d["abandon"]["status"] == OK and d["abandon"]["ok"], d["abandon"]
        assert d["many"] == {"statuses": [OK], "ok": True}
        ref = d["refused"]
        assert ref["dtype"] == [INVALID, "all-reduce: no dtype 99"]
        assert ref["op"][0] == INVALID and "no reduction op 9" in ref["op"][1]
        assert ref["uneven"][0] == INVALID and "cannot be split evenly" in ref["uneven"][1]
        assert ref["root"][0] == INVALID and "out of range" in ref["root"][1]
        assert ref["no_dst"][0] == INVALID and "missing" in ref["no_dst"][1]
        assert ref["barrier_dtype"] == [INVALID, "barrier: its dtype is uint8 (1), not 6"]
        assert d["after"] == [OK, [world * (world + 1) / 2] * 4]
        m = d["mismatch"]
        # Every rank names both sides, as the Python calls' error does, word for word.
        assert m["status"] == FAILED and m["class"] == "CollectiveMismatchError", m
        assert "count=5" in m["why"] and "count=6" in m["why"], m
        assert m["python_class"] == m["class"] and m["python"] == m["why"], m
        assert m["closed"] == [CLOSED, m["why"]]
        # Nothing was written into the buffer after the failure.
        assert m["bad"] == [1.0] * (6 if r == 0 else 5)
    # The same results on every rank.
    for i in range(len(runs[0]["records"])):
        recs = [d["records"][i] for d in runs]
        if recs[0]["case"]["kind"] != "reduce_scatter":
            assert len({rec["digest"] for rec in recs}) == 1


@pytest.mark.parametrize(("world", "nodes"), [(2, 1), (4, 2)], ids=["W2-N1", "W4-N2"])
def test_device_collectives_through_the_c_table(
    world: int, nodes: int, tmp_path: Path, clean_host: None
) -> None:
    """Device collectives started from C (start_device) on the stand-in runtime, whose copies land
    late: in line on the caller's stream, on the engine's lanes ordered onto another stream
    (device_order), and on the lanes completed by the done callback alone (device_query polled).
    All-reduces of every dtype, in place and into another buffer, whole and (across nodes) in
    pieces; broadcasts from the first and the last rank (whose other ranks copy nothing in),
    all-gathers and reduce-scatters (whose results are W inputs and 1/W of the reduction). Each result, read once
    the reader is ordered after its copy back, is the independent reference's bits; read at completion
    alone it is not (the copy back is enqueued, not landed), which is why the ordering calls exist.
    Bad arguments and a capturing stream are refused before anything is enqueued, and a mismatch
    fails every rank's work with the Python calls' error, writing nothing into its buffer."""
    args = [str(HERE / "check_capi_device.py"), "--out", str(tmp_path), "--nnodes", str(nodes)]
    proc = smddp_launch(world, nodes, args, extra=["--pipeline-kb", "256"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, d in enumerate(runs):
        assert d["before"][0] == INVALID and "device path is not started" in d["before"][1], d["before"]
        recs = d["records"]
        bad = [rec for rec in recs if rec["status"] != OK or not rec["ok"] or rec["last"] != OK]
        assert not bad, f"rank {r}: {len(bad)} wrong, first: {bad[:2]}"
        assert {rec["way"] for rec in recs} == {"in_line", "order", "callback"}
        assert {rec["in_place"] for rec in recs} == {True, False}
        assert {rec["case"]["kind"] for rec in recs} == {
            "allreduce",
            "broadcast",
            "allgather",
            "reduce_scatter",
        }
        assert any(rec["pieces"] for rec in recs) == (nodes > 1)
        assert all(rec["order"] == (OK if rec["way"] == "order" else -1) for rec in recs), recs
        # Completion is not landing: a reader that waited for completion alone read stale data, in
        # every way (the stand-in's copies land 20 ms late, the engine's lanes' too), so the checks
        # above can fail; an empty one has no copy in flight.
        # (Under ThreadSanitizer the worker reads nothing early: that read is a race on purpose.)
        if "TSAN_OPTIONS" not in os.environ:
            stale = [rec for rec in recs if rec["case"]["count"] > 0 and rec["early"] is False]
            assert {rec["way"] for rec in stale} == {"in_line", "order", "callback"}, recs
            assert any(rec["first"] == PENDING for rec in stale), recs
        assert all(rec["first"] == OK for rec in recs if rec["case"]["count"] == 0), recs
        ref = d["refused"]
        assert ref["dtype"] == [INVALID, "all-reduce: no dtype 99"]
        assert ref["device"][0] == INVALID and "device -1" in ref["device"][1]
        assert ref["capture"][0] == INVALID and "capturing a CUDA graph" in ref["capture"][1]
        if nodes > 1:
            assert (
                ref["in_line_pieces"][0] == INVALID and "in line is for one piece" in ref["in_line_pieces"][1]
            )
        m = d["mismatch"]
        assert m["status"] == FAILED and m["class"] == "CollectiveMismatchError", m
        assert "count=5" in m["why"] and "count=6" in m["why"], m
        assert m["last"] == OK and m["bad"] == [1.0] * (6 if r == 0 else 5), m
    for i in range(len(runs[0]["records"])):
        if runs[0]["records"][i]["case"]["kind"] != "reduce_scatter":  # (each rank's block differs)
            assert len({d["records"][i]["digest"] for d in runs}) == 1
