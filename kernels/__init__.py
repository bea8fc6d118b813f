"""Triton kernels and the chunk driver that runs a validated Geometry.

May import: :mod:`flce_policy.plan` (the Geometry it runs, the accumulator layout, the OOM settings); never
the engine, the strategies, the loss or anything above it. The driver decides nothing: it runs what it is given.
"""

from __future__ import annotations

if __name__ == "kernels":  # imported from the repository root: yield to an installed `kernels` (docs/layout.md)
    from flce_policy.top_level_names import hand_over

    hand_over(__name__, __path__[0])
else:
    # Every module defining a Triton kernel, imported here at once: all follow KERNELS_INTERPRETED, read once
    # (flce_policy.kernels.interpreter says why).
    from . import ce_kernel, loss_total, rounding, safe_targets, scale, scaled_exp, target_grad, weight_grad_filter  # noqa: F401
    from .interpreter import KERNELS_INTERPRETED, interpreter_requested

__all__ = ["KERNELS_INTERPRETED", "interpreter_requested"]
