"""The CE finish of a row-scaled chunk (:mod:`.scaled_exp`): each row's loss and gradient scale from its slots.

The row-scaled GEMMs (Triton's and the Gluon one) write each partial plane slot-major: slot ``s`` of row ``r`` at
``s * slot_stride + r``, so that an epilogue's stores coalesce. Read one row at a time, as
:func:`.ce_kernel.ce_finish` reads the per-tile form's row-major slots, every value is a sector of its own: at
4096 rows and 1187 slots (128 columns of V=151936), 60 us per plane against 19 us for the same values row-major
(H200, results/2026-12-02-h200-row-scaled-finish/slot_read_probe.log). Here one program takes ``BLOCK_R`` rows and
walks their slots in ``[BLOCK_S, BLOCK_R]`` blocks, loaded along the rows.

Per row (``m`` its shift, the target logit; ``+inf`` where ignored), as :func:`.ce_kernel.ce_finish` computes it
for other slabs (this form has no bias, label smoothing or vocab shard:
:func:`flce_policy.plan.scaled_exp.row_scaled`)::

    lse = m + log(sum_s d_s)        (every slot's exponentials are referenced to m)
    ce  = w_y * (lse - z_y),  zl = z_loss_scale * lse**2   (times p_y with token scaling)
    f   = coef_p * exp(m - lse)     (the gradient is f * slab, less the target's term coef_y: .target_grad)

With a softcap ``c`` the logits are the capped ones (``z_y`` too, from the GEMM's target kernel) and the slab holds
the derivative ``dz'/dz``; the target's term is ``coef_y`` times its own, ``(1 - z_y / c) (1 + z_y / c)``.

With a grad_weight filter, each ``FLAG_COLS`` columns' flag byte from the GEMM's row maxima of ``exp(z - m)``
(:func:`.weight_grad_filter.flag_codes`), written row-major as :mod:`.weight_grad_filter` reads them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flce_policy.plan.weight_filter import FILTER_COLS

from .row_partials import CEWorkspace
from .weight_grad_filter import eps_logs, flag_codes

__all__ = ["row_scaled_finish"]

#: (rows per program, slots per block, warps): 16 rows side by side are 64 bytes, two whole sectors per slot; 256
#: programs at a 4096-row chunk. The best of 7 with the filter's flags (H200, results/2026-12-02-h200-row-scaled-finish/
#: finish_launch_probe.log: 39 us at 4096 rows x 1187 slots, 76 us at 8192 x 1024, against 40 and 89 for (16, 128,
#: 4)); without a filter all 7 took the host's launch time (28-30 us).
_LAUNCH = (16, 256, 4)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _row_scaled_finish_kernel(
    target_ptr,
    class_weight_ptr,
    partials_ptr,
    best_index_ptr,
    plane,
    slot_stride,
    z_row_stride,
    scale_ptr,
    loss_ptr,
    z_loss_ptr,
    argmax_ptr,
    entropy_ptr,
    target_coef_ptr,
    row_scale_ptr,
    row_shift_ptr,
    flags_ptr,
    flag_row_stride,
    n_rows,
    n_cols,
    num_slots,
    ignore_index,
    z_loss_scale,
    filter_log_eps,
    filter_log2_eps,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr,
    ENTROPY: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    WRITE_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    SCALE_PER_ROW: tl.constexpr,
    FILTER: tl.constexpr,
    SOFTCAP: tl.constexpr,
    GROUPS_PER_SLOT: tl.constexpr,
    FLAG_COLS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_ok, other=ignore_index)
    live = row_ok & (target != ignore_index)
    m = tl.load(row_shift_ptr + rows, mask=row_ok, other=0.0)

    # the rows' sums (and the argmax and entropy partials), slot block by slot block
    d = tl.zeros([BLOCK_R], dtype=tl.float32)
    s_ent = tl.zeros([BLOCK_R], dtype=tl.float32)
    best = tl.full([BLOCK_R], -float("inf"), dtype=tl.float32)
    best_i = tl.full([BLOCK_R], 0, dtype=tl.int32)
    for s0 in range(0, num_slots, BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        at = slots.to(tl.int64)[:, None] * slot_stride + rows[None, :]
        mask = (slots < num_slots)[:, None] & row_ok[None, :]
        d += tl.sum(tl.load(partials_ptr + plane + at, mask=mask, other=0.0), axis=0)
        if WRITE_LOSS and ENTROPY:
            s_ent += tl.sum(tl.load(partials_ptr + 6 * plane + at, mask=mask, other=0.0), axis=0)
        if WRITE_LOSS and TRACK_ARGMAX:
            value = tl.load(partials_ptr + 4 * plane + at, mask=mask, other=-float("inf"))
            index = tl.load(best_index_ptr + at, mask=mask, other=0)
            top = tl.max(value, axis=0)
            # the lowest column among those holding the maximum, as torch.argmax picks
            first = tl.min(tl.where(value == top[None, :], index, n_cols), axis=0)
            best_i = tl.where(top > best, first, tl.where(top == best, tl.minimum(best_i, first), best_i))
            best = tl.maximum(best, top)
    # ignored rows (a +inf shift, no exponentials) get finite stand-ins: every value of theirs is masked below
    d = tl.where(live, d, 1.0)
    m = tl.where(live, m, 0.0)
    lse = m + tl.log(d)

    w_y = 1.0
    if HAS_WEIGHT:
        w_y = tl.load(class_weight_ptr + target, mask=live, other=0.0)
    z_y = tl.load(partials_ptr + 5 * plane + rows.to(tl.int64) * z_row_stride, mask=live, other=0.0)
    token_scale = 1.0
    if TOKEN_SCALING:
        token_scale = tl.exp(z_y - lse)

    if WRITE_LOSS:
        tl.store(loss_ptr + rows, tl.where(live, w_y * (lse - z_y) * token_scale, 0.0), mask=row_ok)
        if HAS_Z_LOSS:
            tl.store(z_loss_ptr + rows, tl.where(live, z_loss_scale * lse * lse * token_scale, 0.0), mask=row_ok)
        if TRACK_ARGMAX:
            tl.store(argmax_ptr + rows, tl.where(live, best_i, -1).to(tl.int64), mask=row_ok)
        if ENTROPY:
            tl.store(entropy_ptr + rows, tl.where(live, lse - s_ent / d, 0.0), mask=row_ok)

    if WRITE_GRAD:
        if SCALE_PER_ROW:
            scale_ce = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
            scale_z = scale_ce
        else:
            scale_ce = tl.load(scale_ptr)
            scale_z = tl.load(scale_ptr + 1)
        scale_ce *= token_scale
        scale_z *= token_scale
        coef_y = scale_ce * w_y
        coef_p = coef_y
        if HAS_Z_LOSS:
            coef_p += scale_z * 2.0 * z_loss_scale * lse
        target_coef = coef_y
        if SOFTCAP:  # 1 - tanh^2 as a product: 1 - t exact by Sterbenz where t is near 1
            target_coef *= (1.0 - z_y / softcap) * (1.0 + z_y / softcap)
        tl.store(target_coef_ptr + rows, tl.where(live, target_coef, 0.0), mask=row_ok)
        tl.store(row_scale_ptr + rows, tl.where(live, coef_p * tl.exp(m - lse), 0.0), mask=row_ok)
        if FILTER:
            # a flag per FLAG_COLS columns from the GEMM's row maxima of exp(z - m) (GROUPS_PER_SLOT per slot, in
            # planes 2 and 3): p's maximum there is that times exp(m - lse); the target's group is always kept, an
            # ignored row's flags say its largest level (its gradient is 0)
            filter_eps = tl.exp(filter_log_eps)
            target_group = tl.where(live, target // FLAG_COLS, -1)
            n_groups = tl.cdiv(n_cols, FLAG_COLS)
            for g0 in range(0, n_groups, BLOCK_S):
                groups = g0 + tl.arange(0, BLOCK_S)
                slots = groups // GROUPS_PER_SLOT
                part = groups % GROUPS_PER_SLOT
                at = (2 + part).to(tl.int64)[:, None] * plane + slots.to(tl.int64)[:, None] * slot_stride
                mask = (groups < n_groups)[:, None] & row_ok[None, :]
                e_max = tl.load(partials_ptr + at + rows[None, :], mask=mask, other=0.0)
                keep = (e_max * tl.exp(m - lse)[None, :] >= filter_eps) | (groups[:, None] == target_group[None, :])
                log2_top = tl.log2(e_max) + ((m - lse) * _LOG2E)[None, :]
                log2_top = tl.where(live[None, :], log2_top, -float("inf"))
                codes = flag_codes(keep & live[None, :], log2_top, filter_log2_eps)
                tl.store(flags_ptr + rows.to(tl.int64)[None, :] * flag_row_stride + groups[:, None], codes, mask=mask)


def row_scaled_finish(
    target: torch.Tensor,
    loss_rows: torch.Tensor,
    workspace: CEWorkspace,
    *,
    n_cols: int,
    ignore_index: int,
    write_loss: bool = True,
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
    softcap: float | None = None,
) -> None:
    """:func:`.ce_kernel.ce_finish` for a row-scaled chunk of ``n_cols`` columns (``row_scaled=True``): the rows'
    losses and extras, their gradient scales and target coefficients into ``workspace``, and with ``filter_flags``
    (and a gradient) the filter's flag bytes; ``softcap``: the chunk's GEMM capped its logits
    (:func:`.scaled_exp.scaled_exp_logits`). Nothing is checked here (the driver calls it once per chunk)."""
    ws = workspace
    n_rows = target.shape[0]
    block_r, block_s, num_warps = _LAUNCH
    filtering = filter_flags is not None and grad_scale is not None
    log_eps, log2_eps = eps_logs(filter_eps) if filtering else (0.0, 0.0)
    _row_scaled_finish_kernel[(triton.cdiv(n_rows, block_r),)](
        target,
        class_weight,
        ws.partials,
        ws.best_index,
        ws.partials.stride(0),
        ws.partials.shape[1],
        ws.partials.stride(1),
        grad_scale,
        loss_rows,
        z_loss_rows,
        argmax_rows,
        entropy_rows,
        ws.target_coef,
        ws.row_scale,
        ws.row_shift,
        filter_flags,
        filter_flags.stride(0) if filtering else 0,
        n_rows,
        n_cols,
        triton.cdiv(n_cols, ws.scaled_exp_tile),
        ignore_index,
        z_loss_scale,
        log_eps,
        log2_eps,
        1.0 if softcap is None else softcap,
        HAS_WEIGHT=class_weight is not None,
        HAS_Z_LOSS=z_loss_rows is not None,
        TRACK_ARGMAX=argmax_rows is not None,
        ENTROPY=entropy_rows is not None,
        TOKEN_SCALING=token_scaling,
        WRITE_LOSS=write_loss,
        WRITE_GRAD=grad_scale is not None,
        SCALE_PER_ROW=scale_per_row,
        FILTER=filtering,
        SOFTCAP=softcap is not None,
        GROUPS_PER_SLOT=ws.scaled_exp_tile // FILTER_COLS,
        FLAG_COLS=FILTER_COLS,
        BLOCK_R=block_r,
        BLOCK_S=block_s,
        num_warps=num_warps,
    )
