"""One launch after the chunks: a mean/sum call's loss, z-loss and token accuracy from its per-row results.

One program sums the rows in a fixed order (each lane compensated, so a million rows lose no more
than a few fp32 ulps) and divides by the denominators ``flce_policy.kernels.safe_targets`` wrote into
``meta``: the CE sum by the class-weight mass and the z-loss by the kept-row count for ``mean``; the
accuracy is always over the kept rows. The loss adds ``meta``'s poison (0, or NaN after a bad target
where the flag could not be read on the host). Replaces about ten small launches (sums, divisions, a zero
z-loss and accuracy) on the path of every call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .safe_targets import COUNT_AT, MASS_AT, POISON_AT

__all__ = ["loss_totals"]

_BLOCK = 1024


@triton.jit
def _kahan_add(total, carry, value):
    corrected = value - carry
    new_total = total + corrected
    return new_total, (new_total - total) - corrected


@triton.jit
def _loss_totals_kernel(
    loss_rows_ptr, z_rows_ptr, argmax_ptr, target_ptr, meta_ptr, loss_ptr, z_loss_ptr, accuracy_ptr, n,
    ignore_index, HAS_Z: tl.constexpr, ACCURACY: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    ce = tl.zeros([BLOCK], dtype=tl.float32)
    ce_carry = tl.zeros([BLOCK], dtype=tl.float32)
    z = tl.zeros([BLOCK], dtype=tl.float32)
    z_carry = tl.zeros([BLOCK], dtype=tl.float32)
    correct = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_range = offs < n
        ce, ce_carry = _kahan_add(ce, ce_carry, tl.load(loss_rows_ptr + offs, mask=in_range, other=0.0))
        if HAS_Z:
            z, z_carry = _kahan_add(z, z_carry, tl.load(z_rows_ptr + offs, mask=in_range, other=0.0))
        if ACCURACY:
            t = tl.load(target_ptr + offs, mask=in_range, other=ignore_index)
            a = tl.load(argmax_ptr + offs, mask=in_range, other=-1)
            correct += ((a == t) & (t != ignore_index)).to(tl.int32)
    ce_total = tl.sum(ce, axis=0)
    z_total = tl.sum(z, axis=0)
    kept_rows = tl.load(meta_ptr + COUNT_AT)
    if MEAN:
        ce_total = ce_total / tl.load(meta_ptr + MASS_AT)
        z_total = z_total / kept_rows
    tl.store(loss_ptr, ce_total + z_total + tl.load(meta_ptr + POISON_AT))
    tl.store(z_loss_ptr, z_total)
    tl.store(accuracy_ptr, tl.sum(correct, axis=0).to(tl.float32) / kept_rows)


def loss_totals(
    loss_rows: torch.Tensor,
    z_rows: torch.Tensor | None,
    argmax_rows: torch.Tensor | None,
    target: torch.Tensor,
    meta: torch.Tensor,
    ignore_index: int,
    mean: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, z_loss, accuracy)``, 0-dim fp32: the rows' CE plus z-loss summed (over the mass / count for
    ``mean``), the z-loss part (0 without ``z_rows``), and the share of kept rows whose ``argmax_rows`` is
    their ``target`` (0 without ``argmax_rows``)."""
    device = loss_rows.device
    loss, z_loss, accuracy = (torch.empty((), dtype=torch.float32, device=device) for _ in range(3))
    _loss_totals_kernel[(1,)](
        loss_rows, z_rows, argmax_rows, target, meta, loss, z_loss, accuracy, loss_rows.numel(), ignore_index,
        HAS_Z=z_rows is not None, ACCURACY=argmax_rows is not None, MEAN=mean, BLOCK=_BLOCK,
    )  # fmt: skip
    return loss, z_loss, accuracy
