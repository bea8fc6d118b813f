"""The CE kernels' per-row partials: what the partial pass fills, a vocab shard merges across ranks
(:mod:`flce_policy.kernels.vocab_shard`) and the finish pass reads (:mod:`flce_policy.kernels.ce_kernel`).

Its own module, below both, so that the kernel and the shard need not import each other.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["CEWorkspace"]


class CEWorkspace(NamedTuple):
    """Per-call scratch for the row partials, allocated once for the largest chunk."""

    block_v: int
    segments_per_tile: int
    segment_len: int  # columns per segment, a multiple of block_v
    slots: int  # partial slots per row: segments_per_tile (or scaled-exp column tiles) padded to a power of two
    #: [planes (ce_kernel._PARTIALS, +1 with entropy), rows, slots] fp32; z_y at slot 0 only. A row-scaled chunk's
    #: GEMM writes each plane slot-major instead (slot s of row r at ``s * rows + r``; no ``m``: the row's shift)
    partials: torch.Tensor
    best_index: torch.Tensor  # [rows, slots] int32 (slot-major as the planes in a row-scaled chunk)
    #: 0: the slab holds logits, a partial pass fills the slots. Else the slab holds exp(z - m) per column tile of
    #: this width, one slot per tile, filled by the logits GEMM (flce_policy.kernels.scaled_exp).
    scaled_exp_tile: int = 0
    #: With a scaled-exp slab: each row's coefficient of the target's one-hot term, which the finish kernel leaves
    #: out of the slab's gradient ([rows] fp32, 0 where ignored; flce_policy.kernels.target_grad applies it).
    target_coef: torch.Tensor | None = None
    #: With a scaled-exp slab, for its row-scaled form (:mod:`flce_policy.kernels.scaled_exp`): each row's shift
    #: (its target logit, +inf where ignored; [rows] fp32), its gradient's scale ``f`` (the gradient is
    #: ``f * slab`` minus the target's term; [rows] fp32), and the chunk's redo flag ([1] int32, 1 when a row's
    #: logits lie too far above its target's for the shifted exponentials: the chunk is redone per column tile).
    row_shift: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None
    redo: torch.Tensor | None = None
