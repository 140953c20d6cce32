"""A child's life tied to its parent's (Linux PR_SET_PDEATHSIG); standard library only, loadable by path."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def signal_on_parent_death(sig: int = signal.SIGKILL, exit_if_orphaned: bool = False) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; False where it cannot (not Linux).

    With `exit_if_orphaned`, a process whose parent already died before the request took effect
    (it was adopted by init) exits at once instead of running on unwatched.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return False
    if exit_if_orphaned and os.getppid() == 1:
        os._exit(1)
    return True
