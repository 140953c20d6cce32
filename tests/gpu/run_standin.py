"""Worker wrapper: run a torch test script on the stand-in device runtime, then record what the runtime did.

Usage: run_standin.py STATS_DIR SCRIPT [ARGS...]. The script runs unchanged; the wrapper only sets
SMDDP_DEVICE_RUNTIME=standin (every torch tensor then goes the device route) and afterwards writes
the runtime's copy and kernel counts, so the test can tell that the route was taken, and how many
all-reduces the GPU step took (node_reduce).
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def break_completion() -> None:
    """SMDDP_STANDIN_BREAK=future-without-tensors: complete each device Work's future with no value,
    as the backend did before issue 28 (torch then records no event, and readers race the copies),
    so that a test can see the stand-in catch that bug."""
    from smddp.torch.backend import SmddpWork

    complete = SmddpWork._complete

    def without_tensors(self: SmddpWork, error: BaseException | None, value: object = None) -> None:
        complete(self, error, None)

    SmddpWork._complete = without_tensors  # type: ignore[method-assign]


def main() -> int:
    stats_dir, script, *rest = sys.argv[1:]
    os.environ["SMDDP_DEVICE_RUNTIME"] = "standin"
    broken = os.environ.get("SMDDP_STANDIN_BREAK", "")
    if broken == "future-without-tensors":
        break_completion()
    elif broken:
        raise SystemExit(f"SMDDP_STANDIN_BREAK={broken!r}: expected future-without-tensors")
    os.environ.setdefault("SMDDP_STANDIN_DELAY_MS", "1")
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code: object = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    import smddp

    c = smddp.client()
    rt = c.device_runtime()
    step = c._node_step  # the GPU step (node_reduce), where the job's device all-reduces took it
    # How many device collectives of each kind the C++ backend ran on the engine's device route (None:
    # the Python backend's process).
    native_calls = None
    if "torch" in sys.modules:
        from smddp.torch import native

        if native.backend_kind() == "native":
            native_calls = native.module().device_calls()
    with open(os.path.join(stats_dir, f"stats{smddp.rank()}.json"), "w") as f:
        json.dump(
            {
                "runtime": rt.name,
                "stats": dict(rt.stats),
                "step_count": 0 if step is None else step.count,
                "node_reduce_why": c.node_reduce_why,
                "native_device_calls": native_calls,
            },
            f,
        )
    return int(code or 0) if isinstance(code, int) or code is None else 1


if __name__ == "__main__":
    sys.exit(main())
