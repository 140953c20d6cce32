"""The torch tests' fixtures: the C++ backend built once before any job, and a test run on each backend."""

from __future__ import annotations

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    # The C++ backend is built on first use, once a node (smddp.torch.native): build it here, once,
    # so that no job's time limit pays for a compile. Where it cannot be built, jobs that ask for it
    # fail naming why (a test that needs it never skips).
    try:
        import smddp.torch.native as native
    except ImportError:  # (no torch: the torch tests skip or fail on their own)
        return
    try:
        native.module()
    except Exception:
        pass


@pytest.fixture(params=["native", "python"])
def torch_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The job's workers use this backend (SMDDP_TORCH_BACKEND): the C++ one, or the Python fallback."""
    monkeypatch.setenv("SMDDP_TORCH_BACKEND", request.param)
    return str(request.param)
