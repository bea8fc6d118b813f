"""Row-wise cross-entropy over a logits slab, with dL/dlogits written back into the slab.

One program per row. Pass 1 walks the row in ``BLOCK_V`` blocks keeping an online
log-sum-exp (running max ``m`` and ``d = sum(exp(z - m))``, rescaled when the max grows), the
target logit, the label-smoothing sum and the argmax. Pass 2 re-reads the row and overwrites it
with the gradient, so the slab needs no second buffer. All maths in fp32.

Notation: ``x`` the raw logit, ``z = softcap * tanh(x / softcap)`` (or ``z = x``), ``p = softmax(z)``,
``w`` the class weights (1 without), ``W = sum_c w_c``, ``eps`` label smoothing, ``y`` the target.
Per row, matching ``torch.nn.functional.cross_entropy``::

    ce  = (1 - eps) * w_y * (lse - z_y) + eps / V * (W * lse - sum_c w_c z_c)
    zl  = z_loss_scale * lse**2
    dce/dz_c = (1 - eps) * w_y * (p_c - [c == y]) + eps / V * (W * p_c - w_c)
    dzl/dz_c = 2 * z_loss_scale * lse * p_c
    dz/dx    = 1 - (z / softcap)**2
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["KERNELS_INTERPRETED", "ce_rows"]

#: Triton picks interpreter or compiler when a kernel is decorated, i.e. when this module is imported.
KERNELS_INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

_MAX_BLOCK_V = 4096


@triton.jit
def _tanh(x):
    # tanh(x) = 2 * sigmoid(2x) - 1: portable across Triton versions, exact limits at +-inf.
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _ce_rows_kernel(
    logits_ptr,
    row_stride,
    target_ptr,
    class_weight_ptr,
    scale_ptr,
    loss_ptr,
    z_loss_ptr,
    correct_ptr,
    n_cols,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss_scale,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    SCALE_PER_ROW: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # row * row_stride can pass 2**31 elements (V=262144, 8192+ rows): keep it 64-bit.
    row_ptr = logits_ptr + row * row_stride
    target = tl.load(target_ptr + row)
    cols = tl.arange(0, BLOCK_V)

    if target == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if HAS_Z_LOSS:
            tl.store(z_loss_ptr + row, 0.0)
        if TRACK_ARGMAX:
            tl.store(correct_ptr + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, n_cols, BLOCK_V):
                offs = start + cols
                tl.store(row_ptr + offs, tl.zeros([BLOCK_V], dtype=row_ptr.dtype.element_ty), mask=offs < n_cols)
    else:
        m = -float("inf")
        d = 0.0
        sum_wz = 0.0
        sum_w = 0.0
        best = -float("inf")
        best_idx = 0
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                z = softcap * _tanh(z / softcap)
            if HAS_SMOOTHING:
                # masked lanes hold 0 here (softcap(0) == 0), so they add nothing to the sums
                if HAS_WEIGHT:
                    w = tl.load(class_weight_ptr + offs, mask=mask, other=0.0)
                    sum_wz += tl.sum(w * z, axis=0)
                    sum_w += tl.sum(w, axis=0)
                else:
                    sum_wz += tl.sum(z, axis=0)
            z = tl.where(mask, z, -float("inf"))
            block_max = tl.max(z, axis=0)
            if TRACK_ARGMAX:
                # strict '>' keeps the first maximum, as torch.argmax does
                block_idx = tl.argmax(z, axis=0)
                if block_max > best:
                    best = block_max
                    best_idx = start + block_idx
            m_new = tl.maximum(m, block_max)
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(d)

        z_y = tl.load(row_ptr + target).to(tl.float32)
        if HAS_SOFTCAP:
            z_y = softcap * _tanh(z_y / softcap)
        w_y = 1.0
        if HAS_WEIGHT:
            w_y = tl.load(class_weight_ptr + target)
        if not HAS_WEIGHT:
            sum_w = n_cols * 1.0
        eps_over_v = label_smoothing / n_cols
        ce = (1.0 - label_smoothing) * w_y * (lse - z_y)
        if HAS_SMOOTHING:
            ce += eps_over_v * (sum_w * lse - sum_wz)
        tl.store(loss_ptr + row, ce)
        if HAS_Z_LOSS:
            tl.store(z_loss_ptr + row, z_loss_scale * lse * lse)
        if TRACK_ARGMAX:
            tl.store(correct_ptr + row, (best_idx == target).to(tl.float32))

        if WRITE_GRAD:
            if SCALE_PER_ROW:
                scale_ce = tl.load(scale_ptr + row)
                scale_z = scale_ce
            else:
                scale_ce = tl.load(scale_ptr)
                scale_z = tl.load(scale_ptr + 1)
            coef_p = scale_ce * ((1.0 - label_smoothing) * w_y + eps_over_v * sum_w)
            if HAS_Z_LOSS:
                coef_p += scale_z * 2.0 * z_loss_scale * lse
            coef_y = scale_ce * (1.0 - label_smoothing) * w_y
            for start in range(0, n_cols, BLOCK_V):
                offs = start + cols
                mask = offs < n_cols
                z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    z = softcap * _tanh(z / softcap)
                grad = coef_p * tl.exp(z - lse)
                grad = tl.where(offs == target, grad - coef_y, grad)
                if HAS_SMOOTHING:
                    if HAS_WEIGHT:
                        w = tl.load(class_weight_ptr + offs, mask=mask, other=0.0)
                        grad -= scale_ce * eps_over_v * w
                    else:
                        grad -= scale_ce * eps_over_v
                if HAS_SOFTCAP:
                    t = z / softcap
                    grad = grad * (1.0 - t * t)
                tl.store(row_ptr + offs, grad.to(row_ptr.dtype.element_ty), mask=mask)


def ce_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss_rows: torch.Tensor,
    *,
    ignore_index: int,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    class_weight: torch.Tensor | None = None,
    z_loss_rows: torch.Tensor | None = None,
    correct_rows: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    scale_per_row: bool = False,
) -> None:
    """Per-row loss of ``logits [n, V]`` (fp32 into ``loss_rows [n]``); gradient in place when ``grad_scale``.

    ``grad_scale`` (fp32, on the device) is ``[scale_ce, scale_z]`` or, with ``scale_per_row``, one
    scale per row: reading it in the kernel keeps the mean's denominator off the host.
    ``z_loss_rows`` / ``correct_rows`` receive ``z_loss_scale * lse**2`` and ``argmax == target``.
    Nothing is checked here: the driver calls it once per chunk.
    """
    n_rows, n_cols = logits.shape
    block_v = min(triton.next_power_of_2(n_cols), _MAX_BLOCK_V)
    _ce_rows_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        target,
        class_weight,
        grad_scale,
        loss_rows,
        z_loss_rows,
        correct_rows,
        n_cols,
        ignore_index,
        label_smoothing,
        softcap if softcap is not None else 1.0,
        z_loss_scale,
        HAS_WEIGHT=class_weight is not None,
        HAS_SMOOTHING=label_smoothing > 0.0,
        HAS_SOFTCAP=softcap is not None,
        HAS_Z_LOSS=z_loss_rows is not None,
        TRACK_ARGMAX=correct_rows is not None,
        WRITE_GRAD=grad_scale is not None,
        SCALE_PER_ROW=scale_per_row,
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )
