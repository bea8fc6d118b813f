"""grad_weight (and grad_bias) of one chunk that skips the tiles of dL/dlogits that carry nothing.

A trained LM's softmax is nearly all zeros: most ``[FILTER_ROWS, FILTER_COLS]`` tiles of a chunk's
dL/dlogits ``G`` hold only tiny values. The CE finish kernel (:mod:`flce_policy.kernels.ce_kernel`)
writes one flag per row and ``FILTER_COLS`` columns: 1 when some column there has a per-token
``|p_c - [c == y]| >= eps`` (``p = softmax(z)``, ``z`` after the softcap; unscaled: the reduction,
``grad_output``, class weights, token scaling, z-loss and smoothing do not move it) or is the target.
Here one program owns a ``[FILTER_COLS, BLOCK_H]`` tile of grad_weight and walks the chunk's rows
in tiles of ``FILTER_ROWS``: a row tile whose flags for its columns are all 0 is neither loaded nor
multiplied. A program that skips every row tile writes zeros on the first chunk and touches nothing
on a later one (no read-modify-write). grad_input is not filtered: the driver keeps it dense.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from flce_policy.plan.weight_filter import FILTER_COLS, FILTER_ROWS

from .interpreter import KERNELS_INTERPRETED

if TYPE_CHECKING:
    from .driver_call import DriverCall

__all__ = ["FILTER_COLS", "FILTER_ROWS", "filter_flags", "filter_flags_for", "filtered_weight_grad"]

#: grad_weight columns (hidden units) per program.
_BLOCK_H = 128


def filter_flags(rows: int, tile_cols: int, device: torch.device) -> torch.Tensor:
    """The flags buffer for chunks of up to ``rows`` rows of a ``tile_cols``-column slab (uint8, unfilled)."""
    return torch.empty((rows, triton.cdiv(tile_cols, FILTER_COLS)), dtype=torch.uint8, device=device)


def filter_flags_for(call: DriverCall, rows: int, tile_cols: int) -> torch.Tensor | None:
    """A driver call's flags buffer: None (the dense GEMMs) without a filter or without a weight or bias gradient."""
    if call.params.grad_weight_filter is None or not (call.grads.weight or call.grads.bias):
        return None
    return filter_flags(rows, tile_cols, call.x.device)


@triton.jit
def _filtered_weight_grad_kernel(
    grad_ptr,
    grad_stride,
    x_ptr,
    x_stride,
    flags_ptr,
    flag_stride,
    out_ptr,
    out_stride,
    bias_ptr,
    n_rows,
    n_cols,
    hidden,
    FIRST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_h = tl.program_id(1)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # classes: columns of G, rows of grad_weight
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < n_cols
    h_mask = hs < hidden
    acc = tl.zeros([BLOCK_V, BLOCK_H], dtype=tl.float32)
    bias_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    kept = 0
    for k in range(0, n_rows, BLOCK_K):
        rows = k + tl.arange(0, BLOCK_K)
        row_mask = rows < n_rows
        flags = tl.load(flags_ptr + rows.to(tl.int64) * flag_stride + pid_v, mask=row_mask, other=0)
        if tl.max(flags.to(tl.int32), axis=0) > 0:
            g = tl.load(
                grad_ptr + rows.to(tl.int64)[:, None] * grad_stride + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            if HAS_WEIGHT:
                x = tl.load(
                    x_ptr + rows.to(tl.int64)[:, None] * x_stride + hs[None, :],
                    mask=row_mask[:, None] & h_mask[None, :],
                    other=0.0,
                )
                if IEEE:
                    # fp32 products, as cuBLAS gives torch's fp32 matmul (no TF32); also bf16/fp16 operands under
                    # the interpreter, whose low-precision tl.dot is wrong (exact there: the products fit fp32)
                    acc = tl.dot(tl.trans(g.to(tl.float32)), x.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(tl.trans(g), x, acc)
            if HAS_BIAS:
                bias_acc += tl.sum(g.to(tl.float32), axis=0)
            kept += 1
    if HAS_WEIGHT:
        out = out_ptr + cols.to(tl.int64)[:, None] * out_stride + hs[None, :]
        out_mask = col_mask[:, None] & h_mask[None, :]
        if FIRST:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        elif kept > 0:
            total = tl.load(out, mask=out_mask, other=0.0).to(tl.float32) + acc
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=out_mask)
    if HAS_BIAS:
        if (pid_h == 0) & (kept > 0):
            total_b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0) + bias_acc
            tl.store(bias_ptr + cols, total_b, mask=col_mask)


def filtered_weight_grad(
    grad_weight: torch.Tensor | None,
    grad: torch.Tensor,
    x_chunk: torch.Tensor,
    flags: torch.Tensor,
    *,
    first: bool,
    grad_bias: torch.Tensor | None = None,
) -> None:
    """``grad_weight (+)= G.T @ x_chunk`` and ``grad_bias += G.sum(0)`` over the flagged tiles of ``G``.

    ``grad [n, C]`` (a slab of dL/dlogits), ``x_chunk [n, H]``, ``grad_weight [C, H]`` (any float dtype,
    row-contiguous; ``first`` overwrites it; None: grad_bias only), ``grad_bias [C]`` fp32, ``flags`` as
    the finish kernel wrote them for ``grad``. Accumulates in fp32 and rounds once per call into ``grad_weight``.
    """
    n_rows, n_cols = grad.shape
    hidden = x_chunk.shape[1] if grad_weight is not None else 1
    block_h = min(_BLOCK_H, max(16, triton.next_power_of_2(hidden)))
    grid = (triton.cdiv(n_cols, FILTER_COLS), triton.cdiv(hidden, block_h))
    _filtered_weight_grad_kernel[grid](
        grad,
        grad.stride(0),
        x_chunk,
        x_chunk.stride(0),
        flags,
        flags.stride(0),
        grad_weight,
        0 if grad_weight is None else grad_weight.stride(0),
        grad_bias,
        n_rows,
        n_cols,
        hidden,
        FIRST=first,
        HAS_WEIGHT=grad_weight is not None,
        HAS_BIAS=grad_bias is not None,
        IEEE=grad.dtype == torch.float32 or KERNELS_INTERPRETED,
        BLOCK_V=FILTER_COLS,
        BLOCK_H=block_h,
        BLOCK_K=FILTER_ROWS,
        num_warps=8,
        num_stages=3,
    )
