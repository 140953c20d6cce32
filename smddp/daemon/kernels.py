"""What the daemon's reduction kernels are on this CPU (the kernels themselves are the engine's: reduce.h)."""

from __future__ import annotations

from smddp import _engine


def engine_kernels() -> str:
    """What reduces what in the daemon (the engine's kernels), as `smddp status` shows it."""
    f16 = "compiled (F16C)" if _engine.has_f16c() else "compiled (no F16C: one element at a time)"
    return f"float16: {f16}, bfloat16: compiled, other types: compiled"
