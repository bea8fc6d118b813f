"""Row-wise cross-entropy over a logits slab, with dL/dlogits written back into the slab.

A slab holds one vocab tile (columns ``col_offset ...`` of V; the whole vocabulary for row-only
geometry). Each row of a tile is split into column segments so that few-row chunks still give the
GPU enough programs; every (tile, segment) owns one partial slot of the row. Two launches:

1. ``_ce_partial_kernel`` (one program per row and segment of a tile) walks its segment in
   ``BLOCK_V`` blocks keeping an online log-sum-exp (running max ``m`` and ``d = sum(exp(z - m))``,
   rescaled when the max grows), the label-smoothing sums, the argmax and, in the segment holding
   the target, the target logit, and stores them in its slot.
2. ``_ce_finish_kernel`` (per tile, same grid) merges all of the row's slots into ``lse``, writes
   the row's loss (first tile, segment 0), and overwrites its segment with the gradient (with a
   grad_weight filter, also the row's skip flags: :mod:`flce_policy.kernels.weight_grad_filter`). All maths
   in fp32. Nothing in (2) reads a logit outside its own segment, since other programs overwrite
   theirs. Vocab-tiled geometry runs (1) over every tile, then (2) over every tile recomputed.

Notation: ``x`` the raw logit, ``z = softcap * tanh(x / softcap)`` (or ``z = x``), ``p = softmax(z)``,
``w`` the class weights (1 without), ``W = sum_c w_c``, ``eps`` label smoothing, ``y`` the target.
With ``ENTROPY`` the partial pass also keeps ``s = sum(exp(z - m) * z)``, rescaled and merged like ``d``,
and the finish kernel writes each row's entropy ``lse - s / d`` (of ``softmax(z)``, nothing else).
Per row, matching ``torch.nn.functional.cross_entropy``::

    ce  = (1 - eps) * w_y * (lse - z_y) + eps / V * (W * lse - sum_c w_c z_c)
    zl  = z_loss_scale * lse**2
    dce/dz_c = (1 - eps) * w_y * (p_c - [c == y]) + eps / V * (W * p_c - w_c)
    dzl/dz_c = 2 * z_loss_scale * lse * p_c
    dz/dx    = 1 - (z / softcap)**2
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from flce_policy.plan.scaled_exp import SCALED_EXP_TILE, scaled_exp_slots

from .interpreter import KERNELS_INTERPRETED  # re-exported: where the tests have always imported it from
from .rounding import rounded
from .row_partials import CEWorkspace
from .row_scaled_finish import row_scaled_finish
from .weight_grad_filter import finish_kernel_args, store_flags

if TYPE_CHECKING:
    from .vocab_shard import VocabShard

__all__ = ["KERNELS_INTERPRETED", "CEWorkspace", "ce_finish", "ce_partial", "ce_rows", "ce_workspace"]


#: Widest block a program loads at once (elements).
MAX_BLOCK_V = 4096
#: Programs (rows x segments) a chunk should give the GPU: many waves on 132 SMs (measured on H200:
#: 256 rows x 262144 took 0.127 ms with 2048 programs, 0.123 ms with 8192;
#: results/2026-11-29-h200-kernels-and-calibration/tune256.log).
TARGET_PROGRAMS = 8192
#: Warps per program for blocks of >= 2048 elements (4 below).
WIDE_BLOCK_WARPS = 8
_PARTIALS = 6  # m, d, sum_wz, sum_w, best, z_y (planes 0-5); plane 6, sum(exp(z - m) * z), with entropy=True


def ce_workspace(
    rows: int,
    tile_cols: int,
    device: torch.device,
    *,
    entropy: bool = False,
    scaled_exp: bool = False,
    slot_cols: int = SCALED_EXP_TILE,
) -> CEWorkspace:
    """Segment plan and scratch for chunks of up to ``rows`` rows, in tiles of up to ``tile_cols`` columns.

    ``entropy`` adds the plane of the entropy partial sums. ``scaled_exp``: for a slab of
    :func:`flce_policy.kernels.scaled_exp.scaled_exp_logits` (one slot per column tile of its GEMM, of
    ``slot_cols`` columns; one finish program per row: each merges the row's slots once).
    """
    block_v = min(triton.next_power_of_2(tile_cols), MAX_BLOCK_V)
    blocks = triton.cdiv(tile_cols, block_v)
    planes = _PARTIALS + 1 if entropy else _PARTIALS
    if scaled_exp:
        segments, segment_len, slots = 1, blocks * block_v, scaled_exp_slots(tile_cols, slot_cols)
    else:
        # Each segment keeps >= 2 blocks so its loop still pipelines loads.
        wanted = triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, rows))
        segments = max(1, min(wanted, 1 << ((blocks // 2).bit_length() - 1) if blocks >= 2 else 1))
        segment_len = triton.cdiv(blocks, segments) * block_v
        slots = triton.next_power_of_2(segments)
    # No fill (four launches per call): the finish kernel reads the padding slots as neutral.
    partials = torch.empty((planes, rows, slots), dtype=torch.float32, device=device)
    best_index = torch.empty((rows, slots), dtype=torch.int32, device=device)
    if not scaled_exp:
        return CEWorkspace(block_v, segments, segment_len, slots, partials, best_index)
    target_coef, row_shift, row_scale = torch.empty((3, rows), dtype=torch.float32, device=device)
    redo = torch.empty(1, dtype=torch.int32, device=device)
    return CEWorkspace(
        block_v, segments, segment_len, slots, partials, best_index, slot_cols, target_coef, row_shift,
        row_scale, redo,
    )  # fmt: skip


@triton.jit
def _tanh(x):
    # tanh(x) = 2 * sigmoid(2x) - 1: portable across Triton versions (and the interpreter), exact
    # limits at +-inf. Near 0 that form cancels (1e-5 relative at x = 0.01): the odd series instead,
    # whose first omitted term is below 3e-10 relative for |x| < 1/8.
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(tl.abs(x) < 0.125, series, 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0)


@triton.jit
def _softcap_zt(x, softcap, dtype: tl.constexpr, ROUND_SOFTCAP: tl.constexpr):
    """``(z, t)``: ``z = softcap * t``, ``t = tanh(x / softcap)``, for fp32 ``x``.

    With ``ROUND_SOFTCAP`` each op is rounded to ``dtype`` as eager PyTorch rounds
    ``softcap * tanh(logits / softcap)`` on ``dtype`` logits (the division by a Python scalar is a
    multiplication by its fp32 reciprocal on CUDA); else all in fp32. The finish kernel rounds the
    backward of those ops the same way (CUDA's ``tanh_backward`` also rounds inside ``1 - t * t``).
    """
    if ROUND_SOFTCAP:
        t = rounded(_tanh(rounded(x * (1.0 / softcap), dtype)), dtype)
        z = rounded(t * softcap, dtype)
    else:
        t = _tanh(x / softcap)
        z = softcap * t
    return z, t


@triton.jit
def _load_z(row_ptr, offs, mask, softcap, HAS_SOFTCAP: tl.constexpr, ROUND_SOFTCAP: tl.constexpr):
    z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z, _ = _softcap_zt(z, softcap, row_ptr.dtype.element_ty, ROUND_SOFTCAP)
    return z


@triton.jit
def _ce_partial_kernel(
    logits_ptr,
    row_stride,
    target_ptr,
    class_weight_ptr,
    partials_ptr,
    best_index_ptr,
    plane,
    n_cols,
    col_offset,
    segment_len,
    ignore_index,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ROUND_SOFTCAP: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    MERGE: tl.constexpr,
    ENTROPY: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    # row * row_stride can pass 2**31 elements (V=262144, 8192+ rows): keep it 64-bit.
    row_ptr = logits_ptr + row * row_stride
    target = tl.load(target_ptr + row)
    if target != ignore_index:
        local_target = target - col_offset
        cols = tl.arange(0, BLOCK_V)
        col_start = segment * segment_len
        col_stop = tl.minimum(col_start + segment_len, n_cols)
        m = -float("inf")
        d = 0.0
        sum_wz = 0.0
        sum_w = 0.0
        best = -float("inf")
        best_idx = 0
        s = 0.0
        for start in range(col_start, col_stop, BLOCK_V):
            offs = start + cols
            mask = offs < col_stop
            z = _load_z(row_ptr, offs, mask, softcap, HAS_SOFTCAP, ROUND_SOFTCAP)
            if HAS_SMOOTHING:
                # masked lanes hold 0 here (softcap(0) == 0), so they add nothing to the sums
                if HAS_WEIGHT:
                    w = tl.load(class_weight_ptr + col_offset + offs, mask=mask, other=0.0)
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
                    best_idx = col_offset + start + block_idx
            m_new = tl.maximum(m, block_max)
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            if ENTROPY:
                # masked lanes hold z = -inf, and exp(z - m) = 0: their z is taken as 0, not -inf (0 * -inf = nan)
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new) * tl.where(mask, z, 0.0), axis=0)
            m = m_new
        slot = row * NUM_SLOTS + segment
        if MERGE:
            # Fold in the same segment of the earlier tiles (lower columns); an empty side has
            # m = -inf and d = 0, and must not turn into exp(-inf - -inf) = nan.
            m_old = tl.load(partials_ptr + slot)
            d_old = tl.load(partials_ptr + plane + slot)
            m_new = tl.maximum(m_old, m)
            m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
            d = d_old * tl.exp(m_old - m_ref) + d * tl.exp(m - m_ref)
            if ENTROPY:
                s = tl.load(partials_ptr + 6 * plane + slot) * tl.exp(m_old - m_ref) + s * tl.exp(m - m_ref)
            m = m_new
            sum_wz += tl.load(partials_ptr + 2 * plane + slot)
            sum_w += tl.load(partials_ptr + 3 * plane + slot)
            if TRACK_ARGMAX:
                best_old = tl.load(partials_ptr + 4 * plane + slot)
                best_idx_old = tl.load(best_index_ptr + slot)
                # the earlier tiles hold lower columns: they keep a tie, as torch.argmax does
                take_old = best_old >= best
                best_idx = tl.where(take_old, best_idx_old, best_idx)
                best = tl.where(take_old, best_old, best)
        if (local_target >= col_start) & (local_target < col_stop):
            # Read the target logit now: the finish kernel overwrites the slab with gradients,
            # and another segment's program may get there before the row's loss is written.
            z_y = _load_z(row_ptr, local_target, True, softcap, HAS_SOFTCAP, ROUND_SOFTCAP)
            tl.store(partials_ptr + 5 * plane + row * NUM_SLOTS, z_y)
        tl.store(partials_ptr + slot, m)
        tl.store(partials_ptr + plane + slot, d)
        tl.store(partials_ptr + 2 * plane + slot, sum_wz)
        tl.store(partials_ptr + 3 * plane + slot, sum_w)
        if TRACK_ARGMAX:
            tl.store(partials_ptr + 4 * plane + slot, best)
            tl.store(best_index_ptr + slot, best_idx)
        if ENTROPY:
            tl.store(partials_ptr + 6 * plane + slot, s)


@triton.jit
def _ce_finish_kernel(
    logits_ptr,
    row_stride,
    target_ptr,
    class_weight_ptr,
    partials_ptr,
    best_index_ptr,
    plane,
    scale_ptr,
    loss_ptr,
    z_loss_ptr,
    argmax_ptr,
    n_cols,
    col_offset,
    vocab,
    segment_len,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss_scale,
    num_segments,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ROUND_SOFTCAP: tl.constexpr,
    TANH_GRAD_PER_OP: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    WRITE_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    SCALE_PER_ROW: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    entropy_ptr=None,
    ENTROPY: tl.constexpr = False,
    flags_ptr=None,
    flag_row_stride=0,
    filter_log_eps=0.0,
    filter_log2_eps=0.0,
    FILTER: tl.constexpr = False,
    FLAG_GROUPS: tl.constexpr = 1,
    FLAG_COLS: tl.constexpr = 128,
    SCALED_EXP_TILE: tl.constexpr = 0,
    target_coef_ptr=None,
    row_scale_ptr=None,
    redo_ptr=None,
    REDO_ONLY: tl.constexpr = False,
):
    if REDO_ONLY:  # the per-tile pass of a row-scaled chunk: only where the GEMM flagged the chunk
        if tl.load(redo_ptr) == 0:
            return
    # Walk the programs in the reverse of the partial kernel's order: the segments it read last
    # are the ones still in L2, so the second read of the slab starts with cache hits.
    row = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)
    segment = tl.num_programs(1) - 1 - tl.program_id(1)
    row_ptr = logits_ptr + row * row_stride
    target = tl.load(target_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    col_start = segment * segment_len
    col_stop = tl.minimum(col_start + segment_len, n_cols)

    if target == ignore_index:
        if WRITE_LOSS and segment == 0:
            tl.store(loss_ptr + row, 0.0)
            if HAS_Z_LOSS:
                tl.store(z_loss_ptr + row, 0.0)
            if TRACK_ARGMAX:
                tl.store(argmax_ptr + row, -1)
            if ENTROPY:
                tl.store(entropy_ptr + row, 0.0)
        if WRITE_GRAD:
            if SCALED_EXP_TILE and segment == 0:
                tl.store(target_coef_ptr + row, 0.0)
                if row_scale_ptr is not None:
                    tl.store(row_scale_ptr + row, 0.0)
            for start in range(col_start, col_stop, BLOCK_V):
                offs = start + cols
                zero = tl.zeros([BLOCK_V], dtype=row_ptr.dtype.element_ty)
                tl.store(row_ptr + offs, zero, mask=offs < col_stop)
                if FILTER:  # an ignored row's gradient is 0: nothing of it reaches grad_weight
                    keep = tl.zeros([BLOCK_V], dtype=tl.int32)
                    nothing = tl.full([BLOCK_V], -float("inf"), dtype=tl.float32)
                    store_flags(
                        flags_ptr + row * flag_row_stride, keep, nothing, filter_log2_eps, start, col_stop, BLOCK_V,
                        FLAG_GROUPS, FLAG_COLS, LOG_STRENGTH=True,
                    )  # fmt: skip
    else:
        local_target = target - col_offset
        # Merge the row's partial log-sum-exps: lse = M + log(sum_s d_s * exp(m_s - M)).
        # Slots past num_segments pad NUM_SLOTS to a power of two and are never written: read as neutral.
        live = tl.arange(0, NUM_SLOTS) < num_segments
        slots = row * NUM_SLOTS + tl.arange(0, NUM_SLOTS)
        m_s = tl.load(partials_ptr + slots, mask=live, other=-float("inf"))
        d_s = tl.load(partials_ptr + plane + slots, mask=live, other=0.0)
        m = tl.max(m_s, axis=0)
        lse = m + tl.log(tl.sum(d_s * tl.exp(m_s - m), axis=0))

        w_y = 1.0
        sum_w = vocab * 1.0
        if HAS_WEIGHT:
            w_y = tl.load(class_weight_ptr + target)
            if HAS_SMOOTHING:
                sum_w = tl.sum(tl.load(partials_ptr + 3 * plane + slots, mask=live, other=0.0), axis=0)
        eps_over_v = label_smoothing / vocab
        z_y = tl.load(partials_ptr + 5 * plane + row * NUM_SLOTS)
        # Token scaling: the row's whole loss, and so its gradient, times the detached p_y.
        token_scale = 1.0
        if TOKEN_SCALING:
            token_scale = tl.exp(z_y - lse)

        if WRITE_LOSS and segment == 0:
            ce = (1.0 - label_smoothing) * w_y * (lse - z_y)
            if HAS_SMOOTHING:
                sum_wz = tl.sum(tl.load(partials_ptr + 2 * plane + slots, mask=live, other=0.0), axis=0)
                ce += eps_over_v * (sum_w * lse - sum_wz)
            tl.store(loss_ptr + row, ce * token_scale)
            if HAS_Z_LOSS:
                tl.store(z_loss_ptr + row, z_loss_scale * lse * lse * token_scale)
            if TRACK_ARGMAX:
                best_s = tl.load(partials_ptr + 4 * plane + slots, mask=live, other=-float("inf"))
                # the lowest column among the slots holding the maximum, as torch.argmax picks
                best_i = tl.load(best_index_ptr + slots, mask=live, other=0)
                idx = tl.min(tl.where(best_s == tl.max(best_s, axis=0), best_i, vocab), axis=0)
                tl.store(argmax_ptr + row, idx.to(tl.int64))
            if ENTROPY:
                # entropy = lse - sum_c p_c z_c, both sums merged over the slots as lse's is
                rescale = tl.exp(m_s - m)
                d_all = tl.sum(d_s * rescale, axis=0)
                s_all = tl.sum(tl.load(partials_ptr + 6 * plane + slots, mask=live, other=0.0) * rescale, axis=0)
                tl.store(entropy_ptr + row, lse - s_all / d_all)

        if WRITE_GRAD:
            if SCALE_PER_ROW:
                scale_ce = tl.load(scale_ptr + row)
                scale_z = scale_ce
            else:
                scale_ce = tl.load(scale_ptr)
                scale_z = tl.load(scale_ptr + 1)
            scale_ce *= token_scale
            scale_z *= token_scale
            coef_p = scale_ce * ((1.0 - label_smoothing) * w_y + eps_over_v * sum_w)
            if HAS_Z_LOSS:
                coef_p += scale_z * 2.0 * z_loss_scale * lse
            coef_y = scale_ce * (1.0 - label_smoothing) * w_y
            if SCALED_EXP_TILE:
                tl.static_assert(not HAS_SOFTCAP, "the scaled-exp slab is not softcapped")
                filter_eps = tl.exp(filter_log_eps)
                # The target's -coef_y is left out of the slab and applied by the driver in fp32: rounded into
                # the slab, that entry (~ -1 on unconfident rows) carries most of a bf16 gradient's error.
                if segment == 0:
                    tl.store(target_coef_ptr + row, coef_y)
                    if row_scale_ptr is not None:  # a redone chunk: the slab will hold the gradient itself
                        tl.store(row_scale_ptr + row, 1.0)
                coef_y = 0.0
            for start in range(col_start, col_stop, BLOCK_V):
                offs = start + cols
                mask = offs < col_stop
                if SCALED_EXP_TILE:
                    # the slab holds exp(z - m) of each column tile: p = that * exp(m - lse)
                    m_tile = tl.load(partials_ptr + row * NUM_SLOTS + offs // SCALED_EXP_TILE, mask=mask, other=0.0)
                    p = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.exp(m_tile - lse)
                else:
                    z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                    if HAS_SOFTCAP:
                        z, t = _softcap_zt(z, softcap, row_ptr.dtype.element_ty, ROUND_SOFTCAP)
                    p = tl.exp(z - lse)
                grad = coef_p * p
                grad = tl.where(offs == local_target, grad - coef_y, grad)
                if FILTER:
                    # The skip rule reads the per-token |p_c - [c == y]|, before every scale of the row (the
                    # reduction's, grad_output, class weight, token scaling, z-loss, smoothing, softcap's
                    # chain rule); the target's column always counts. Off the target |p_c - 0| >= eps is
                    # z_c - lse >= log(eps): a compare, not a second exp per element.
                    if SCALED_EXP_TILE:
                        keep = ((p >= filter_eps) | (offs == local_target)) & mask
                        strength = tl.where(mask, p, 0.0)
                    else:
                        keep = ((z - lse >= filter_log_eps) | (offs == local_target)) & mask
                        strength = tl.where(mask, z - lse, -float("inf"))
                    store_flags(
                        flags_ptr + row * flag_row_stride, keep, strength, filter_log2_eps, start, col_stop,
                        BLOCK_V, FLAG_GROUPS, FLAG_COLS, LOG_STRENGTH=SCALED_EXP_TILE == 0,
                    )  # fmt: skip
                if HAS_SMOOTHING:
                    if HAS_WEIGHT:
                        w = tl.load(class_weight_ptr + col_offset + offs, mask=mask, other=0.0)
                        grad -= scale_ce * eps_over_v * w
                    else:
                        grad -= scale_ce * eps_over_v
                if HAS_SOFTCAP:
                    if ROUND_SOFTCAP:
                        # eager autograd's backward of the three ops, each result rounded: the fp32
                        # gradient cast to the logits' dtype, times softcap, tanh's backward on the
                        # rounded t, times 1/softcap
                        dtype = row_ptr.dtype.element_ty
                        if TANH_GRAD_PER_OP:  # CUDA's tanh_backward: a * (1 - b * b) in the dtype, op by op
                            dtanh = rounded(1.0 - rounded(t * t, dtype), dtype)
                        else:  # the CPU's: in fp32
                            dtanh = 1.0 - t * t
                        grad = rounded(rounded(rounded(grad, dtype) * softcap, dtype) * dtanh, dtype)
                        grad = rounded(grad * (1.0 / softcap), dtype)
                    else:
                        grad = grad * (1.0 - t * t)
                tl.store(row_ptr + offs, grad.to(row_ptr.dtype.element_ty), mask=mask)


def _flags(
    ws: CEWorkspace,
    logits: torch.Tensor,
    class_weight,
    label_smoothing,
    softcap,
    round_softcap: bool,
    track_argmax: bool,
) -> dict:
    return dict(
        HAS_WEIGHT=class_weight is not None,
        HAS_SMOOTHING=label_smoothing > 0.0,
        HAS_SOFTCAP=softcap is not None,
        # fp32 logits: nothing to round, and the fp32 formulas are the same computation
        ROUND_SOFTCAP=softcap is not None and round_softcap and logits.dtype != torch.float32,
        TRACK_ARGMAX=track_argmax,
        NUM_SLOTS=ws.slots,
        BLOCK_V=ws.block_v,
        num_warps=WIDE_BLOCK_WARPS if ws.block_v >= 2048 else 4,
    )


def ce_partial(
    logits: torch.Tensor,
    target: torch.Tensor,
    workspace: CEWorkspace,
    *,
    ignore_index: int,
    col_offset: int = 0,
    first_tile: bool = True,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    round_softcap: bool = False,
    class_weight: torch.Tensor | None = None,
    track_argmax: bool = False,
    entropy: bool = False,
) -> None:
    """Pass 1 over one tile: ``logits [n, tile]`` holds columns ``col_offset ...`` of every row.

    The first tile of a row chunk writes the rows' partials; every later tile merges into them.
    ``entropy`` also keeps the entropy partials (the workspace must have been made with ``entropy=True``).
    """
    n_rows, n_cols = logits.shape
    ws = workspace
    flags = _flags(ws, logits, class_weight, label_smoothing, softcap, round_softcap, track_argmax)
    _ce_partial_kernel[(n_rows, ws.segments_per_tile)](
        logits,
        logits.stride(0),
        target,
        class_weight,
        ws.partials,
        ws.best_index,
        ws.partials.stride(0),
        n_cols,
        col_offset,
        ws.segment_len,
        ignore_index,
        softcap if softcap is not None else 1.0,
        MERGE=not first_tile,
        ENTROPY=entropy,
        **flags,
    )


def ce_finish(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss_rows: torch.Tensor,
    workspace: CEWorkspace,
    *,
    ignore_index: int,
    vocab: int,
    col_offset: int = 0,
    write_loss: bool = True,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    round_softcap: bool = False,
    z_loss_scale: float = 0.0,
    class_weight: torch.Tensor | None = None,
    z_loss_rows: torch.Tensor | None = None,
    argmax_rows: torch.Tensor | None = None,
    token_scaling: bool = False,
    grad_scale: torch.Tensor | None = None,
    scale_per_row: bool = False,
    entropy_rows: torch.Tensor | None = None,
    filter_flags: torch.Tensor | None = None,
    filter_eps: float = 0.0,
    row_scaled: bool = False,
    redo: bool = False,
) -> None:
    """Pass 2 over one tile, after pass 1 saw every tile: the rows' losses and the tile's gradient.

    On a scaled-exp slab of the row-scaled form (:func:`.scaled_exp.scaled_exp_logits`), ``row_scaled`` writes
    each row's gradient scale into the workspace instead of a gradient into the slab; ``redo`` is the per-tile
    pass of such a chunk, run only where its redo flag is set (it writes scales of 1).

    ``entropy_rows`` (fp32, written with the losses) receives each row's entropy in nats, 0 where ignored.
    ``filter_flags`` (uint8 ``[>= n, cdiv(tile, FILTER_COLS)]``, with the gradient only) receives per row
    and ``FILTER_COLS`` columns of the tile a flag byte: ``KEPT_FLAG`` where some ``|p_c - [c == y]| >= filter_eps``
    or the target lies, elsewhere ``KEPT_FLAG`` minus the columns' level below eps (on ignored rows the largest:
    :mod:`flce_policy.kernels.weight_grad_filter`).
    """
    n_rows, n_cols = logits.shape
    ws = workspace
    write_grad = grad_scale is not None
    if row_scaled:  # no pass over the slab, slot-major partials: a kernel over blocks of rows
        row_scaled_finish(
            target,
            loss_rows,
            ws,
            n_cols=n_cols,
            ignore_index=ignore_index,
            write_loss=write_loss,
            z_loss_scale=z_loss_scale,
            class_weight=class_weight,
            z_loss_rows=z_loss_rows,
            argmax_rows=argmax_rows,
            token_scaling=token_scaling,
            grad_scale=grad_scale,
            scale_per_row=scale_per_row,
            entropy_rows=entropy_rows,
            filter_flags=filter_flags,
            filter_eps=filter_eps,
            softcap=softcap,
        )
        return
    # Without a gradient only segment 0 has work (the row's loss): launch one program per row.
    grid = (n_rows, ws.segments_per_tile if write_grad else 1)
    _ce_finish_kernel[grid](
        logits,
        logits.stride(0),
        target,
        class_weight,
        ws.partials,
        ws.best_index,
        ws.partials.stride(0),
        grad_scale,
        loss_rows,
        z_loss_rows,
        argmax_rows,
        n_cols,
        col_offset,
        vocab,
        ws.segment_len,
        ignore_index,
        label_smoothing,
        softcap if softcap is not None else 1.0,
        z_loss_scale,
        # the live slots: the segments', or the scaled-exp GEMM's column tiles
        triton.cdiv(n_cols, ws.scaled_exp_tile) if ws.scaled_exp_tile else ws.segments_per_tile,
        SCALED_EXP_TILE=ws.scaled_exp_tile,
        target_coef_ptr=ws.target_coef,
        row_scale_ptr=ws.row_scale if redo else None,
        redo_ptr=ws.redo if redo else None,
        REDO_ONLY=redo,
        HAS_Z_LOSS=z_loss_rows is not None,
        WRITE_LOSS=write_loss,
        WRITE_GRAD=write_grad,
        SCALE_PER_ROW=scale_per_row,
        TOKEN_SCALING=token_scaling,
        entropy_ptr=entropy_rows,
        ENTROPY=entropy_rows is not None,
        **finish_kernel_args(ws, filter_flags if write_grad else None, filter_eps),
        # eager PyTorch's tanh backward rounds each op on CUDA, not on the CPU (the interpreter's tests)
        TANH_GRAD_PER_OP=logits.is_cuda,
        **_flags(ws, logits, class_weight, label_smoothing, softcap, round_softcap, argmax_rows is not None),
    )


def ce_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss_rows: torch.Tensor,
    workspace: CEWorkspace,
    *,
    ignore_index: int,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    round_softcap: bool = False,
    z_loss_scale: float = 0.0,
    class_weight: torch.Tensor | None = None,
    z_loss_rows: torch.Tensor | None = None,
    argmax_rows: torch.Tensor | None = None,
    token_scaling: bool = False,
    grad_scale: torch.Tensor | None = None,
    scale_per_row: bool = False,
    shard: VocabShard | None = None,
    entropy_rows: torch.Tensor | None = None,
    filter_flags: torch.Tensor | None = None,
    filter_eps: float = 0.0,
    row_scaled: bool = False,
    redo: bool = False,
) -> None:
    """Per-row loss of ``logits [n, V]`` (fp32 into ``loss_rows [n]``); gradient in place when ``grad_scale``.

    The row-only case: one tile spanning V. ``grad_scale`` (fp32, on the device) is
    ``[scale_ce, scale_z]`` or, with ``scale_per_row``, one scale per row: reading it in the kernel
    keeps the mean's denominator off the host. ``round_softcap`` rounds each softcap op (and its
    gradient) to the logits' dtype, as eager PyTorch does. ``z_loss_rows`` receives ``z_loss_scale * lse**2``,
    ``argmax_rows`` (int64) each row's argmax class (-1 where ignored), ``entropy_rows`` (fp32) each row's
    entropy of ``softmax(z)`` (0 where ignored; needs an ``entropy=True`` workspace). ``token_scaling`` multiplies
    each row's loss and gradient by its detached ``p_target``. Nothing is checked here: the driver
    calls it once per chunk. With a ``shard`` (tensor parallel) ``logits`` are this rank's columns
    of the vocabulary: the rows' partials are merged over the group between the two passes, and
    ``class_weight`` is the whole vocabulary's. ``filter_flags``/``filter_eps``, ``row_scaled``/``redo``: see
    :func:`ce_finish`.
    """
    shared = dict(
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        softcap=softcap,
        round_softcap=round_softcap,
        class_weight=class_weight,
    )
    col_offset = 0 if shard is None else shard.start
    track_argmax = argmax_rows is not None
    entropy = entropy_rows is not None
    if not workspace.scaled_exp_tile:  # else the logits GEMM wrote the partials (flce_policy.kernels.scaled_exp)
        ce_partial(
            logits, target, workspace, col_offset=col_offset, track_argmax=track_argmax, entropy=entropy, **shared
        )
    if shard is not None:
        shard.merge(workspace, target, ignore_index, track_argmax)
    ce_finish(
        logits,
        target,
        loss_rows,
        workspace,
        vocab=logits.shape[1] if shard is None else shard.vocab,
        col_offset=col_offset,
        z_loss_scale=z_loss_scale,
        z_loss_rows=z_loss_rows,
        argmax_rows=argmax_rows,
        token_scaling=token_scaling,
        grad_scale=grad_scale,
        scale_per_row=scale_per_row,
        entropy_rows=entropy_rows,
        filter_flags=filter_flags,
        filter_eps=filter_eps,
        row_scaled=row_scaled,
        redo=redo,
        **shared,
    )
