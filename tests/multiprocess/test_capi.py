"""The engine's C function table (smddp/engine/capi.h) driven from C in real smddp-launch jobs."""

from __future__ import annotations

import json
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
