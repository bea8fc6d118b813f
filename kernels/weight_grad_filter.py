"""grad_weight (and grad_bias) of one chunk that skips the tiles of dL/dlogits that carry nothing.

A trained LM's softmax is nearly all zeros: most ``[FILTER_ROWS, FILTER_COLS]`` tiles of a chunk's
dL/dlogits ``G`` hold only tiny values. The CE finish kernel (:mod:`flce_policy.kernels.ce_kernel`)
writes, through :func:`store_flags`, one flag byte per row and ``FILTER_COLS`` columns: ``KEPT_FLAG`` when some
column there has a per-token ``|p_c - [c == y]| >= eps`` (``p = softmax(z)``, ``z`` after the softcap;
unscaled: the reduction, ``grad_output``, class weights, token scaling, z-loss and smoothing do not
move it) or is the target, else ``KEPT_FLAG`` minus the columns' level (the octaves from their largest such value
up to eps: :mod:`flce_policy.plan.weight_filter`).

Three launches per chunk (and vocab tile):

1. ``_tile_flags_kernel``: which of the chunk's row tiles (``FILTER_ROWS`` rows each, from the chunk's
   first row) have a kept flag in each ``FILTER_COLS`` columns, a state byte per tile (1 kept, 0
   skipped; with a rescue, 1 + the tile's level L where a tile to skip is kept anyway: the hash of
   :data:`flce_policy.plan.weight_filter.RESCUE_HASH` picks one in 2^L).
2. ``_list_tiles_kernel``, one program per ``FILTER_COLS`` columns: those tiles as a list (the rescued ones
   first, by descending level), its length and where each level's rescued tiles end.
3. One program per ``[FILTER_COLS, BLOCK_H]`` block of grad_weight, ``G[tile, cols].T @ x[tile, h]`` in
   fp32 over the kept row tiles only (a skipped tile is neither loaded nor multiplied; the rescued tiles'
   sum is doubled after each level, so level L's count 2^L times, before the kept ones are added: no cost
   per tile):
   ``_listed_tma_kernel`` loads the listed tiles through TMA descriptors, the next tile's row read one
   iteration ahead, so the loads pipeline whatever the list: 1.01x cuBLAS's time with every tile kept,
   0.31x with 18% kept (H200, results/2026-12-01-h200-filter-kernel-probes/filter-probe-3.log). Where TMA cannot
   run (a GPU before Hopper, strides or addresses not 16-byte aligned) ``_filtered_weight_grad_kernel``
   does, launched twice: a pointer-based loop over the list for the column blocks with at most
   ``DENSE_LOOP_MIN_KEPT`` of their row tiles kept, and a loop over every row tile (pointers stepped by
   a constant, the skipped tiles' loads masked off and their zeros multiplied) for the others.
   A block with no kept tile is written as zeros on the first chunk and not touched on a later one (no
   read-modify-write). The programs of one column block run side by side (the hidden blocks vary
   fastest), so ``G``'s tiles are read from HBM about once and ``x``'s from L2.

Where so many tiles are kept that the kernel would be slower than cuBLAS (random logits: every tile), the
chunk's grad_weight runs the dense path's GEMM instead, decided on the host from the flagged count. The driver
queues the count (:func:`flag_tiles`) before its grad_input GEMM and reads it after that GEMM is queued, so the host
waits for the count, not for the GPU's queue; nothing is read while a CUDA graph is captured (the kernel runs).

grad_input is not filtered: the driver keeps it dense.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from flce_policy.plan.weight_filter import (
    ALL_KEPT_COST,
    DENSE_LOOP_MIN_KEPT,
    FILTER_COLS,
    FILTER_ROWS,
    KEPT_FLAG,
    MAX_RESCUE,
    RESCUE_HASH,
    rescue_max_level,
)

from .gemm import accumulate_mm
from .host_read import HostRead
from .interpreter import KERNELS_INTERPRETED
from .tma import TensorDescriptor, tma_tensors

if TYPE_CHECKING:
    from .driver_call import DriverCall
    from .row_partials import CEWorkspace

__all__ = [
    "FilterScratch",
    "FlaggedTiles",
    "TileCount",
    "count_unfiltered",
    "filter_scratch",
    "filter_scratch_for",
    "filtered_weight_grad",
    "filters",
    "flag_tiles",
    "rest_after_dense",
    "eps_logs",
    "finish_kernel_args",
    "observe_tiles",
    "store_flags",
]

#: (grad_weight columns per program, warps, stages) of the pointer-based launches, dense loop (True) and
#: listed loop (False), and of the TMA launch: the fastest of sweeps at 4096x1024x131072 on the H200
#: (results/2026-12-01-h200-filter-kernel-probes/; TMA: 256/8/4 is within 5% of the best at 18%, 50% and
#: 100% of the tiles kept).
_LAUNCHES = {True: (256, 8, 3), False: (128, 8, 3)}
_TMA_LAUNCH = (256, 8, 4)
#: The TMA launch where the hidden size is not a multiple of 256 (896 = 7 x 128): a 256-wide block would leave
#: half of its last block idle. At 4096x896x151936 on the H200, 1.20x cuBLAS's time with every tile kept against
#: 1.26x, 0.33x against 0.36x with 20% kept (results/2026-12-02-h200-filter-random-logits/filter-final.log).
_TMA_LAUNCH_NARROW = (128, 4, 5)
#: The rescue hash's constants as the flag kernel's arguments
_HASH_ARGS = dict(
    HASH_COLUMNS=RESCUE_HASH["columns"],
    BLOCK_MUL=RESCUE_HASH["block_mul"],
    MIXER=RESCUE_HASH["mixer"],
    ROUNDS=RESCUE_HASH["rounds"],
    MASK=RESCUE_HASH["mask"],
)
#: Column blocks per program of the kernel reading the flags (a row of 128 flags: 128 bytes, one line)
_FLAG_BLOCKS = 128
_KEPT = tl.constexpr(KEPT_FLAG)


# --------------------------------------------------------------------------- the flags (in the CE finish kernel)


@triton.jit
def store_flags(
    flag_row_ptr, keep, strength, log2_eps, start, col_stop, BLOCK_V: tl.constexpr, GROUPS: tl.constexpr,
    FLAG_COLS: tl.constexpr, LOG_STRENGTH: tl.constexpr,
):  # fmt: skip
    """One flag byte per ``FLAG_COLS`` columns of the ``BLOCK_V`` block at ``start`` (:func:`flag_codes`): kept
    where some column is, else the level of the columns' largest ``strength`` (per-token ``|p - onehot|``, or its
    natural log with ``LOG_STRENGTH``; columns past the row's end hold 0, or -inf).

    Called by the CE finish kernel per block of a row. ``GROUPS`` is ``BLOCK_V // FLAG_COLS`` (1 when the
    block is narrower: then it is the whole tile).
    """
    kept = tl.max(tl.reshape(keep.to(tl.int32), (GROUPS, BLOCK_V // GROUPS)), axis=1)
    top = tl.max(tl.reshape(strength, (GROUPS, BLOCK_V // GROUPS)), axis=1)
    if LOG_STRENGTH:
        log2_top = top * 1.4426950408889634
    else:
        log2_top = tl.log2(top)
    index = start // FLAG_COLS + tl.arange(0, GROUPS)
    tl.store(flag_row_ptr + index, flag_codes(kept > 0, log2_top, log2_eps), mask=index * FLAG_COLS < col_stop)


@triton.jit
def flag_codes(kept, log2_top, log2_eps):
    """The flag bytes (:data:`flce_policy.plan.weight_filter.KEPT_FLAG`): KEPT_FLAG where ``kept``, else
    KEPT_FLAG - L with L = ceil(log2(eps) - log2(largest |p - onehot|)) in [1, KEPT_FLAG - 1] (an all-zero group,
    or eps 0: the largest level)."""
    gap = log2_eps - log2_top
    level = tl.where(gap < _KEPT - 1, tl.maximum(tl.ceil(gap), 1.0), _KEPT - 1)  # NaN (-inf - -inf): the largest
    return tl.where(kept, _KEPT, _KEPT - level.to(tl.int32)).to(tl.uint8)


def eps_logs(eps: float) -> tuple[float, float]:
    """``(ln eps, log2 eps)`` as the flag kernels take them: eps 0 gives -inf, which keeps every tile."""
    return (math.log(eps), math.log2(eps)) if eps > 0 else (-math.inf, -math.inf)


def finish_kernel_args(ws: CEWorkspace, flags: torch.Tensor | None, eps: float) -> dict:
    """The CE finish kernel's filter arguments: none (the kernel as without a filter) when ``flags`` is None."""
    if flags is None:
        return {}
    one_block = ws.segments_per_tile == 1 and ws.segment_len == ws.block_v
    if ws.block_v < FILTER_COLS and not one_block:
        # one block writes a flag whole (no atomics): a narrower block only when it is the whole tile, as
        # MAX_BLOCK_V >= FILTER_COLS makes it (a test that lowers MAX_BLOCK_V below that gets this error)
        raise ValueError(f"the grad_weight filter needs blocks of >= {FILTER_COLS} columns, got {ws.block_v}")
    log_eps, log2_eps = eps_logs(eps)
    return dict(
        flags_ptr=flags,
        flag_row_stride=flags.stride(0),
        filter_log_eps=log_eps,
        filter_log2_eps=log2_eps,
        FILTER=True,
        FLAG_GROUPS=max(ws.block_v // FILTER_COLS, 1),
        FLAG_COLS=FILTER_COLS,
    )


# --------------------------------------------------------------------------- grad_weight over the kept tiles


class FilterScratch(NamedTuple):
    """A call's buffers for the filter, allocated once for its largest chunk and vocab tile (unfilled)."""

    flags: torch.Tensor  # [rows, cdiv(tile_cols, FILTER_COLS)] uint8, written by the CE finish kernel
    tiles: torch.Tensor  # [cdiv(tile_cols, FILTER_COLS), cdiv(rows, FILTER_ROWS)] int32: kept row tiles, listed
    counts: torch.Tensor  # [cdiv(tile_cols, FILTER_COLS)] int32: how many are listed
    kept: torch.Tensor  # [cdiv(tile_cols, FILTER_COLS), cdiv(rows, FILTER_ROWS)] uint8: 1 kept, 1 + L rescued at
    # level L, 0 skipped
    level_ends: torch.Tensor  # [cdiv(tile_cols, FILTER_COLS) * max level] int32: per column block, where each level's
    # rescued tiles end in its list (from the largest level down; the last is how many are rescued)


class TileCount(NamedTuple):
    """One filtered launch's tiles (0-dim int tensors on the device: no host sync): ``kept`` multiplied (the
    flagged and the rescued) of ``total``, ``rescued`` of them kept by the rescue."""

    kept: torch.Tensor
    total: int
    rescued: torch.Tensor


_observers: list[list[TileCount]] = []


@contextmanager
def observe_tiles() -> Iterator[list[TileCount]]:
    """Record the kept and total tiles of every filtered grad_weight launch inside the block (tests, benchmarks):
    the skipped share is ``1 - sum(kept) / sum(total)``. Costs one small reduction per launch while observed."""
    counts: list[TileCount] = []
    _observers.append(counts)
    try:
        yield counts
    finally:
        _observers.remove(counts)


def count_unfiltered(n_rows: int, n_cols: int, device: torch.device) -> None:
    """Tell the observers (:func:`observe_tiles`) of a filtered call's ``[n_rows, n_cols]`` slab whose grad_weight
    went through the dense GEMM: every tile multiplied, none rescued."""
    if _observers:
        total = triton.cdiv(n_rows, FILTER_ROWS) * triton.cdiv(n_cols, FILTER_COLS)
        count = TileCount(torch.tensor(total, device=device), total, torch.zeros((), dtype=torch.int64, device=device))
        for observer in _observers:
            observer.append(count)


def filter_scratch(rows: int, tile_cols: int, device: torch.device) -> FilterScratch:
    """The filter's buffers for chunks of up to ``rows`` rows of a ``tile_cols``-column slab."""
    col_blocks, row_tiles = triton.cdiv(tile_cols, FILTER_COLS), triton.cdiv(rows, FILTER_ROWS)
    return FilterScratch(
        torch.empty((rows, col_blocks), dtype=torch.uint8, device=device),
        torch.empty((col_blocks, row_tiles), dtype=torch.int32, device=device),
        torch.empty(col_blocks, dtype=torch.int32, device=device),
        torch.empty((col_blocks, row_tiles), dtype=torch.uint8, device=device),
        torch.empty(col_blocks * rescue_max_level(MAX_RESCUE), dtype=torch.int32, device=device),
    )


def filters(call: DriverCall) -> bool:
    """Whether a driver call's grad_weight (or grad_bias) is filtered: a filter eps and a weight or bias gradient."""
    return call.params.grad_weight_filter is not None and (call.grads.weight or call.grads.bias)


def filter_scratch_for(call: DriverCall, rows: int, tile_cols: int) -> FilterScratch | None:
    """A driver call's filter buffers, or None for the dense GEMMs: without a filter (:func:`filters`), or while the
    policy's rest after a call whose flags bought nothing lasts (this call is counted off it; never while a CUDA
    graph is captured: a replay would never flag)."""
    if not filters(call):
        return None
    params, device = call.params, call.x.device
    rest = params.grad_weight_filter_rest
    if rest is not None and not capturing(device) and not rest.flags(params.grad_weight_filter):
        return None
    return filter_scratch(rows, tile_cols, device)


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (no host read: nothing counted)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def rest_after_dense(call: DriverCall) -> None:
    """Tell the policy's rest (if any) that this call's flags kept so many tiles that they went to the dense GEMM."""
    rest = call.params.grad_weight_filter_rest
    if rest is not None:
        rest.went_dense(call.params.grad_weight_filter)


@triton.jit
def _tile_flags_kernel(
    flags_ptr, flag_stride, kept_ptr, tile_stride, x_ptr, x_stride, hidden, n_rows, n_col_blocks,
    BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, MAX_LEVEL: tl.constexpr, HASH: tl.constexpr,
    HASH_COLUMNS: tl.constexpr, BLOCK_MUL: tl.constexpr, MIXER: tl.constexpr, ROUNDS: tl.constexpr,
    MASK: tl.constexpr,
):  # fmt: skip
    """kept[c, r], the state of row tile r in column block c: 1 where one of its rows' flags in c is KEPT_FLAG;
    else, with a rescue (``MAX_LEVEL`` > 0), 1 + its level L (the smallest of its rows', at most MAX_LEVEL) where
    the hash picks it (one in 2^L; every tile without ``HASH``), else 0. One program per row tile and BLOCK_C
    column blocks, reading the flags row by row (coalesced; a column of them is 1 byte in V/128)."""
    row_tile = tl.program_id(0)
    blocks = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = row_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    block_mask = blocks < n_col_blocks
    flags = tl.load(
        flags_ptr + rows.to(tl.int64)[:, None] * flag_stride + blocks[None, :],
        mask=(rows < n_rows)[:, None] & block_mask[None, :],
        other=0,
    )
    top = tl.max(flags.to(tl.int32), axis=0)
    state = (top == _KEPT).to(tl.int32)
    if MAX_LEVEL:
        level = tl.minimum(_KEPT - top, MAX_LEVEL)
        picked = level > 0
        if HASH:
            picked = _rescued(
                x_ptr, x_stride, hidden, n_rows, rows, blocks, level, BLOCK_K, HASH_COLUMNS, BLOCK_MUL, MIXER, ROUNDS,
                MASK,
            )  # fmt: skip
        state = tl.where(state == 1, 1, tl.where(picked, 1 + level, 0))
    tl.store(kept_ptr + blocks * tile_stride + row_tile, state.to(tl.uint8), mask=block_mask)


@triton.jit
def _rescued(
    x_ptr, x_stride, hidden, n_rows, rows, blocks, level, BLOCK_K: tl.constexpr, HASH_COLUMNS: tl.constexpr,
    BLOCK_MUL: tl.constexpr, MIXER: tl.constexpr, ROUNDS: tl.constexpr, MASK: tl.constexpr,
):  # fmt: skip
    """Where the rescue's hash (flce_policy.plan.weight_filter.RESCUE_HASH) of the row tile's x and the column
    block picks the tile at its ``level`` (its low ``level`` bits 0), per block of ``blocks``."""
    columns = tl.arange(0, HASH_COLUMNS)
    x = tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * x_stride + columns[None, :],
        mask=(rows < n_rows)[:, None] & (columns < hidden)[None, :],
        other=0.0,
    )
    bits = x.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    folded = (bits >> 16) ^ (bits & 0xFFFF)
    local = tl.arange(0, BLOCK_K).to(tl.int64)
    weights = 2 * (local[:, None] * HASH_COLUMNS + columns[None, :]) + 1
    h = tl.sum(tl.sum(folded * weights, axis=1), axis=0) & MASK
    z = (h ^ ((blocks.to(tl.int64) * BLOCK_MUL) & MASK)) & MASK
    for _ in tl.static_range(ROUNDS):
        z = ((z ^ (z >> 16)) * MIXER) & MASK
    low_bits = (tl.full(level.shape, 1, tl.int64) << level.to(tl.int64)) - 1
    return ((z ^ (z >> 16)) & low_bits) == 0


