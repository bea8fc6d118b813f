"""One launch before the chunks: safe targets, a bad-row flag, the mean's denominators and the gradient scales.

A row is bad when its index is outside ``[0, V)`` and not ``ignore_index``; its safe target is
``ignore_index``, so no kernel indexes outside the vocabulary. One program walks all the targets
(microseconds at 10^5 rows, every sum in a fixed order) and writes ``meta`` (fp32):

    [bad (0 or 1), mass, count, scale_ce, scale_z, poison]

``mass`` is the class-weight mass of the kept rows (their count without class weights), ``count``
the kept rows; both are taken as 1 only when no row is kept (an all-ignored mean is 0, not NaN). A mass
that is 0, negative or NaN while rows are kept is used as it is, as ``F.cross_entropy`` divides by it
(negative class weights are legal there; a NaN weight makes the loss and gradients NaN); ``scale_ce, scale_z`` are
what dL/dlogits is multiplied by: ``1/mass, 1/count`` for ``mean``, ``1, 1`` for ``sum``. With
``poison`` (where no host may read the flag: CUDA-graph capture) a bad row makes ``poison`` NaN and
both scales NaN, so every gradient is NaN and the loss, which adds ``poison``, is NaN; otherwise
``poison`` is 0. This one launch replaces a zeroed flag, the range check, the nine elementwise ops
and reductions of the denominators and scales, and the poison's four, on the path of every call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "COUNT_AT", "GRAD_SCALES", "MASS_AT", "META_BAD", "META_POISON", "META_SIZE", "POISON_AT", "empty_meta",
    "prepare_targets_",
]  # fmt: skip

META_SIZE = 6
#: ``meta``'s layout: the position of each value (see above).
META_BAD, META_MASS, META_COUNT, META_SCALE_CE, META_SCALE_Z, META_POISON = range(META_SIZE)
#: ``[scale_ce, scale_z]``, adjacent: the CE kernel reads a two-element slice of ``meta`` (ce, then z-loss).
GRAD_SCALES = slice(META_SCALE_CE, META_SCALE_Z + 1)
# The positions as the kernels read them (a Triton kernel reads a global only as a constexpr).
BAD_AT, MASS_AT, COUNT_AT, SCALE_CE_AT, SCALE_Z_AT, POISON_AT = (
    tl.constexpr(i) for i in (META_BAD, META_MASS, META_COUNT, META_SCALE_CE, META_SCALE_Z, META_POISON)
)
_BLOCK = 1024


@triton.jit
def _prepare_targets_kernel(
    target_ptr, safe_ptr, class_weight_ptr, meta_ptr, n, vocab, ignore_index,
    HAS_WEIGHT: tl.constexpr, MEAN: tl.constexpr, POISON: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    mass = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_range = offs < n
        t = tl.load(target_ptr + offs, mask=in_range, other=ignore_index)
        is_bad = ((t < 0) | (t >= vocab)) & (t != ignore_index)
        safe = tl.where(is_bad, ignore_index, t)
        tl.store(safe_ptr + offs, safe, mask=in_range)
        kept = safe != ignore_index
        bad += is_bad.to(tl.int32)
        count += kept.to(tl.int32)
        if HAS_WEIGHT:
            mass += tl.load(class_weight_ptr + tl.where(kept, safe, 0), mask=kept, other=0.0)
    kept_rows = tl.sum(count, axis=0).to(tl.float32)
    if HAS_WEIGHT:
        weight_mass = tl.sum(mass, axis=0)
    else:
        weight_mass = kept_rows
    # Only the denominators of a batch with no kept row are replaced (its mean is 0, not 0/0). A class-weight
    # mass of kept rows is torch's denominator whatever its value: < 1, <= 0 or NaN.
    any_kept = kept_rows > 0
    weight_mass = tl.where(any_kept, weight_mass, 1.0)
    kept_rows = tl.where(any_kept, kept_rows, 1.0)
    any_bad = tl.sum(bad, axis=0) > 0
    poison = tl.zeros([], dtype=tl.float32)
    if POISON:
        poison = tl.where(any_bad, poison / poison, poison)  # 0/0: NaN
    tl.store(meta_ptr + BAD_AT, any_bad.to(tl.float32))
    tl.store(meta_ptr + MASS_AT, weight_mass)
    tl.store(meta_ptr + COUNT_AT, kept_rows)
    if MEAN:
        tl.store(meta_ptr + SCALE_CE_AT, 1.0 / weight_mass + poison)
        tl.store(meta_ptr + SCALE_Z_AT, 1.0 / kept_rows + poison)
    else:
        tl.store(meta_ptr + SCALE_CE_AT, 1.0 + poison)
        tl.store(meta_ptr + SCALE_Z_AT, 1.0 + poison)
    tl.store(meta_ptr + POISON_AT, poison)


def empty_meta(device: torch.device) -> torch.Tensor:
    """An unwritten ``meta`` for :func:`prepare_targets_`'s ``out``."""
    return torch.empty(META_SIZE, dtype=torch.float32, device=device)


def prepare_targets_(
    target: torch.Tensor,
    vocab: int,
    ignore_index: int,
    class_weight: torch.Tensor | None,
    mean: bool,
    poison: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(safe targets, meta)`` for ``target`` (1-D int64, contiguous); ``class_weight`` fp32 ``[V]`` or None;
    ``poison``: a bad row makes the scales and ``meta[META_POISON]`` NaN; ``out``: the two to write (made here
    otherwise: ``empty_like(target)`` and ``[META_SIZE]`` fp32)."""
    safe, meta = out if out is not None else (torch.empty_like(target), empty_meta(target.device))
    _prepare_targets_kernel[(1,)](
        target, safe, class_weight, meta, target.numel(), vocab, ignore_index,
        HAS_WEIGHT=class_weight is not None, MEAN=mean, POISON=poison, BLOCK=_BLOCK,
    )  # fmt: skip
    return safe, meta
