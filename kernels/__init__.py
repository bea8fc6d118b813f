"""Triton kernels and the chunk driver that runs a validated Geometry."""

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
#: decides when a kernel is defined, so every module defining one is imported right here, at once: all
#: follow this value, even when ``TRITON_INTERPRET`` changes later (flce_policy/loss.py then says so).
KERNELS_INTERPRETED: bool = interpreter_requested()

from . import ce_kernel, loss_total, safe_targets, scale  # noqa: E402, F401  (the modules defining Triton kernels)
