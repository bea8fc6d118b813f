"""The row-scaled exp GEMM in Gluon for Hopper (sm_90): ``exp(x_chunk @ W.T - shift)`` per row, with tile sums.

The output of the row-scaled form of :mod:`.scaled_exp`'s Triton GEMM (the same fma and exp2 of the same products;
the loss and gradients agree with that kernel's to fp32 summation order, tests/test_gpu_scaled_exp.py), with the
partials laid out slot-major, as that kernel's row-scaled form writes them. A persistent warp-specialised kernel:
one TMA producer warp fills a 4-stage shared-memory ring; two consumer warpgroups take the CTA's 128x128 tiles in
turn, so that one runs its epilogue (the exponentials, the row sums, the slab's TMA store) while the other's wgmma
keeps the tensor cores busy.

Measured on the H200 (Triton 3.6, 4096-row chunks, H x V = 896-2048 x 128k-262k), the GEMM alone: 0.958-0.977x the
time of cuBLAS's plain bf16 GEMM (results/2026-12-02-h200-gluon-gemm/gluon_rowsum_probe.log, the ``full_t`` row;
the kernel is its probe's, whose source that folder's README names), where the
Triton GEMM took 1.06-1.24x (triton_partials_layout_probe.log there); in the loss, 2.1-3.5% faster than the Triton
form at five small heads (heads.log there).

Gluon is experimental and its names move between Triton releases: without it (or without its Hopper API)
this module still imports, :func:`gluon_available` says False and :func:`row_scaled_exp_gemm` raises. Its Gluon
imports (under the names this Triton gives them) and :func:`sm_count` serve :mod:`.weight_grad_gemm` too.
"""

from __future__ import annotations

import functools

import torch

from flce_policy.plan.scaled_exp import SHIFT_LIMIT_EXP, WS_TILE

__all__ = ["gluon_available", "launch_row_scaled_exp_gemm", "row_scaled_exp_gemm"]

#: (BLOCK_K, STAGES, GROUP_M, consumer registers, producer registers). 4 stages of 16 + 16 KiB and two 32 KiB
#: epilogue buffers: 192 KiB of shared memory. The producer's 32 registers over 24: the GEMM alone 3.0-3.3% faster at
#: the three smallest heads' chunks (H100, two runs; the same slab and sums); consumers under 240 registers, 3 or 5
#: stages, BLOCK_K 32 or GROUP_M 4, 8 or 32 were slower there.
_LAUNCH = (64, 4, 16, 240, 32)
_LOG2E = 1.4426950408889634


def _tma_reduce_add_builder():
    """``async_atomic_add(desc, coord, smem)`` on a Gluon builder with the op but no Python name for it, else None."""
    try:
        from triton._C.libtriton import gluon_ir, ir
        from triton.experimental.gluon.language._core import builtin
    except ImportError:
        return None
    if not hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce") or not hasattr(ir, "DESCRIPTOR_REDUCE_KIND"):
        return None

    @builtin
    def async_atomic_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

    return async_atomic_add


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.6 names the TMA copies async_copy_*; later releases async_load / async_store (the old names raise)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # the bulk tensor reduce (cp.reduce.async.bulk.tensor .add): async_atomic_add in later Tritons; 3.6's Gluon builds
    # the op but has no Python name for it; None where neither is there
    tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_builder()
    _GLUON_ERROR: Exception | None = None
except (ImportError, AttributeError) as exc:  # a Triton without Gluon's Hopper API
    _GLUON_ERROR = exc


def gluon_available() -> bool:
    """Whether this Triton ships the Gluon Hopper API the kernel needs (import check only; no device check)."""
    return _GLUON_ERROR is None


