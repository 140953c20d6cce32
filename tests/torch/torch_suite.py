"""torch's own distributed test suite (DistributedTest._DistTestBase) against smddp or gloo: `python -m tests.torch.torch_suite`."""

# torch ships the suite in its wheel and runs it upstream as test/distributed/test_distributed_spawn.py:
# each test spawns WORLD_SIZE processes that join with init_process_group(file://, rank, world_size),
# no launcher. The suite decides what to run by the backend's name (BACKEND: gates such as
# `BACKEND != "gloo"`, and DistTestCases' feature sets), which says nothing of smddp; so with
# --backend smddp the suite is told "gloo" while every group it makes is an smddp group (the one
# place torch makes a group, _new_process_group_helper, is handed "smddp" for "gloo"). smddp then
# meets every test gloo meets; what only gloo can pass (it is named, or gloo's own behaviour is
# tested) is listed with its reason in tests/torch/test_torch_suite.py and docs/torch.md.
# The spawned processes import this module again (the class is pickled by name), so the patch and
# the environment below are set at import, in them too.

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import unittest
from typing import Any

SUITE_BACKEND = os.environ.setdefault("SMDDP_SUITE_BACKEND", "smddp")
os.environ["BACKEND"] = "gloo"  # what the suite's gates see (above)
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", "/tmp")  # read at import by the suite; each test makes its own

import torch  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402

if SUITE_BACKEND == "smddp":
    import smddp.torch  # noqa: F401  # registers the backend, in every spawned process

    _helper = c10d._new_process_group_helper

    def _smddp_helper(
        group_size: int, group_rank: int, ranks: Any, backend: Any, *args: Any, **kw: Any
    ) -> Any:
        if str(backend) == "gloo":
            backend = "smddp"
        return _helper(group_size, group_rank, ranks, backend, *args, **kw)

    c10d._new_process_group_helper = _smddp_helper  # type: ignore[assignment]
elif SUITE_BACKEND != "gloo":
    raise SystemExit(f"SMDDP_SUITE_BACKEND={SUITE_BACKEND!r}: smddp or gloo")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def _spawn_processes(self) -> None:
        # Started as upstream's are, but from a fork server that has imported torch and the suite once:
        # a spawned process spends some 3 s of this 2-core host importing them, for every test. The
        # server's environment is the first test's; each process takes this test's, as a spawned one would.
        self._start_processes(_WithEnviron(dict(os.environ)))

    def tearDown(self) -> None:
        super().tearDown()
        # Upstream leaves each test's store file (MultiProcessTestCase's NamedTemporaryFile) in the
        # temporary directory: its processes are ended by now, so it goes.
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.file_name)


def _run_with_environ(environ: dict[str, str], target: Any, args: Any, kwargs: Any) -> None:
    os.environ.update(environ)
    target(*args, **kwargs)


class _WithEnviron:
    """A Process factory of the fork server's whose processes run with `environ`."""

    def __init__(self, environ: dict[str, str]) -> None:
        self.environ = environ

    def __call__(self, target: Any, name: str, args: Any, kwargs: Any) -> Any:
        ctx = torch.multiprocessing.get_context("forkserver")
        return ctx.Process(target=_run_with_environ, name=name, args=(self.environ, target, args, kwargs))


class _Outcomes(unittest.TextTestResult):
    """Each test's outcome, by name: pass, skip (with why), fail or error (with the traceback's tail)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.outcomes: dict[str, dict[str, Any]] = {}
        self._t0 = 0.0

    def _put(self, test: Any, outcome: str, why: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        self.outcomes[name] = {
            "outcome": outcome,
            "why": why[-2000:],
            "s": round(time.monotonic() - self._t0, 2),
        }

    def startTest(self, test: Any) -> None:
        self._t0 = time.monotonic()
        super().startTest(test)

    def addSuccess(self, test: Any) -> None:
        super().addSuccess(test)
        self._put(test, "pass")

    def addSkip(self, test: Any, reason: str) -> None:
        super().addSkip(test, reason)
        self._put(test, "skip", reason)

    def addFailure(self, test: Any, err: Any) -> None:
        super().addFailure(test, err)
        self._put(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test: Any, err: Any) -> None:
        super().addError(test, err)
        self._put(test, "error", self._exc_info_to_string(err, test))

    def addExpectedFailure(self, test: Any, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._put(test, "pass")

    def addUnexpectedSuccess(self, test: Any) -> None:
        super().addUnexpectedSuccess(test)
        self._put(test, "fail", "unexpected success")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="where to write each test's outcome (JSON)")
    p.add_argument(
        "-k", action="append", default=[], help="run only tests whose name holds this (repeatable)"
    )
    args = p.parse_args(argv)
    torch.multiprocessing.set_forkserver_preload([__spec__.name if __spec__ else __name__])
    names = unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn)
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=1, resultclass=_Outcomes)
    t0 = time.monotonic()
    result: Any = runner.run(suite)
    report = {
        "backend": SUITE_BACKEND,
        "world_size": int(os.environ["WORLD_SIZE"]),
        "torch": torch.__version__,
        "seconds": round(time.monotonic() - t0, 1),
        "tests": result.outcomes,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
