"""The chaos soak's report: a soak whose training ended before every kind of fault came says so."""

from __future__ import annotations

from typing import Any

from smddp_rigs.chaos import FAULTS, markdown


def _report(kinds: list[str]) -> dict[str, Any]:
    return {
        "config": {
            "seed": 1,
            "steps": 100,
            "ckpt_every": 10,
            "nodes": 4,
            "max_restarts": 9,
            "heartbeat_s": 3.0,
            "gap_s": [40.0, 80.0],
            "seconds": 600.0,
        },
        "reference": {"status": 0, "seconds": 10.0},
        "soak": {"status": 0, "seconds": 20.0, "attempts": len(kinds) + 1, "restarts": len(kinds)},
        "faults": [
            {
                "kind": k,
                "node": 0,
                "at_s": 5.0,
                "target": "",
                "failed_s": 6.0,
                "resumed_s": 9.0,
                "resumed_step": 50,
            }
            for k in kinds
        ],
        "restart_lines": [],
        "worlds": [4],
        "leftovers": [],
        "equal": {"tensors": 4, "differing": []},
        "missed": [k for k in FAULTS if k not in kinds],
    }


def test_every_kind_came() -> None:
    text = markdown(_report(list(FAULTS)))
    assert "- Every kind of fault came at least once." in text and "Not every" not in text


def test_a_soak_that_ended_first_names_the_kinds_that_did_not_come() -> None:
    text = markdown(_report(["kill-rank", "lose-node"]))
    said = "**Not every kind of fault came** (the training ended first; raise --steps): "
    assert said + "kill-daemon, freeze-daemon, cut-link." in text, text