@triton.jit
def _list_tiles_kernel(
    kept_ptr, tiles_ptr, tile_stride, counts_ptr, ends_ptr, n_row_tiles, ROW_TILES: tl.constexpr,
    MAX_LEVEL: tl.constexpr,
):  # fmt: skip
    """A column block's rescued row tiles by descending level, then its kept ones, each ascending, as one list; the
    list's length and, per level from MAX_LEVEL down to 1, where its rescued tiles end (one program per column
    block)."""
    col_block = tl.program_id(0)
    row_tiles = tl.arange(0, ROW_TILES)
    in_range = row_tiles < n_row_tiles
    state = tl.load(kept_ptr + col_block * tile_stride + row_tiles, mask=in_range, other=0)
    listed = tiles_ptr + col_block * tile_stride
    end = 0
    for i in tl.static_range(MAX_LEVEL):
        at_level = (state == 1 + MAX_LEVEL - i).to(tl.int32)
        tl.store(listed + end + tl.cumsum(at_level, axis=0) - at_level, row_tiles, mask=in_range & (at_level > 0))
        end += tl.sum(at_level, axis=0)
        tl.store(ends_ptr + col_block * MAX_LEVEL + i, end)
    is_kept = (state == 1).to(tl.int32)
    tl.store(listed + end + tl.cumsum(is_kept, axis=0) - is_kept, row_tiles, mask=in_range & (is_kept > 0))
    tl.store(counts_ptr + col_block, end + tl.sum(is_kept, axis=0))


