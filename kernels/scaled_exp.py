"""The logits GEMM with a scaled-exp epilogue: the slab holds exponentials of the logits, not the logits.

One persistent Triton GEMM, ``x_chunk @ W.T (+ bias)`` with TMA loads, whose epilogue stores ``exp(z - m)``
in the slab's dtype and writes the tile's partials into the CE workspace (:mod:`.row_partials`), one slot
per ``[BLOCK_M, BLOCK_N]`` column tile, as the CE partial pass would per segment: the reference ``m``,
``d = sum(exp(z - m))``, and as asked the label-smoothing sums, the argmax (over the logits rounded to the
slab's dtype, as eager's argmax sees them), the entropy sum. The target logit ``z_y`` comes first, from a
kernel of its own (the row's dot with its target's weight row, in fp32). Two forms:

- per tile: ``m`` is each tile's row maximum. The CE finish kernel (:func:`.ce_kernel.ce_finish`) merges the
  slots into ``lse`` and rewrites the slab as the gradient, ``p = E * exp(m_tile - lse)`` times the row's
  coefficient: one read and one write of the slab (no partial pass);
- row-scaled (calls without a bias or label smoothing, :func:`flce_policy.plan.scaled_exp.row_scaled`):
  ``m`` is the row's target logit, the same for every tile of the row, so the gradient is ``f * E`` with
  one scale ``f = coef * exp(z_y - lse)`` per row, which the finish kernel writes instead of a gradient.
  grad_input's GEMM reads ``E`` and its rows are scaled after it, grad_weight's reads ``E`` and ``x_c`` scaled
  per row (:mod:`.target_grad`): no pass over the slab. ``E <= exp(max(z) - z_y)``: a row whose logits lie
  more than :data:`SHIFT_LIMIT` above its target's (a loss over 64 nats on one token) flags the chunk,
  whose GEMM and finish then run again per tile, launched every time and doing nothing unflagged: no
  host read.

Why: a bf16 logit carries ``|z| 2^-9`` of rounding into ``p = exp(z - lse)`` (logit std 4: the dense
path's gradient error, 0.0076 relative); the stored exponential carries ``2^-9`` relative whatever
``z``. The target's one-hot term stays out of the slab (:mod:`.target_grad`). The per-tile form at
4096x1024x32768 on the H200, logit std 4, against fp32: grad_input 0.0019, grad_weight 0.0031, against 0.0072
for the logits slab (results/2026-12-02-h200-scaled-exp). The loss, ``lse`` and ``z_y`` are fp32. A softcap
``z' = c tanh(z / c)`` (fp32, ``c <= SHIFT_LIMIT / 2``) runs in the row-scaled form only, whose slab then holds
``exp(z' - z'_y)`` times ``dz'/dz`` (the per-tile form's finish would need ``tanh`` of each logit again); other
softcapped calls run on the logits slab (:func:`flce_policy.plan.scaled_exp.call_routing`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flce_policy.plan.scaled_exp import SHIFT_LIMIT as SHIFT_LIMIT_NATS
from flce_policy.plan.scaled_exp import SHIFT_LIMIT_EXP, WS_COMPUTE_CAPABILITY, WS_TILE
from flce_policy.plan.weight_filter import FILTER_COLS

from .gluon_exp_gemm import gluon_available, launch_row_scaled_exp_gemm
from .interpreter import KERNELS_INTERPRETED
from .rounding import rounded
from .row_partials import CEWorkspace
from .tma import TensorDescriptor

__all__ = ["scaled_exp_logits"]

#: (BLOCK_M, BLOCK_K, GROUP_M, warps, stages): the fastest with this epilogue of sweeps at the small heads'
#: chunks on the H200 (results/2026-12-01-small-heads/h200-persistent-tma.log; GROUP_M 16 over 8: 1-3% in a
#: sweep of 2026-12-02, results/2026-12-02-h200-scaled-exp/); BLOCK_N is the workspace's slot, the plan's tile.
#: The H100 keeps it: at the three smallest heads' chunks (busy start, 2026-12-06) GROUP_M 32 ran within 1%, GROUP_M
#: 8, 64 or 128 2-6% slower, 256x128 tiles 7-14%, BLOCK_K 32 over 5 stages 5-9%, the tile loop unflattened 4-6%; Triton
#: 3.6's own Hopper warp specialisation (``tl.range(warp_specialize=True)``, in-kernel descriptors, 4 warps) compiled
#: to wrong slabs, no faster, and failed to compile with a split store.
_LAUNCH = (128, 64, 16, 8, 3)
#: Columns per grad_weight filter flag: a tile's row maxima are taken per group of them.
_FLAG_COLS = tl.constexpr(FILTER_COLS)
#: The row-scaled form's limit on ``max(z) - z_y`` and its sum of exponentials (see the plan's constants).
SHIFT_LIMIT = tl.constexpr(SHIFT_LIMIT_NATS)
_SHIFT_LIMIT_EXP = tl.constexpr(SHIFT_LIMIT_EXP)
_LOG2E = tl.constexpr(1.4426950408889634)
#: Rows and hidden columns per step of the target-logit kernel: a program per row, so that a chunk of a few hundred
#: rows still fills the GPU (512 rows of H = 5376: 9 µs a chunk, against 51 µs at 16 rows a program; H100).
_TARGET_ROWS, _TARGET_HIDDEN = 1, 1024
#: Programs of the persistent grid under the interpreter (the GPU runs one per SM).
_INTERPRETED_PROGRAMS = 4


@triton.jit
def _softcapped(z, softcap, IEEE: tl.constexpr):
    """``(z', r)``: ``z' = c tanh(z / c)`` and ``r = 1 / (1 + exp(2 |z| / c))``, whence ``dz'/dz = 4 r (1 - r)``
    without the cancellation of ``1 - tanh^2`` where ``|z| >> c``, where that derivative is smallest."""
    r = tl.fdiv(1.0, 1.0 + tl.exp2(tl.abs(z) * (2.0 * _LOG2E / softcap)), ieee_rounding=IEEE)
    return tl.where(z < 0.0, -softcap, softcap) * (1.0 - 2.0 * r), r


@triton.jit
def _capped_exp(z, m, softcap, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
    """Row sums of ``exp(z' - m)`` for the softcapped ``z'`` of ``z``, and those exponentials times ``dz'/dz``."""
    capped, r = _softcapped(z, softcap, IEEE)
    if not EVEN_N:  # past V: z = -inf, its exponential 0
        capped = tl.where(z == -float("inf"), z, capped)
    e = tl.exp2(tl.fma(capped, _LOG2E, -(m * _LOG2E)[:, None]))
    return tl.sum(e, axis=1), e * (4.0 * r * (1.0 - r))


@functools.cache
def _runs_gluon(device: torch.device) -> bool:
    """Whether ``device`` runs the Gluon GEMM: a Hopper GPU (sm_90), not under the interpreter."""
    if KERNELS_INTERPRETED or device.type != "cuda" or not gluon_available():
        return False
    return torch.cuda.get_device_capability(device) == WS_COMPUTE_CAPABILITY


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
    slot_stride,
    shift_ptr,
    redo_ptr,
    n_rows,
    n_cols,
    hidden,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr,
    ENTROPY: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_N: tl.constexpr,
    ROW_SHIFT: tl.constexpr,
    REDO_ONLY: tl.constexpr,
    FLAG_MAXIMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
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
    tiles = tiles_m * tiles_n
    if REDO_ONLY:  # the per-tile form, run only where the row-scaled one flagged the chunk: no tiles otherwise
        tiles = tiles * tl.load(redo_ptr)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=True):
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
        if ROW_SHIFT:  # slot-major: the tile's rows side by side, so each store below coalesces
            slot = pid_n.to(tl.int64) * slot_stride + rows
        else:
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
        if ROW_SHIFT:
            # exp(z - z_y) per row (+inf where ignored: zeros); the overflow check is on the row sums below
            m = tl.load(shift_ptr + rows, mask=row_ok, other=float("inf"))
        else:
            m = tl.max(acc, axis=1)
        # one FMA and one exp2 per element: the epilogue's share of the GEMM is what the small heads pay over
        # cuBLAS (a row maximum and a clamp more cost 2-3% of the GEMM at H <= 1024, H200, 2026-12-02). On the H100
        # the exp2 is ~5% of this GEMM at H <= 1152 (8-12% over cuBLAS in all); half the tile's exp2 as a degree-4
        # polynomial on the FMA pipe ran 1-4% slower, a split store with 4 stages within 1% (2026-12-06)
        # (an explicit fma: a compiler's choice to contract or not could differ between two variants of the kernel,
        # and the filter's variant must give the dense one's slab bit for bit)
        if SOFTCAP:  # row-scaled only (the plan's call_routing): no argmax, entropy, smoothing or redo
            # the slab holds exp(z' - z'_y) times dz'/dz: the gradient with respect to z over the row's scale. Half
            # a tile at a time: the exponentials (summed) and the derivatives of a whole tile live at once spill
            lower, upper = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            lower_sum, lower = _capped_exp(lower, m, softcap, EVEN_N, IEEE)
            upper_sum, upper = _capped_exp(upper, m, softcap, EVEN_N, IEEE)
            tile_sum = lower_sum + upper_sum
            e = tl.reshape(tl.permute(tl.join(lower, upper), (0, 2, 1)), (BLOCK_M, BLOCK_N))
        else:
            e = tl.exp2(tl.fma(acc, _LOG2E, -(m * _LOG2E)[:, None]))
        if ENTROPY:
            if EVEN_N:
                tl.store(partials_ptr + 6 * plane + slot, tl.sum(e * acc, axis=1), mask=row_ok)
            else:  # past V, e = 0 and z = -inf: a floor on z makes 0 * z a 0 without the column mask live (spills)
                tl.store(partials_ptr + 6 * plane + slot, tl.sum(e * tl.maximum(acc, -3.0e38), axis=1), mask=row_ok)
        if not SOFTCAP:
            tile_sum = tl.sum(e, axis=1)
        if IEEE:  # the interpreter truncates a cast to bf16: round to nearest first, as the GPU's cast does
            e = rounded(e, out_desc.dtype)
        stored = e.to(out_desc.dtype)
        if ROW_SHIFT and FLAG_MAXIMA:
            # a grad_weight filter's inputs: each half's row maxima of the slab's exp(z - z_y) (the filter's columns
            # are half a tile), in the smoothing planes, which the row-scaled form leaves unused; the CE finish flags
            # from them. Of the stored values, as the per-tile form's flags read the slab: the G the backward
            # multiplies, and in bf16 the cheaper reduction (the Gluon GEMM's maxima cost 1-2% of it over 3-8% from
            # fp32 e, H200, results/2026-12-02-h200-filter-random-logits/maxima_probe.log). A 128-column tile is one
            # group.
            if BLOCK_N == 2 * _FLAG_COLS:
                lower_max, upper_max = tl.split(tl.max(tl.reshape(stored, (BLOCK_M, 2, BLOCK_N // 2)), axis=2))
                tl.store(partials_ptr + 2 * plane + slot, lower_max.to(tl.float32), mask=row_ok)
                tl.store(partials_ptr + 3 * plane + slot, upper_max.to(tl.float32), mask=row_ok)
            else:
                tl.static_assert(BLOCK_N == _FLAG_COLS, "one or two flag groups per tile")
                tl.store(partials_ptr + 2 * plane + slot, tl.max(stored, axis=1).to(tl.float32), mask=row_ok)
        if ROW_SHIFT and not SOFTCAP:  # capped logits lie within 2 * softcap <= SHIFT_LIMIT of the target's
            # a row whose logits lie more than SHIFT_LIMIT above its target's: the chunk is redone per tile. Each
            # such row writes the flag itself (the same 1: no race that matters); a max over the tile's rows first
            # would be a reduction across warps, through shared memory and a barrier, in every tile's epilogue
            tl.store(redo_ptr + 0 * rows, 1, mask=row_ok & (tile_sum > _SHIFT_LIMIT_EXP))
        if not ROW_SHIFT:  # (the row-scaled finish reads the row's shift itself)
            tl.store(partials_ptr + slot, m, mask=row_ok)
        tl.store(partials_ptr + plane + slot, tile_sum, mask=row_ok)
        out_desc.store([row0, col0], stored)


@triton.jit
def _target_logit_kernel(
    x_ptr, x_stride, w_ptr, w_stride, bias_ptr, target_ptr, out_ptr, out_stride, shift_ptr, redo_ptr, n_rows,
    n_cols, hidden, ignore_index, softcap, HAS_BIAS: tl.constexpr, ROW_SHIFT: tl.constexpr, SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    given = tl.load(target_ptr + rows, mask=rows < n_rows, other=-1)
    holds = (rows < n_rows) & (given >= 0) & (given < n_cols)
    target = tl.where(holds, given, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        ok = holds[:, None] & (h < hidden)[None, :]
        xv = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + h[None, :], mask=ok, other=0.0)
        wv = tl.load(w_ptr + target[:, None] * w_stride + h[None, :], mask=ok, other=0.0)
        acc += tl.sum(xv.to(tl.float32) * wv.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + target, mask=holds, other=0.0).to(tl.float32)
    if SOFTCAP:  # z'_y, the row's shift and its loss's target logit (the finish takes dz'/dz from it)
        acc, _ = _softcapped(acc, softcap, IEEE)
    tl.store(out_ptr + rows.to(tl.int64) * out_stride, acc, mask=holds)
    if ROW_SHIFT:  # the row-scaled form's shifts, and its redo flag cleared before the GEMM can set it
        shifted = holds & (given != ignore_index)
        tl.store(shift_ptr + rows, tl.where(shifted, acc, float("inf")), mask=rows < n_rows)
        tl.store(redo_ptr, 0, mask=tl.program_id(0) == 0)


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
    ignore_index: int = -100,
    row_scaled: bool = False,
    redo: bool = False,
    flag_maxima: bool = False,
    softcap: float | None = None,
) -> None:
    """``slab [n, V] = exp(z - m_tile)`` for ``z = x_chunk @ weight.T (+ bias)``, and the rows' partials in
    ``workspace`` (made by :func:`.ce_kernel.ce_workspace` with ``scaled_exp=True``); the target logits first.

    ``row_scaled``: ``exp(z - z_y)`` per row instead (``+inf`` shifts on ignored rows), each slot's reference
    the row's shift, and the workspace's redo flag set where a row's logits lie more than :data:`SHIFT_LIMIT`
    above its target's. ``redo``: the per-tile form again, over the same chunk, only where that flag is set
    (no tiles otherwise; the target logits are kept). ``flag_maxima`` (row-scaled only): each half tile's row
    maxima of the slab's ``exp(z - z_y)`` too, for a grad_weight filter's flags (:func:`.row_scaled_finish`).
    ``softcap`` (row-scaled only, without the argmax or the entropy): the logits ``z' = c tanh(z / c)``, the slab
    ``exp(z' - z'_y) dz'/dz`` and no redo flag (capped logits lie within ``2 c <= SHIFT_LIMIT`` of the target's).
    Nothing is checked here: a geometry has this slab form only where :mod:`flce_policy.plan.scaled_exp` says it can
    run, and a call with a softcap only where its ``call_routing`` says so."""
    n_rows, hidden = x_chunk.shape
    n_cols = weight.shape[0]
    block_m, block_k, group_m, num_warps, num_stages = _LAUNCH
    ws = workspace
    block_n = ws.scaled_exp_tile
    capped = softcap is not None and row_scaled
    if not redo:
        # z_y apart: picked out of the GEMM's tile it cost the epilogue 9-15% at the small heads (H200, 4096-row
        # chunks, proto sweep of 2026-12-02); a dot of two rows in fp32 is the same value up to summation order
        _target_logit_kernel[(triton.cdiv(n_rows, _TARGET_ROWS),)](
            x_chunk, x_chunk.stride(0), weight, weight.stride(0), bias, target, ws.partials[5],
            ws.partials.stride(1), ws.row_shift, ws.redo, n_rows, n_cols, hidden, ignore_index,
            softcap if capped else 1.0, HAS_BIAS=bias is not None, ROW_SHIFT=row_scaled, SOFTCAP=capped,
            IEEE=KERNELS_INTERPRETED, BLOCK_R=_TARGET_ROWS, BLOCK_H=_TARGET_HIDDEN,
        )  # fmt: skip
    if row_scaled and not (track_argmax or entropy or capped) and block_n == WS_TILE and _runs_gluon(slab.device):
        # "scaled_exp_ws": the warp-specialised GEMM, the same slab and slots (the argmax, the entropy's sums and
        # a softcap it does not compute: the loss runs such calls on "scaled_exp_rows", and a direct launch of them
        # runs this Triton GEMM in these tiles)
        maxima = ws.partials[2].view(-1) if flag_maxima else None
        launch_row_scaled_exp_gemm(
            x_chunk, weight, slab, ws.row_shift, ws.partials[1].view(-1), ws.partials.shape[1], ws.redo, maxima
        )
        return
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
        ws.partials.shape[1],
        ws.row_shift,
        ws.redo,
        n_rows,
        n_cols,
        hidden,
        softcap if capped else 1.0,
        HAS_BIAS=bias is not None,
        HAS_WEIGHT=class_weight is not None,
        HAS_SMOOTHING=label_smoothing > 0.0,
        TRACK_ARGMAX=track_argmax,
        ENTROPY=entropy,
        IEEE=KERNELS_INTERPRETED,
        EVEN_N=n_cols % block_n == 0,
        ROW_SHIFT=row_scaled,
        REDO_ONLY=redo,
        FLAG_MAXIMA=row_scaled and flag_maxima,
        SOFTCAP=capped,
        NUM_SLOTS=ws.slots,
        NUM_PROGRAMS=programs,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        num_warps=num_warps,
        num_stages=num_stages,
    )
