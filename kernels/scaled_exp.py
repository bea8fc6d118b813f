"""The logits GEMM with a scaled-exp epilogue: the slab holds ``exp(z - m_tile)``, not the logits.

One persistent Triton GEMM, ``x_chunk @ W.T (+ bias)`` with TMA loads, whose epilogue takes each
``[BLOCK_M, BLOCK_N]`` tile's row maxima ``m`` (over the tile's columns), stores ``exp(z - m)`` in the
slab's dtype and writes the tile's partials into the CE workspace (:mod:`.row_partials`), one slot per
column tile, as the CE partial pass would per segment: ``m``, ``d = sum(exp(z - m))``, and as asked the
label-smoothing sums, the argmax (over the logits rounded to the slab's dtype, as eager's argmax sees
them), the entropy sum. The target logit ``z_y`` comes from a kernel of its own (the row's dot with its
target's weight row, in fp32). The CE finish kernel (:func:`.ce_kernel.ce_finish` with
``workspace.scaled_exp_tile``) merges the slots into ``lse`` and forms ``p = E * exp(m_tile - lse)``: no
partial pass, so two passes over the slab instead of three.

Why: a bf16 logit carries ``|z| 2^-9`` of rounding into ``p = exp(z - lse)`` (logit std 4: the dense
path's gradient error, 0.0076 relative); the stored exponential carries ``2^-9`` relative whatever
``z``. The target's one-hot term stays out of the slab (:mod:`.target_grad`). Under the interpreter at
512x1024x32768, logit std 4, against fp64: grad_input 0.0021 and grad_weight 0.0020 with an fp32
grad_weight accumulator (0.0040 with a bf16 one), against 0.0076 / 0.0077 for the logits slab
(results/notes/2026-12-02-cpu-scaled-exp-numerics.log). The loss, ``lse`` and ``z_y`` are fp32. The softcap
is not fused here (its gradient needs ``tanh`` per element): such calls run on the logits slab
(:mod:`flce_policy.plan.scaled_exp`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flce_policy.plan.scaled_exp import SCALED_EXP_TILE

from .interpreter import KERNELS_INTERPRETED
from .rounding import rounded
from .row_partials import CEWorkspace
from .tma import TensorDescriptor

__all__ = ["scaled_exp_logits"]

#: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages): the fastest with this epilogue of sweeps at the small
#: heads' chunks on the H200 (results/2026-12-01-small-heads/h200-persistent-tma.log; GROUP_M 16 over 8: 1-3%
#: in a sweep of 2026-12-02, results/2026-12-02-h200-scaled-exp/); BLOCK_N is the plan's tile.
_LAUNCH = (128, SCALED_EXP_TILE, 64, 16, 8, 3)
#: Rows and hidden columns per step of the target-logit kernel.
_TARGET_ROWS, _TARGET_HIDDEN = 16, 128
#: Programs of the persistent grid under the interpreter (the GPU runs one per SM).
_INTERPRETED_PROGRAMS = 4


@functools.cache
def _programs(device: torch.device) -> int:
    if KERNELS_INTERPRETED:
        return _INTERPRETED_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _scaled_exp_gemm_kernel(
    x_desc,
    w_desc,
    out_desc,
    bias_ptr,
    class_weight_ptr,
    partials_ptr,
    best_index_ptr,
    plane,
    n_rows,
    n_cols,
    hidden,
    HAS_BIAS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr,
    ENTROPY: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_N: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tiles_m = tl.cdiv(n_rows, BLOCK_M)
    tiles_n = tl.cdiv(n_cols, BLOCK_N)
    in_group = GROUP_M * tiles_n
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=True):
        # GROUP_M row tiles walk the columns together: W's tiles are read from L2 by the group
        group_first = tile // in_group * GROUP_M
        group_size = min(tiles_m - group_first, GROUP_M)
        pid_m = group_first + (tile % in_group) % group_size
        pid_n = (tile % in_group) // group_size
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(hidden, BLOCK_K)):
            a = x_desc.load([row0, k * BLOCK_K])
            b = w_desc.load([col0, k * BLOCK_K])
            if IEEE:  # the interpreter's low-precision dot is wrong; fp32 products are exact there
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b.T, acc)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        col_ok = cols < n_cols
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        # Columns past V hold z = 0 (TMA reads zeros there, the bias is masked): a sum of z or of z * weight is
        # right as it is; the max, the exponentials and the argmax see -inf there. Only the accumulator is kept
        # live over the epilogue (128 fp32 registers per thread: a second such tile spills).
        slot = rows.to(tl.int64) * NUM_SLOTS + pid_n
        if HAS_SMOOTHING:
            no_rows = tl.zeros([BLOCK_M], dtype=tl.float32)
            if HAS_WEIGHT:
                w = tl.load(class_weight_ptr + cols, mask=col_ok, other=0.0)
                tl.store(partials_ptr + 2 * plane + slot, tl.sum(acc * w[None, :], axis=1), mask=row_ok)
                tl.store(partials_ptr + 3 * plane + slot, no_rows + tl.sum(w, axis=0), mask=row_ok)
            else:
                tl.store(partials_ptr + 2 * plane + slot, tl.sum(acc, axis=1), mask=row_ok)
                tl.store(partials_ptr + 3 * plane + slot, no_rows, mask=row_ok)
        if not EVEN_N:  # in place: one more tile of registers would spill
            acc = tl.where(col_ok[None, :], acc, -float("inf"))
        if TRACK_ARGMAX:
            as_logits = rounded(acc, out_desc.dtype)
            tl.store(partials_ptr + 4 * plane + slot, tl.max(as_logits, axis=1), mask=row_ok)
            tl.store(best_index_ptr + slot, col0 + tl.argmax(as_logits, axis=1), mask=row_ok)
        m = tl.max(acc, axis=1)
        e = tl.exp(acc - m[:, None])
        if ENTROPY:
            if EVEN_N:
                tl.store(partials_ptr + 6 * plane + slot, tl.sum(e * acc, axis=1), mask=row_ok)
            else:  # 0 * -inf past V
                tl.store(
                    partials_ptr + 6 * plane + slot,
                    tl.sum(e * tl.where(col_ok[None, :], acc, 0.0), axis=1),
                    mask=row_ok,
                )
        tl.store(partials_ptr + slot, m, mask=row_ok)
        tl.store(partials_ptr + plane + slot, tl.sum(e, axis=1), mask=row_ok)
        if IEEE:  # the interpreter truncates a cast to bf16: round to nearest first, as the GPU's cast does
            e = rounded(e, out_desc.dtype)
        out_desc.store([row0, col0], e.to(out_desc.dtype))


@triton.jit
def _target_logit_kernel(
    x_ptr, x_stride, w_ptr, w_stride, bias_ptr, target_ptr, out_ptr, out_stride, n_rows, n_cols, hidden,
    HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    target = tl.load(target_ptr + rows, mask=rows < n_rows, other=-1)
    holds = (rows < n_rows) & (target >= 0) & (target < n_cols)
    target = tl.where(holds, target, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        ok = holds[:, None] & (h < hidden)[None, :]
        xv = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + h[None, :], mask=ok, other=0.0)
        wv = tl.load(w_ptr + target[:, None] * w_stride + h[None, :], mask=ok, other=0.0)
        acc += tl.sum(xv.to(tl.float32) * wv.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + target, mask=holds, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64) * out_stride, acc, mask=holds)


def scaled_exp_logits(
    x_chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slab: torch.Tensor,
    target: torch.Tensor,
    workspace: CEWorkspace,
    *,
    class_weight: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    track_argmax: bool = False,
    entropy: bool = False,
) -> None:
    """``slab [n, V] = exp(z - m_tile)`` for ``z = x_chunk @ weight.T (+ bias)``, and the rows' partials in
    ``workspace`` (made by :func:`.ce_kernel.ce_workspace` with ``scaled_exp=True``). Nothing is checked
    here: a geometry has this slab form only where :mod:`flce_policy.plan.scaled_exp` says it can run."""
    n_rows, hidden = x_chunk.shape
    n_cols = weight.shape[0]
    block_m, block_n, block_k, group_m, num_warps, num_stages = _LAUNCH
    ws = workspace
    programs = min(_programs(slab.device), triton.cdiv(n_rows, block_m) * triton.cdiv(n_cols, block_n))
    _scaled_exp_gemm_kernel[(programs,)](
        TensorDescriptor.from_tensor(x_chunk, [block_m, block_k]),
        TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        TensorDescriptor.from_tensor(slab, [block_m, block_n]),
        bias,
        class_weight,
        ws.partials,
        ws.best_index,
        ws.partials.stride(0),
        n_rows,
        n_cols,
        hidden,
        HAS_BIAS=bias is not None,
        HAS_WEIGHT=class_weight is not None,
        HAS_SMOOTHING=label_smoothing > 0.0,
        TRACK_ARGMAX=track_argmax,
        ENTROPY=entropy,
        IEEE=KERNELS_INTERPRETED,
        EVEN_N=n_cols % block_n == 0,
        NUM_SLOTS=ws.slots,
        NUM_PROGRAMS=programs,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    # z_y apart: picked out of the GEMM's tile it cost the epilogue 9-15% at the small heads (H200, 4096-row
    # chunks, proto sweep of 2026-12-02); a dot of two rows in fp32 is the same value up to summation order
    _target_logit_kernel[(triton.cdiv(n_rows, _TARGET_ROWS),)](
        x_chunk, x_chunk.stride(0), weight, weight.stride(0), bias, target, ws.partials[5], ws.partials.stride(1),
        n_rows, n_cols, hidden, HAS_BIAS=bias is not None, BLOCK_R=_TARGET_ROWS, BLOCK_H=_TARGET_HIDDEN,
    )  # fmt: skip