@triton.jit
def _filtered_weight_grad_kernel(
    grad_ptr,
    grad_stride,
    x_ptr,
    x_stride,
    tiles_ptr,
    tile_stride,
    counts_ptr,
    ends_ptr,
    kept_ptr,
    out_ptr,
    out_stride,
    bias_ptr,
    n_rows,
    n_cols,
    hidden,
    dense_min_kept,
    DENSE: tl.constexpr,
    MAX_LEVEL: tl.constexpr,
    FIRST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_h = tl.program_id(0)  # fastest: the programs of one column block share its G tiles in L2
    pid_v = tl.program_id(1)
    kept = tl.load(counts_ptr + pid_v)
    n_row_tiles = tl.cdiv(n_rows, BLOCK_K)
    # Each column block runs in one of the two launches: the listed loop where at most DENSE_LOOP_MIN_KEPT
    # of its row tiles are kept, the dense loop (all row tiles, the skipped ones' loads masked off) where more are.
    if (kept > n_row_tiles * dense_min_kept) == DENSE:
        cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # classes: columns of G, rows of grad_weight
        hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        col_mask = cols < n_cols
        h_mask = hs < hidden
        k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_V, BLOCK_H], dtype=tl.float32)
        bias_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
        if DENSE:
            # pointers stepped by a constant: the GPU pipelines these loads (a listed row index, loaded in
            # the loop, keeps it from doing so: 1.7-1.8x cuBLAS per tile against 1.04-1.16x here, H200)
            g_ptrs = grad_ptr + k[None, :].to(tl.int64) * grad_stride + cols[:, None]  # G^T: [BLOCK_V, BLOCK_K]
            x_ptrs = x_ptr + k[:, None].to(tl.int64) * x_stride + hs[None, :]
            for r in range(0, n_row_tiles):
                # a skipped tile's rows are all masked: nothing loaded, its zeros add nothing
                state = tl.load(kept_ptr + pid_v * tile_stride + r)
                k_limit = tl.where(state != 0, n_rows - r * BLOCK_K, 0)
                k_mask = k < k_limit
                gt = tl.load(g_ptrs, mask=k_mask[None, :] & col_mask[:, None], other=0.0)
                if MAX_LEVEL:  # a rescued tile (1 + L) counts 2^L times: exact
                    factor = tl.where(state > 1, 1 << (state.to(tl.int32) - 1), 1)
                    # fp32 where the products are (the interpreter's bf16 arithmetic is wrong, as its tl.dot)
                    gt = gt.to(tl.float32) * factor if IEEE else gt * factor.to(gt.dtype)
                if HAS_WEIGHT:
                    x = tl.load(x_ptrs, mask=k_mask[:, None] & h_mask[None, :], other=0.0)
                    acc = _accumulate(gt, x, acc, IEEE)
                if HAS_BIAS:
                    bias_acc += tl.sum(gt.to(tl.float32), axis=1)
                g_ptrs += BLOCK_K * grad_stride
                x_ptrs += BLOCK_K * x_stride
        else:
            listed = tiles_ptr + pid_v * tile_stride
            first_kept = 0
            if MAX_LEVEL:  # (without a rescue no loop at all, not one of no trips)
                # the rescued tiles, listed first by descending level, the sum doubled after each level: level L's
                # counted 2^L times (exact)
                for i in range(MAX_LEVEL):
                    level_end = tl.load(ends_ptr + pid_v * MAX_LEVEL + i)
                    acc, bias_acc = _pointer_loop(
                        grad_ptr, grad_stride, x_ptr, x_stride, listed, first_kept, level_end, acc, bias_acc, cols,
                        hs, k, col_mask, h_mask, n_rows, HAS_WEIGHT, HAS_BIAS, IEEE, BLOCK_K,
                    )  # fmt: skip
                    acc = acc * 2.0
                    bias_acc = bias_acc * 2.0
                    first_kept = level_end
            acc, bias_acc = _pointer_loop(
                grad_ptr, grad_stride, x_ptr, x_stride, listed, first_kept, kept, acc, bias_acc, cols, hs, k,
                col_mask, h_mask, n_rows, HAS_WEIGHT, HAS_BIAS, IEEE, BLOCK_K,
            )  # fmt: skip
        _store_block(
            acc, bias_acc, out_ptr, out_stride, bias_ptr, cols, hs, col_mask, h_mask, kept, pid_h, FIRST, HAS_WEIGHT,
            HAS_BIAS,
        )  # fmt: skip


