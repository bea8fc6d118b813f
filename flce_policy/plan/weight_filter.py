"""The grad_weight filter's eps: what a valid one is, checked in one place for the call, the YAML and the Geometry.

``grad_weight_filter=eps`` lets grad_weight (and grad_bias) skip the tiles of dL/dlogits in which every
per-token ``|softmax - onehot(target)|`` is below ``eps`` (the rule and its kernels:
:mod:`flce_policy.kernels.weight_grad_filter`). None is the dense path; 0 skips nothing, so it also runs
the dense path (a call's way to switch off a policy's filter).
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["DENSE_LOOP_MIN_KEPT", "FILTER_COLS", "FILTER_ROWS", "checked_filter_eps"]

#: Classes per skip decision: columns of dL/dlogits (rows of grad_weight) per flag.
FILTER_COLS = 128
#: Token rows per skip decision, counted from each row chunk's first row.
FILTER_ROWS = 64
#: A column block with more than this share of its row tiles kept runs the kernel's dense loop (every
#: tile, the skipped ones' loads masked off) rather than its listed loop (kept tiles only, but about
#: 1.8x slower per tile on the H200: the loop loads its row indices; results/notes/2026-12-01-h200-filter-probe-2.log).
DENSE_LOOP_MIN_KEPT = 0.5
#: A power of two as the docs write eps: ``2**-12`` or ``2^-12``.
_POWER_OF_TWO = re.compile(r"\s*2\s*(?:\*\*|\^)\s*(-?\d+)\s*")


def checked_filter_eps(value: Any, name: str = "grad_weight_filter", *, text: bool = False) -> float | None:
    """``value`` as a float eps in ``[0, 1)``, or None; TypeError/ValueError naming ``name`` otherwise.

    ``text``: a string is read as a number (a YAML file: PyYAML reads ``1e-4``, without a dot, as a
    string), or as a power of two written ``2**-12`` / ``2^-12``. eps >= 1 would skip every tile but the
    targets' (``|p - onehot|`` never exceeds 1): refused as a mistake.
    """
    if value is None:
        return None
    if text and isinstance(value, str):
        power = _POWER_OF_TWO.fullmatch(value)
        try:
            number = 2.0 ** int(power.group(1)) if power else float(value)
        except (ValueError, OverflowError):
            raise ValueError(f"{name} must be a number in [0, 1) (or 2**-k) or None, got {value!r}") from None
        if power and number == 0.0:  # past a double's range: not the 0 that switches the filter off
            raise ValueError(f"{name}: {value!r} is below the smallest double, not a usable eps")
        value = number
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in [0, 1) or None, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or not 0.0 <= value < 1.0:
        raise ValueError(
            f"{name} must be a finite number in [0, 1) (eps on |softmax - onehot|, e.g. 2**-12) or None, got {value!r}"
        )
    return float(value)
