"""The grad_weight filter's eps and rescue: what valid ones are, checked in one place for the call, the YAML and the
Geometry.

``grad_weight_filter=eps`` lets grad_weight (and grad_bias) skip the tiles of dL/dlogits in which every
per-token ``|softmax - onehot(target)|`` is below ``eps`` (the rule and its kernels:
:mod:`flce_policy.kernels.weight_grad_filter`). None is the dense path; 0 skips nothing, so it also runs
the dense path (a call's way to switch off a policy's filter).

``grad_weight_filter_rescue=N`` makes the filter unbiased: a tile it would skip is kept anyway with probability
``2**-L`` and its product counted ``2**L`` times (exact: a power of two), so grad_weight's expectation is the dense
one. ``L`` is the tile's level: how many octaves its largest per-token ``|softmax - onehot|`` lies below eps,
``ceil(log2(eps / max))``, at least 1 and at most ``log2(N)``. The tiles just under eps, which carry most of what
the filter drops, are kept most often (one in two at level 1), the emptiest at most one in N: less noise than one
in N throughout, for a few more tiles multiplied. Which tiles is a hash of the data, not of the position (a row
tile is the same sequence positions at every step): :data:`RESCUE_HASH` states it; the kernels compute it on the
device.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = [
    "ALL_KEPT_COST",
    "DENSE_LOOP_MIN_KEPT",
    "FILTER_COLS",
    "FILTER_REST_CALLS",
    "FILTER_ROWS",
    "FilterRest",
    "KEPT_FLAG",
    "MAX_RESCUE",
    "RESCUE_HASH",
    "check_rescue_has_filter",
    "checked_filter_eps",
    "checked_filter_rescue",
    "filter_scratch_bytes",
    "rescue_max_level",
]

#: Classes per skip decision: columns of dL/dlogits (rows of grad_weight) per flag.
FILTER_COLS = 128
#: Token rows per skip decision, counted from each row chunk's first row.
FILTER_ROWS = 32
#: A column block with more than this share of its row tiles kept runs the kernel's dense loop (every
#: tile, the skipped ones' loads masked off) rather than its listed loop (kept tiles only, but about
#: 1.8x slower per tile on the H200: the loop loads its row indices;
#: results/2026-12-01-h200-filter-kernel-probes/filter-probe-2.log).
DENSE_LOOP_MIN_KEPT = 0.5
#: Each launch of the filtered kernel (kernels.weight_grad_filter): its time over cuBLAS addmm's per kept share,
#: from 80-90% kept (H200, 32-row tiles). From a kept share of 1 / this on, a chunk's grad_weight runs cuBLAS's dense
#: GEMM instead (the flags and the lists are paid by then); the cost model caps its filtered term there too. Wide TMA
#: 1.05-1.20 at 1024-5376 hidden and 1152-16384 rows (taken as 1.10), narrow 1.06-1.08 at 896
#: (results/2026-12-03-h200-filter-tiles/all_kept_probe.log; it was 1.20 at 64-row tiles); the pointer launches
#: 1.10x (results/2026-12-01-h200-filter-kernel-probes/filter-probe-4.log, 64-row tiles).
ALL_KEPT_COST = {"tma": 1.10, "tma_narrow": 1.07, "pointer": 1.10}
#: After a call whose flags bought nothing (so many tiles kept, from ``1 / ALL_KEPT_COST`` of them on, that its
#: grad_weight ran the dense GEMM: early training, random logits), a policy runs this many filtered calls of the
#: same problem dense, without flags (:class:`FilterRest`). Such flags cost a one-chunk call 2.5-3.0% (H200,
#: 16384x1024x131072, results/2026-12-03-h200-trained-filters); averaged over a rest and the call that
#: flags, 1/17 of that. Logits that become skippable are filtered again at most this many calls later.
FILTER_REST_CALLS = 16
#: The largest ``grad_weight_filter_rescue``: one skipped tile in 65536 is as good as none.
MAX_RESCUE = 2**16
#: The CE finish kernel's flag byte per token row and FILTER_COLS classes where some column is kept; elsewhere
#: ``KEPT_FLAG - L``, ``L`` the columns' level (octaves below eps, 1 to KEPT_FLAG - 1), so the largest flag of a
#: tile's rows is its own flag.
KEPT_FLAG = 255
#: The rescue's hash (kernels.weight_grad_filter computes it; tests state it in torch). ``columns`` of x per
#: row (the first ones): each value as fp32 bits b, folded to ``(b >> 16) ^ (b & 0xFFFF)``, times the odd
#: weight ``2 * (row * columns + column) + 1``, summed over the row tile's FILTER_ROWS rows (rows past the
#: chunk read 0) and masked to 31 bits: h. Per column block c: ``z = (h ^ (c * block_mul & MASK)) & MASK``,
#: then ``rounds`` times ``z = ((z ^ (z >> 16)) * mixer) & MASK``; ``z ^ (z >> 16)`` with its low L
#: bits all 0 rescues a tile of level L (skipped ones only). Every intermediate fits int64.
RESCUE_HASH = dict(columns=2, block_mul=0x1E3779B1, mixer=0x45D9F3B, rounds=2, mask=0x7FFFFFFF)
#: A power of two as the docs write eps: ``2**-12``, ``2^-12``, ``2**-13.5``.
_POWER_OF_TWO = re.compile(r"\s*2\s*(?:\*\*|\^)\s*(-?\d+(?:\.\d+)?)\s*")


def checked_filter_eps(value: Any, name: str = "grad_weight_filter", *, text: bool = False) -> float | None:
    """``value`` as a float eps in ``[0, 1)``, or None; TypeError/ValueError naming ``name`` otherwise.

    ``text``: a string is read as a number (a YAML file: PyYAML reads ``1e-4``, without a dot, as a
    string), or as a power of two written ``2**-12`` / ``2^-12`` (a fractional power too: ``2**-13.5``). eps >= 1
    would skip every tile but the targets' (``|p - onehot|`` never exceeds 1): refused as a mistake.
    """
    if value is None:
        return None
    if text and isinstance(value, str):
        power = _POWER_OF_TWO.fullmatch(value)
        try:
            number = 2.0 ** float(power.group(1)) if power else float(value)
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


def checked_filter_rescue(value: Any, name: str = "grad_weight_filter_rescue", *, text: bool = False) -> int | None:
    """``value`` as the rescue's N (a power of two in ``[2, MAX_RESCUE]``) or None; TypeError/ValueError naming
    ``name`` otherwise. ``text``: a string (a YAML file's) is read as an integer first."""
    if value is None:
        return None
    if text and isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{name} must be a power of two in [2, {MAX_RESCUE}] or None, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (a power of two in [2, {MAX_RESCUE}]) or None, got {value!r}")
    if not 2 <= value <= MAX_RESCUE or value & (value - 1):
        raise ValueError(
            f"{name} must be a power of two in [2, {MAX_RESCUE}] (a skipped tile kept at least one in N, counted as "
            f"only for a power of two) or None, got {value}"
        )
    return value


def filter_scratch_bytes(rows: int, tile_cols: int) -> int:
    """Bytes of the filter's buffers for chunks of up to ``rows`` rows of a ``tile_cols``-column slab
    (:func:`flce_policy.kernels.weight_grad_filter.filter_scratch` allocates them): a flag byte per row and
    ``FILTER_COLS`` classes; per tile a state byte and a listed row tile (int32); per column block a count and the
    end of each rescue level (int32)."""
    col_blocks, row_tiles = -(-tile_cols // FILTER_COLS), -(-rows // FILTER_ROWS)
    return rows * col_blocks + col_blocks * row_tiles * (1 + 4) + col_blocks * 4 * (1 + rescue_max_level(MAX_RESCUE))


def rescue_max_level(rescue: int | None) -> int:
    """The largest level of rescue N (``log2(N)``; 0 without a rescue): its tiles are kept one in N."""
    return rescue.bit_length() - 1 if rescue else 0


def check_rescue_has_filter(eps: float | None, rescue: int | None, where: str = "") -> None:
    """ValueError when a rescue is set without a filter eps: there would be no skipped tile to rescue."""
    if rescue is not None and eps is None:
        raise ValueError(
            f"{where}grad_weight_filter_rescue={rescue} needs a grad_weight_filter eps (it rescues some of the tiles "
            "the filter skips); set grad_weight_filter too, or leave the rescue out"
        )


class FilterRest:
    """A policy's memory, per problem, of the filter's last flagged call (:meth:`FLCEPolicy.filter_rest_for`).

    After a call whose flags at eps sent its grad_weight to the dense GEMM (so many tiles kept that the kernel would
    be slower), the next :data:`FILTER_REST_CALLS` filtered calls at eps or less run the dense GEMMs without flags:
    their grad_weight is the unfiltered one, which is what such flags give. A call at a larger eps (which may skip
    where a smaller one kept nearly all) flags anyway.
    """

    __slots__ = ("_calls_left", "_eps")

    def __init__(self) -> None:
        self._calls_left = 0
        self._eps = 0.0

    def flags(self, eps: float) -> bool:
        """Whether a filtered call at ``eps`` computes its flags; one that does not is counted off the rest."""
        if self._calls_left and eps <= self._eps:
            self._calls_left -= 1
            return False
        return True

    def went_dense(self, eps: float) -> None:
        """A call's flags at ``eps`` sent its grad_weight to the dense GEMM: rest for the next
        :data:`FILTER_REST_CALLS` calls."""
        self._calls_left, self._eps = FILTER_REST_CALLS, eps

    def __repr__(self) -> str:
        return f"FilterRest(calls_left={self._calls_left}, eps={self._eps!r})"