@triton.jit
def _pointer_loop(
    grad_ptr, grad_stride, x_ptr, x_stride, listed, begin, end, acc, bias_acc, cols, hs, k, col_mask, h_mask, n_rows,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``acc``, ``bias_acc`` plus the listed row tiles ``begin`` to ``end``, through pointers."""
    for i in range(begin, end):
        rows = tl.load(listed + i).to(tl.int64) * BLOCK_K + k
        row_mask = rows < n_rows
        gt = tl.load(grad_ptr + rows[None, :] * grad_stride + cols[:, None], mask=row_mask[None, :] & col_mask[:, None],
                     other=0.0)  # fmt: skip
        if HAS_WEIGHT:
            x = tl.load(x_ptr + rows[:, None] * x_stride + hs[None, :], mask=row_mask[:, None] & h_mask[None, :],
                        other=0.0)  # fmt: skip
            acc = _accumulate(gt, x, acc, IEEE)
        if HAS_BIAS:
            bias_acc += tl.sum(gt.to(tl.float32), axis=1)
    return acc, bias_acc


@triton.jit
def _listed_tma_kernel(
    grad_desc,
    x_desc,
    tiles_ptr,
    tile_stride,
    counts_ptr,
    ends_ptr,
    out_ptr,
    out_stride,
    bias_ptr,
    n_cols,
    hidden,
    MAX_LEVEL: tl.constexpr,
    FIRST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid_h = tl.program_id(0)  # fastest: the programs of one column block share its G tiles in L2
    pid_v = tl.program_id(1)
    kept = tl.load(counts_ptr + pid_v)
    listed = tiles_ptr + pid_v * tile_stride
    acc = tl.zeros([BLOCK_V, BLOCK_H], dtype=tl.float32)
    bias_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    # the next tile's row read one iteration ahead: a TMA load whose offset comes from a load in the same
    # iteration does not pipeline (1.4x cuBLAS per tile against 1.01x, H200)
    next_tile = tl.load(listed, mask=kept > 0, other=0)
    first_kept = 0
    if MAX_LEVEL:  # (without a rescue no loop at all, not one of no trips: the kept tiles' loop as it was)
        # the rescued tiles, listed first by descending level, the sum doubled after each level: level L's counted
        # 2^L times (exact)
        for level in range(MAX_LEVEL):
            level_end = tl.load(ends_ptr + pid_v * MAX_LEVEL + level)
            # a level without tiles skips its loop: an empty pipelined loop still costs its fill and drain (four
            # of them 0.17 ms a call at 16384x1024x131072, H200; results/2026-12-03-h200-filter-tiles/rescue_probe.log)
            if level_end > first_kept:
                for i in tl.range(first_kept, level_end, num_stages=STAGES):
                    next_tile, acc, bias_acc = _tma_step(
                        grad_desc, x_desc, listed, i, kept, next_tile, acc, bias_acc, pid_v, pid_h, HAS_WEIGHT,
                        HAS_BIAS, IEEE, BLOCK_V, BLOCK_H, BLOCK_K,
                    )  # fmt: skip
            acc = acc * 2.0
            bias_acc = bias_acc * 2.0
            first_kept = level_end
    for i in tl.range(first_kept, kept, num_stages=STAGES):
        next_tile, acc, bias_acc = _tma_step(
            grad_desc, x_desc, listed, i, kept, next_tile, acc, bias_acc, pid_v, pid_h, HAS_WEIGHT, HAS_BIAS, IEEE,
            BLOCK_V, BLOCK_H, BLOCK_K,
        )  # fmt: skip
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    _store_block(
        acc, bias_acc, out_ptr, out_stride, bias_ptr, cols, hs, cols < n_cols, hs < hidden, kept, pid_h, FIRST,
        HAS_WEIGHT, HAS_BIAS,
    )  # fmt: skip


@triton.jit
def _tma_step(
    grad_desc, x_desc, listed, i, kept, next_tile, acc, bias_acc, pid_v, pid_h, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Listed tile ``i`` (its row tile ``next_tile``, read the iteration before) into ``acc`` and ``bias_acc``;
    the next tile's row read."""
    row = next_tile * BLOCK_K
    next_tile = tl.load(listed + i + 1, mask=i + 1 < kept, other=0)
    g = grad_desc.load([row, pid_v * BLOCK_V])  # [BLOCK_K, BLOCK_V]; rows and columns past the end read 0
    if HAS_WEIGHT:
        acc = _accumulate(tl.trans(g), x_desc.load([row, pid_h * BLOCK_H]), acc, IEEE)
    if HAS_BIAS:
        bias_acc += tl.sum(g.to(tl.float32), axis=0)
    return next_tile, acc, bias_acc


@triton.jit
def _store_block(
    acc, bias_acc, out_ptr, out_stride, bias_ptr, cols, hs, col_mask, h_mask, kept, pid_h,
    FIRST: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """A program's block of grad_weight written (the first chunk) or added to (where a tile was kept), and its
    classes' grad_bias added to by the first hidden block."""
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


class FlaggedTiles:
    """A chunk's flagged tiles, counted with the rescue's expected share of the others and on their way to the
    host: :func:`flag_tiles`."""

    __slots__ = ("n_rows", "n_cols", "rescue", "_count", "_units")

    def __init__(self, n_rows: int, n_cols: int, rescue: int, count: HostRead | None) -> None:
        self.n_rows, self.n_cols, self.rescue, self._count = n_rows, n_cols, rescue, count
        self._units: int | None = None

    def _tiles(self) -> tuple[int, float] | None:
        """(all tiles, tiles expected multiplied), read once; None where nothing was counted."""
        if self._count is None:
            return None
        if self._units is None:
            self._units = int(self._count.wait()[0])
        total = triton.cdiv(self.n_rows, FILTER_ROWS) * triton.cdiv(self.n_cols, FILTER_COLS)
        return total, self._units / 2 ** rescue_max_level(self.rescue)

    def dense_is_faster(self, all_kept_cost: float) -> bool:
        """Whether cuBLAS's dense GEMM beats the kernel: decided on the flagged tiles and the rescue's expected
        2^-L of each other one, not on the tiles the hash draws (the rescue stays unbiased: the dense product is
        the expectation it estimates). False (the kernel) where nothing was counted (a CUDA graph being captured)."""
        tiles = self._tiles()
        return tiles is not None and tiles[1] * all_kept_cost >= tiles[0]


def flag_tiles(
    scratch: FilterScratch, n_rows: int, n_cols: int, *, rescue: int | None = None, count: bool = True
) -> FlaggedTiles:
    """Which tiles of an ``[n_rows, n_cols]`` slab of dL/dlogits the flags keep (``scratch.kept``: 1, else 0, or
    with ``rescue`` 1 + the tile's level) and, with ``count``, the tiles the kernel is expected to multiply, in
    units of 2^-max level (each flagged one 1, each other one 2^-L), queued for the host (no sync; none while a
    CUDA graph is captured).

    Queue it as soon as the CE finish has written the flags and hand the result to :func:`filtered_weight_grad`
    after the grad_input GEMM is queued: the host waits for the count while the GPU runs that GEMM."""
    flags, _, _, kept, _ = scratch
    row_tiles, col_blocks = triton.cdiv(n_rows, FILTER_ROWS), triton.cdiv(n_cols, FILTER_COLS)
    max_level = rescue_max_level(rescue)
    _launch_tile_flags(scratch, None, n_rows, col_blocks, max_level)
    counted = None
    if count and not capturing(flags.device):
        states = kept[:col_blocks, :row_tiles]
        # state 1 + L (1 where flagged) is expected 2^-L of a multiplication: 2^(max level - L) units
        counted = (
            states.sum(dtype=torch.int64) if not max_level else (1 << (max_level + 1 - states.long())).sum()
        ).reshape(1)
    return FlaggedTiles(n_rows, n_cols, rescue or 0, None if counted is None else HostRead(counted, "filter count"))


def _launch_tile_flags(
    scratch: FilterScratch, x_chunk: torch.Tensor | None, n_rows: int, col_blocks: int, max_level: int
) -> None:
    """``scratch.kept`` from the flags (with a rescue's ``max_level``, the levels; with ``x_chunk``, its hash's
    picks)."""
    flags, _, _, kept, _ = scratch
    x = flags if x_chunk is None else x_chunk  # not read without the hash
    _tile_flags_kernel[(triton.cdiv(n_rows, FILTER_ROWS), triton.cdiv(col_blocks, _FLAG_BLOCKS))](
        flags, flags.stride(0), kept, kept.stride(0), x, x.stride(0), x.shape[1], n_rows, col_blocks,
        BLOCK_K=FILTER_ROWS, BLOCK_C=_FLAG_BLOCKS, MAX_LEVEL=max_level, HASH=x_chunk is not None, **_HASH_ARGS,
    )  # fmt: skip


def _rescued_count(level_ends: torch.Tensor, col_blocks: int, max_level: int) -> torch.Tensor:
    """How many tiles the rescue kept (a 0-dim tensor): the end of the last level's in each column block's list."""
    if not max_level:
        return level_ends.new_zeros(())
    return level_ends[: col_blocks * max_level].view(col_blocks, max_level)[:, -1].sum()


@triton.jit
def _accumulate(gt, x, acc, IEEE: tl.constexpr):
    """``acc + gt @ x`` (``gt`` a [BLOCK_V, BLOCK_K] tile of G^T)."""
    if IEEE:
        # fp32 products, as cuBLAS gives torch's fp32 matmul (no TF32); also bf16/fp16 operands under
        # the interpreter, whose low-precision tl.dot is wrong (exact there: the products fit fp32)
        return tl.dot(gt.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(gt, x, acc)


def filtered_weight_grad(
    grad_weight: torch.Tensor | None,
    grad: torch.Tensor,
    x_chunk: torch.Tensor,
    scratch: FilterScratch,
    *,
    first: bool,
    grad_bias: torch.Tensor | None = None,
    rescue: int | None = None,
    dense_fallback: bool = True,
    flagged: FlaggedTiles | None = None,
) -> bool:
    """``grad_weight (+)= G.T @ x_chunk`` and ``grad_bias += G.sum(0)`` over the flagged tiles of ``G``, plus,
    with ``rescue`` N, each other one with probability 2^-L (chosen by a hash of ``x_chunk``; L its level, at most
    log2(N): :mod:`flce_policy.plan.weight_filter`), counted 2^L times.

    ``grad [n, C]`` (a slab of dL/dlogits), ``x_chunk [n, H]``, ``grad_weight [C, H]`` (any float dtype,
    row-contiguous; ``first`` overwrites it; None: grad_bias only), ``grad_bias [C]`` fp32, ``scratch``
    holding the flags the finish kernel wrote for ``grad``. Accumulates in fp32 and rounds once per call
    into ``grad_weight``.

    With ``dense_fallback`` (one host read of the kept count), where so many tiles are kept that the kernel would
    be slower than cuBLAS (``ALL_KEPT_COST`` of :mod:`flce_policy.plan.weight_filter`), every tile is multiplied
    by the dense path's GEMM instead: the dense call's grad_weight and grad_bias exactly (nothing skipped, nothing
    rescued). Returns whether it did. ``flagged``: :func:`flag_tiles`'s result for ``grad``, queued earlier so
    that the host read overlaps other work (without it the flags are read here, a wait for the GPU's queue).
    """
    n_rows, n_cols = grad.shape
    col_blocks = triton.cdiv(n_cols, FILTER_COLS)
    _, tiles, counts, kept, level_ends = scratch
    row_tiles = triton.cdiv(n_rows, FILTER_ROWS)
    rescue = rescue or 0
    max_level = rescue_max_level(rescue)
    if flagged is None:
        flagged = flag_tiles(scratch, n_rows, n_cols, rescue=rescue, count=dense_fallback)
    elif (flagged.n_rows, flagged.n_cols, flagged.rescue) != (n_rows, n_cols, rescue):
        raise ValueError(
            f"tiles flagged for a {flagged.n_rows}x{flagged.n_cols} slab with rescue {flagged.rescue or None}, not "
            f"this {n_rows}x{n_cols} one with rescue {rescue or None}"
        )
    hidden = x_chunk.shape[1] if grad_weight is not None else 1
    tma = tma_tensors(grad, x_chunk)
    narrow = hidden % _TMA_LAUNCH[0] != 0
    launch = ("tma_narrow" if narrow else "tma") if tma else "pointer"
    total = col_blocks * row_tiles
    dense = dense_fallback and flagged.dense_is_faster(ALL_KEPT_COST[launch])
    if not dense:
        if rescue:  # the kept tiles again, now with the rescue's (the hash reads x_chunk, final only now)
            _launch_tile_flags(scratch, x_chunk, n_rows, col_blocks, max_level)
        _list_tiles_kernel[(col_blocks,)](
            kept, tiles, tiles.stride(0), counts, level_ends, row_tiles, ROW_TILES=triton.next_power_of_2(row_tiles),
            MAX_LEVEL=max_level,
        )  # fmt: skip
    if dense:
        count_unfiltered(n_rows, n_cols, grad.device)
    elif _observers:
        count = TileCount(counts[:col_blocks].sum(), total, _rescued_count(level_ends, col_blocks, max_level))
        for observer in _observers:
            observer.append(count)
    if dense:
        if grad_weight is not None:
            accumulate_mm(grad_weight, grad.t(), x_chunk, first=first)
        if grad_bias is not None:
            grad_bias += grad.sum(dim=0, dtype=torch.float32)
        return True
    launch_args = dict(
        MAX_LEVEL=max_level,
        FIRST=first,
        HAS_WEIGHT=grad_weight is not None,
        HAS_BIAS=grad_bias is not None,
        IEEE=grad.dtype == torch.float32 or KERNELS_INTERPRETED,
        BLOCK_V=FILTER_COLS,
        BLOCK_K=FILTER_ROWS,
    )
    if tma:
        block_h, num_warps, num_stages = _TMA_LAUNCH_NARROW if narrow else _TMA_LAUNCH
        block_h = min(block_h, max(16, triton.next_power_of_2(hidden)))
        _listed_tma_kernel[(triton.cdiv(hidden, block_h), col_blocks)](
            TensorDescriptor.from_tensor(grad, [FILTER_ROWS, FILTER_COLS]),
            TensorDescriptor.from_tensor(x_chunk, [FILTER_ROWS, block_h]),
            tiles,
            tiles.stride(0),
            counts,
            level_ends,
            grad_weight,
            0 if grad_weight is None else grad_weight.stride(0),
            grad_bias,
            n_cols,
            hidden,
            **launch_args,
            BLOCK_H=block_h,
            STAGES=num_stages,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        return False
    for dense_loop, (block_h, num_warps, num_stages) in _LAUNCHES.items():
        block_h = min(block_h, max(16, triton.next_power_of_2(hidden)))
        _filtered_weight_grad_kernel[(triton.cdiv(hidden, block_h), col_blocks)](
            grad,
            grad.stride(0),
            x_chunk,
            x_chunk.stride(0),
            tiles,
            tiles.stride(0),
            counts,
            level_ends,
            kept,
            grad_weight,
            0 if grad_weight is None else grad_weight.stride(0),
            grad_bias,
            n_rows,
            n_cols,
            hidden,
            DENSE_LOOP_MIN_KEPT,
            DENSE=dense_loop,
            **launch_args,
            BLOCK_H=block_h,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    return False