if _GLUON_ERROR is None:
    LOG2E = gl.constexpr(_LOG2E)
    SHIFT_LIMIT_EXP = gl.constexpr(SHIFT_LIMIT_EXP)

    @gluon.jit
    def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
        # GROUP_M row tiles walk the columns together: W's tiles are read from L2 by the group
        in_group = GROUP_M * tiles_n
        group_first = tile // in_group * GROUP_M
        group_size = gl.minimum(tiles_m - group_first, GROUP_M)
        return group_first + (tile % in_group) % group_size, (tile % in_group) // group_size

    @gluon.jit
    def _producer(x_desc, w_desc, a_bufs, b_bufs, ready, empty, n_rows, n_cols, hidden, STAGES: gl.constexpr,
                  GROUP_M: gl.constexpr):  # fmt: skip
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        tiles_m = gl.cdiv(n_rows, BLOCK_M)
        tiles_n = gl.cdiv(n_cols, BLOCK_N)
        k_tiles = gl.cdiv(hidden, BLOCK_K)
        it = 0
        for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
            for kk in range(k_tiles):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # the stage's previous use released
                mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma_load(x_desc, [pid_m * BLOCK_M, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
                tma_load(w_desc, [pid_n * BLOCK_N, kk * BLOCK_K], ready.index(s), b_bufs.index(s))
                it += 1

    @gluon.jit
    def _consumer(x_desc, w_desc, out_desc, shift_ptr, sums_ptr, maxima_ptr, redo_ptr, a_bufs, b_bufs, c_bufs,
                  ready, empty, turn, n_rows, n_cols, hidden, slot_stride, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                  EVEN_N: gl.constexpr, HAS_MAXIMA: gl.constexpr, WHICH: gl.constexpr):  # fmt: skip
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        # one m64nNk16 wgmma per 64 rows of the warpgroup, N the whole tile (BLOCK_N <= 256)
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        c_smem = c_bufs.index(WHICH)
        tiles_m = gl.cdiv(n_rows, BLOCK_M)
        tiles_n = gl.cdiv(n_cols, BLOCK_N)
        k_tiles = gl.cdiv(hidden, BLOCK_K)
        programs = gl.num_programs(0)
        log2e = gl.full([BLOCK_M, BLOCK_N], LOG2E, gl.float32, mma_layout)

        j = 0  # this consumer's tiles so far: it takes the CTA's local tiles WHICH, WHICH + 2, ...
        for tile in range(gl.program_id(0) + WHICH * programs, tiles_m * tiles_n, 2 * programs):
            pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            base = (2 * j + WHICH) * k_tiles  # the producer's K-step counter at this tile's first K-step
            # the shifts before the MMAs: their latency stays off the epilogue's path
            rows = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
            row_ok = rows < n_rows
            shift = gl.load(shift_ptr + rows, mask=row_ok, other=float("inf"))

            # The turn: both consumers wait on the same ready[] barriers, whose waits check only a phase parity,
            # so a consumer starts its MMAs only once the other has passed all its ready[] waits of the previous
            # tile. Consumer 1's j-th wait is the barrier's completion j (parity j & 1); consumer 0's is
            # completion j - 1, and its first (a fresh barrier, parity 1) passes at once.
            mbarrier.wait(turn.index(WHICH), (j & 1) ^ (WHICH ^ 1))
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
            for kk in range(k_tiles):
                it = base + kk
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                # w's tile is [BLOCK_N, BLOCK_K], K-major: its transposed view is wgmma's [K, N] operand
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=kk > 0,
                                    is_async=True)  # fmt: skip
                # one wgmma in flight: the previous K-step's is done, its stage goes back to the producer
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kk > 0)
            mbarrier.arrive(turn.index(WHICH ^ 1))  # all stages taken: the other consumer's MMAs run under our epilogue
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((base + k_tiles - 1) % STAGES))

            # e = exp(z - shift) as exp2(fma(z, log2 e, -shift log2 e)): the explicit fma of scaled_exp.py, so the
            # slabs agree bit for bit (a compiler's own contraction could differ); +inf shifts give zeros
            neg, _ = gl.broadcast(gl.expand_dims(-(shift * LOG2E), 1), acc)
            e = gl.exp2(gl.fma(acc, log2e, neg))
            if not EVEN_N:  # past V (TMA read zeros there): out of the sums and maxima, clipped from the store
                cols = off_n + gl.arange(0, BLOCK_N, layout=col_layout)
                e = gl.where(gl.expand_dims(cols < n_cols, 0), e, 0.0)
            # slot-major partials [tiles_n, slot_stride]: a warp's store covers 8 consecutive rows, one sector
            # (row-major, each row its own sector, cost the probe 0.06-0.07x of cuBLAS more)
            slot = pid_n.to(gl.int64) * slot_stride + rows
            tile_sum = gl.sum(e, axis=1)
            gl.store(sums_ptr + slot, tile_sum, mask=row_ok)
            stored = e.to(out_desc.dtype)
            if HAS_MAXIMA:  # of the slab's values, as scaled_exp.py's: a bf16 reduction, not an fp32 one
                gl.store(maxima_ptr + slot, gl.max(stored, axis=1).to(gl.float32), mask=row_ok)
            # a row past the shift limit flags the chunk; each such row writes the same 1 itself (a max over the
            # tile's rows first would cross warps, through shared memory, in every epilogue)
            flag = gl.full([BLOCK_M], 1, gl.int32, row_layout)
            gl.store(redo_ptr + rows * 0, flag, mask=row_ok & (tile_sum > SHIFT_LIMIT_EXP))
            tma.store_wait(pendings=0)  # our previous TMA store has read this buffer (the other has its own)
            c_smem.store(stored)
            fence_async_shared()
            tma_store(out_desc, [off_m, off_n], c_smem)  # clipped at n rows and V columns
            j += 1
        tma.store_wait(pendings=0)

    @gluon.jit
    def _row_scaled_exp_kernel(x_desc, w_desc, out_desc, shift_ptr, sums_ptr, maxima_ptr, redo_ptr, n_rows, n_cols,
                               hidden, slot_stride, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, EVEN_N: gl.constexpr,
                               HAS_MAXIMA: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
        gl.static_assert(num_warps == 4, "the default partition is consumer 0: one warpgroup")
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2, BLOCK_M, BLOCK_N], out_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)  # the producer's expect + the TMA bytes
            mbarrier.init(empty.index(i), count=1)  # one release by whichever consumer used the stage
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize(
            [
                (_consumer, (x_desc, w_desc, out_desc, shift_ptr, sums_ptr, maxima_ptr, redo_ptr, a_bufs, b_bufs,
                             c_bufs, ready, empty, turn, n_rows, n_cols, hidden, slot_stride, STAGES, GROUP_M, EVEN_N,
                             HAS_MAXIMA, 0)),
                (_consumer, (x_desc, w_desc, out_desc, shift_ptr, sums_ptr, maxima_ptr, redo_ptr, a_bufs, b_bufs,
                             c_bufs, ready, empty, turn, n_rows, n_cols, hidden, slot_stride, STAGES, GROUP_M, EVEN_N,
                             HAS_MAXIMA, 1)),
                (_producer, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, n_rows, n_cols, hidden, STAGES, GROUP_M)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip

    @functools.cache
    def _shared_layouts():
        """The NVMMA shared layouts of x's, W's and the slab's TMA boxes (bf16, 128-byte swizzle)."""
        block_k = _LAUNCH[0]
        return tuple(
            gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
            for box in ([WS_TILE, block_k], [WS_TILE, block_k], [WS_TILE, WS_TILE])
        )


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(x_chunk, weight, slab, row_shift, sums, slot_stride, redo, maxima) -> None:
    """ValueError for inputs the kernel cannot take, read from the tensors' metadata (no device access)."""
    if x_chunk.dim() != 2 or weight.dim() != 2 or x_chunk.shape[1] != weight.shape[1]:
        raise ValueError(f"x_chunk [n, H] and weight [V, H] needed, got {list(x_chunk.shape)}, {list(weight.shape)}")
    n, hidden = x_chunk.shape
    n_cols = weight.shape[0]
    for name, t, dtype in (("x_chunk", x_chunk, torch.bfloat16), ("weight", weight, torch.bfloat16),
                           ("slab", slab, torch.bfloat16), ("row_shift", row_shift, torch.float32),
                           ("sums", sums, torch.float32), ("maxima", maxima, torch.float32),
                           ("redo", redo, torch.int32)):  # fmt: skip
        if t is not None and t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if hidden % 8 or n_cols % 8 or hidden == 0 or n_cols == 0:
        raise ValueError(f"H ({hidden}) and V ({n_cols}) must be positive multiples of 8 (TMA: 16-byte row strides)")
    if tuple(slab.shape) != (n, n_cols) or not slab.is_contiguous():
        raise ValueError(f"slab must be a contiguous [{n}, {n_cols}], got {list(slab.shape)} strides {slab.stride()}")
    for name, t in (("x_chunk", x_chunk), ("weight", weight)):
        if t.stride(1) != 1 or t.stride(0) % 8:
            raise ValueError(f"{name} needs contiguous rows and a row stride a multiple of 8, got {t.stride()}")
    for name, t in (("x_chunk", x_chunk), ("weight", weight), ("slab", slab)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name}'s data must start 16-byte aligned (TMA), got address {t.data_ptr():#x}")
    if not isinstance(slot_stride, int) or slot_stride < n:
        raise ValueError(f"slot_stride must be an int >= n ({n}), got {slot_stride!r}")
    need = (-(-n_cols // WS_TILE) - 1) * slot_stride + n
    for name, t, size in (("row_shift", row_shift, n), ("sums", sums, need), ("maxima", maxima, need),
                          ("redo", redo, 1)):  # fmt: skip
        if t is not None and (t.dim() != 1 or t.stride(0) != 1 or t.numel() < size):
            raise ValueError(f"{name} must be a flat contiguous tensor of at least {size} elements, got "
                             f"shape {list(t.shape)} strides {t.stride()}")  # fmt: skip


def row_scaled_exp_gemm(
    x_chunk: torch.Tensor,
    weight: torch.Tensor,
    slab: torch.Tensor,
    row_shift: torch.Tensor,
    sums: torch.Tensor,
    slot_stride: int,
    redo: torch.Tensor,
    maxima: torch.Tensor | None = None,
) -> None:
    """``slab [n, V] = bf16(exp(z - row_shift))`` for ``z = x_chunk @ weight.T`` (fp32), and per column tile ``j``
    of :data:`WS_TILE` columns and row ``r < n``: ``sums[j * slot_stride + r]``, the tile's sum of the fp32
    exponentials (columns past V excluded), and if given ``maxima[...]`` at the same places, the maximum of the
    slab's (bf16) values.

    ``row_shift`` fp32 [>= n] (``+inf``: an ignored row, zeros); ``redo`` int32 [1] is set to 1 where a row's tile
    sum exceeds ``exp(64)``, never cleared here. bf16 x, W and slab; H and V multiples of 8; a Hopper GPU."""
    _check(x_chunk, weight, slab, row_shift, sums, slot_stride, redo, maxima)
    tensors = (x_chunk, weight, slab, row_shift, sums, redo) + (() if maxima is None else (maxima,))
    if any(t.device != x_chunk.device for t in tensors) or x_chunk.device.type != "cuda":
        raise ValueError(f"all tensors must be on one CUDA device, got {sorted({str(t.device) for t in tensors})}")
    if _GLUON_ERROR is not None:
        raise RuntimeError(f"the Gluon GEMM needs Triton's Gluon Hopper API, absent here: {_GLUON_ERROR}")
    if torch.cuda.get_device_capability(x_chunk.device)[0] != 9:
        raise RuntimeError("the Gluon GEMM runs on Hopper (sm_90) only: wgmma")
    launch_row_scaled_exp_gemm(x_chunk, weight, slab, row_shift, sums, slot_stride, redo, maxima)


def launch_row_scaled_exp_gemm(
    x_chunk: torch.Tensor,
    weight: torch.Tensor,
    slab: torch.Tensor,
    row_shift: torch.Tensor,
    sums: torch.Tensor,
    slot_stride: int,
    redo: torch.Tensor,
    maxima: torch.Tensor | None = None,
) -> None:
    """:func:`row_scaled_exp_gemm` with nothing checked: the driver's launch, on a geometry whose slab form the plan
    lets run here (:mod:`flce_policy.plan.scaled_exp`) and tensors the call's routing let through TMA."""
    n, hidden = x_chunk.shape
    n_cols = weight.shape[0]
    if n == 0:
        return
    block_k, stages, group_m, consumer_regs, producer_regs = _LAUNCH
    x_layout, w_layout, o_layout = _shared_layouts()
    x_desc = TensorDescriptor.from_tensor(x_chunk, [WS_TILE, block_k], x_layout)
    w_desc = TensorDescriptor.from_tensor(weight, [WS_TILE, block_k], w_layout)
    o_desc = TensorDescriptor.from_tensor(slab, [WS_TILE, WS_TILE], o_layout)
    tiles = -(-n // WS_TILE) * -(-n_cols // WS_TILE)
    _row_scaled_exp_kernel[(min(sm_count(x_chunk.device), tiles),)](
        x_desc, w_desc, o_desc, row_shift, sums, maxima, redo, n, n_cols, hidden, slot_stride,
        STAGES=stages, GROUP_M=group_m, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        EVEN_N=n_cols % WS_TILE == 0, HAS_MAXIMA=maxima is not None, num_warps=4,
    )  # fmt: skip
