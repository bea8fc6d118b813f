"""One row chunk's grad_weight, ``acc [V, H] (+)= G.T @ x``, with the old ``acc`` block loaded before the K loop.

At 256-512 rows of a 5376 x 262144 head the chunk's grad_weight GEMM has ``K`` = the chunk's rows (4-8 steps of 64)
while it reads and writes the whole ``[V, H]`` accumulator: 5.6 GB a chunk in bf16, about as long at an H100's
bandwidth as the multiplications. cuBLAS's ``addmm`` (beta=1) took 2.8-3.0 ms a chunk there, against 1.7 ms for its
bytes alone (H100, profile_chunks): its epilogue reads the old block after the K loop. Here each program issues the
load of its old ``[BLOCK_V, BLOCK_H]`` block first, so the read is in flight during the loop, and adds it to the
fp32 sum before the one store.

``G`` may be a row-strided slab (its rows ``stride_g`` apart); ``acc`` is row-major with any row stride. The first
chunk (``first``) writes without reading. Consecutive programs share a column block of ``G`` (the hidden blocks
vary fastest), so ``G`` is read from HBM about once and ``x`` (``[rows, H]``, a few MB) from L2.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .interpreter import KERNELS_INTERPRETED

__all__ = ["WeightGradLaunch", "DEFAULT_LAUNCH", "weight_grad_gemm"]


class WeightGradLaunch(NamedTuple):
    """A launch's tile and pipeline: ``[block_v, block_h]`` of grad_weight a program, ``block_r`` rows a step."""

    block_v: int = 128
    block_h: int = 128
    block_r: int = 64
    num_warps: int = 8
    num_stages: int = 3


#: Unmeasured: the microbenchmark (benchmarks/weight_grad_gemm_bench.py) times a few launches against cuBLAS.
DEFAULT_LAUNCH = WeightGradLaunch()


@triton.jit
def _weight_grad_kernel(
    acc_ptr,
    g_ptr,
    x_ptr,
    rows,
    vocab,
    hidden,
    stride_acc,
    stride_g,
    stride_x,
    FIRST: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks_h = tl.cdiv(hidden, BLOCK_H)
    offs_v = (pid // blocks_h) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_h = (pid % blocks_h) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_v = offs_v < vocab
    mask_h = offs_h < hidden
    acc_ptrs = acc_ptr + offs_v[:, None].to(tl.int64) * stride_acc + offs_h[None, :]
    block_mask = mask_v[:, None] & mask_h[None, :]
    if not FIRST:
        old = tl.load(acc_ptrs, mask=block_mask, other=0.0)  # in flight while the K loop runs
    total = tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float32)
    for r0 in range(0, rows, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rows
        g_t = tl.load(  # [BLOCK_V, BLOCK_R]: G's block read as its transpose
            g_ptr + offs_r[None, :].to(tl.int64) * stride_g + offs_v[:, None],
            mask=mask_r[None, :] & mask_v[:, None],
            other=0.0,
        )
        x = tl.load(
            x_ptr + offs_r[:, None].to(tl.int64) * stride_x + offs_h[None, :],
            mask=mask_r[:, None] & mask_h[None, :],
            other=0.0,
        )
        if IEEE:  # fp32 operands (no TF32, as torch's fp32 matmul); the interpreter's low-precision tl.dot is wrong
            total = tl.dot(g_t.to(tl.float32), x.to(tl.float32), total, input_precision="ieee")
        else:
            total = tl.dot(g_t, x, total)
    if not FIRST:
        total += old.to(tl.float32)
    tl.store(acc_ptrs, total.to(acc_ptr.dtype.element_ty), mask=block_mask)


def weight_grad_gemm(
    acc: torch.Tensor,
    g: torch.Tensor,
    x: torch.Tensor,
    *,
    first: bool,
    launch: WeightGradLaunch = DEFAULT_LAUNCH,
) -> None:
    """``acc [V, H] (+)= g [rows, V].T @ x [rows, H]`` (``first``: ``acc`` overwritten, not read), fp32 inside,
    rounded once to ``acc``'s dtype. ``g`` and ``x`` share a dtype; each has unit column stride."""
    rows, vocab = g.shape
    hidden = x.shape[1]
    if acc.shape != (vocab, hidden) or x.shape[0] != rows:
        raise ValueError(f"shapes do not chain: acc {tuple(acc.shape)}, g {tuple(g.shape)}, x {tuple(x.shape)}")
    if g.stride(1) != 1 or x.stride(1) != 1 or acc.stride(1) != 1:
        raise ValueError("g, x and acc need unit column strides")
    if g.dtype != x.dtype:
        raise ValueError(f"g and x differ in dtype: {g.dtype} and {x.dtype}")
    grid = (triton.cdiv(vocab, launch.block_v) * triton.cdiv(hidden, launch.block_h),)
    _weight_grad_kernel[grid](
        acc, g, x, rows, vocab, hidden, acc.stride(0), g.stride(0), x.stride(0),
        FIRST=first, BLOCK_V=launch.block_v, BLOCK_H=launch.block_h, BLOCK_R=launch.block_r,
        IEEE=g.dtype == torch.float32 or KERNELS_INTERPRETED,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
