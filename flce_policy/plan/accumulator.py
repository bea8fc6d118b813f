"""Where a vocab-tiled geometry keeps its fp32 grad_input accumulator: the one rule the driver,
the memory model and the cost model share.

Vocab tiles add into grad_input once per tile, so a row chunk needs an fp32 ``[chunk_size, H]``
accumulator. A separate buffer of that size (0.66 GiB at 32768 x 5376) would be the largest
thing the call holds beside the outputs, so the accumulator borrows bytes that are not yet
written:

- its first half of rows lives in the chunk's own grad_input rows (a bf16 row holds half an
  fp32 row), narrowed in place once the last tile has been added;
- with one row chunk and a weight gradient, the second half lives in the last rows of
  grad_weight. The vocab tiles over those rows (the "late" tiles) write their grad_weight only
  after the narrowing, so every late tile but the last computes its logits a third time.
  Borrowing is used only while the recomputed tiles are at most a quarter of the vocabulary;
  otherwise, and with several row chunks, the second half is a buffer of its own.

fp32 problems accumulate straight into grad_input; an odd H (no whole fp32 in a bf16 pair at
every row) falls back to one separate buffer of the whole accumulator.
"""

from __future__ import annotations

from typing import NamedTuple

from flce_policy.plan.geometry import Geometry

__all__ = ["AccumulatorLayout", "accumulator_layout", "narrow_step_rows"]

_FP32 = 4
#: Bytes of the bounce buffer used per step when narrowing the accumulator in place.
_NARROW_STEP_BYTES = 8 * 2**20
#: Borrow grad_weight rows only while the recomputed late tiles stay this small a part of V.
_MAX_RECOMPUTED_FRACTION = 0.25


class AccumulatorLayout(NamedTuple):
    """Rows of one row chunk's fp32 grad_input accumulator, by where they live."""

    in_grad_input: int  # rows kept in the chunk's own grad_input bytes
    separate: int  # rows in a buffer of their own ([separate, H] fp32)
    in_grad_weight: int  # rows kept in the last grad_weight rows
    borrowed_weight_rows: int  # grad_weight rows (at the end of V) those occupy
    late_tiles: int  # vocab tiles over the borrowed rows; grad_weight written after narrowing

    @property
    def recomputed_tiles(self) -> int:
        """Late tiles whose logits are computed a third time (the last one is still in the slab)."""
        return max(self.late_tiles - 1, 0)

    def separate_bytes(self, hidden: int) -> int:
        return self.separate * hidden * _FP32


_NONE = AccumulatorLayout(0, 0, 0, 0, 0)


def accumulator_layout(geometry: Geometry, *, input_grad: bool = True, weight_grad: bool = True) -> AccumulatorLayout:
    """The layout the vocab-tiled driver uses for ``geometry``'s (full) row chunks."""
    p = geometry.problem
    if geometry.is_row_only or not input_grad or p.itemsize == _FP32:
        return _NONE
    rows = geometry.chunk_size
    if p.itemsize * 2 != _FP32 or p.hidden % 2:
        return AccumulatorLayout(0, rows, 0, 0, 0)
    head = rows // 2
    tail = rows - head
    borrowed = tail * _FP32 // p.itemsize
    if geometry.writes_weight_grad_once and weight_grad and borrowed < p.vocab:
        late_tiles = geometry.num_vocab_chunks - (p.vocab - borrowed) // geometry.vocab_chunk
        if (late_tiles - 1) * geometry.vocab_chunk <= _MAX_RECOMPUTED_FRACTION * p.vocab:
            return AccumulatorLayout(head, 0, tail, borrowed, late_tiles)
    return AccumulatorLayout(head, tail, 0, 0, 0)


def narrow_step_rows(hidden: int, itemsize: int) -> int:
    """Rows narrowed per step (through a bounce buffer of that many output rows)."""
    return max(1, _NARROW_STEP_BYTES // (hidden * itemsize))
