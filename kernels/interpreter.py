"""Whether the kernels run under Triton's CPU interpreter: decided once, before any kernel is defined.

Below every kernel module (each reads :data:`KERNELS_INTERPRETED`); :mod:`flce_policy.kernels` imports
them all right after it, at once.
"""

from __future__ import annotations

import os

import triton

__all__ = ["KERNELS_INTERPRETED", "interpreter_requested"]


def interpreter_requested() -> bool:
    """Whether Triton would define a kernel for its CPU interpreter now (``TRITON_INTERPRET``, read as Triton does)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: Whether the kernels run under Triton's interpreter (CPU tensors) or are compiled (CUDA tensors). Triton
#: decides when a kernel is defined, so flce_policy.kernels imports every module defining one right after
#: this, at once: all follow this value, even when ``TRITON_INTERPRET`` changes later
#: (flce_policy/call/resolve.py then says so).
KERNELS_INTERPRETED: bool = interpreter_requested()
