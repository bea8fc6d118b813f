"""grad_weight's per-chunk GEMM in Gluon for Hopper (sm_90): ``grad_weight[V, H] += G[n, V].T @ x[n, H]`` in bf16.

At a small chunk (n of a few hundred rows) this GEMM is short in K and its output is the whole ``[V, H]`` gradient:
cuBLAS's beta=1 GEMM reads and writes it in its epilogue, after the main loop, every chunk (2.96 ms against 2.22 ms
without the read at n = 512, V = 262144, H = 5376 on an H100; a Triton kernel that reads it there 3.2-3.9 ms).
Here the read overlaps the tensor cores: a persistent warp-specialised kernel whose TMA producer warp fills a
4-stage ring of G's and x's tiles and, once a tile's operands are queued, fetches that tile's ``[128, 128]`` block
of grad_weight into its consumer's buffer; two consumer warpgroups take the CTA's tiles in turn (as
:mod:`.gluon_exp_gemm`'s do), so one adds the fetched block to its accumulator and stores the sum while the other's
wgmma runs. G's tile is loaded as it lies, ``[BLOCK_K, 128]`` of a row-major ``[n, V]``, and fed to wgmma
transposed. Adding in memory instead (``add_in_memory``), the epilogue hands its bf16 tile to TMA's bulk reduce,
which adds it to the old block in the memory system: nothing is fetched into the SM.

Where it runs rather than cuBLAS (the GPUs and chunk rows it was measured faster at):
:mod:`flce_policy.plan.weight_grad_gemm`; :func:`accumulate_weight_grad` is the drivers' one call for either.
Gluon is experimental and its names move between Triton releases: without it (or without its Hopper API) this
module still imports and every chunk runs on cuBLAS.
"""

from __future__ import annotations

import functools

import torch

from flce_policy.plan.device import WGMMA_COMPUTE_CAPABILITY, family_from_name
from flce_policy.plan.weight_grad_gemm import WEIGHT_GRAD_GEMM_ENV_VAR, weight_grad_gemm_for

from .gemm import accumulate_mm
from .gluon_exp_gemm import gluon_available, sm_count
from .interpreter import KERNELS_INTERPRETED
from .tma import tma_tensors

__all__ = ["accumulate_weight_grad", "weight_grad_gemm", "launch_weight_grad_gemm", "reduce_add_available"]

#: Output tile (V rows and H columns of grad_weight) and K-step (chunk rows).
_TILE, _BLOCK_K = 128, 64
#: (STAGES, consumer registers, producer registers): 4 stages of 16 + 16 KiB and two 32 KiB blocks of
#: grad_weight: 192 KiB of shared memory.
_LAUNCH = (4, 232, 40)

if gluon_available():
    from .gluon_exp_gemm import (
        TensorDescriptor,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        tma_load,
        tma_reduce_add,
        tma_store,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # a Triton without the bulk reduce compiles the store in its place: the host never asks for UPDATE 2 there
    _reduce_add = tma_reduce_add or tma_store

    @gluon.jit
    def _producer(g_desc, x_desc, out_desc, a_bufs, b_bufs, c_bufs, ready, empty, c_ready, c_empty, n_vocab,
                  n_hidden, n_rows, STAGES: gl.constexpr, UPDATE: gl.constexpr):  # fmt: skip
        BLOCK_K: gl.constexpr = g_desc.block_type.shape[0]
        BLOCK_M: gl.constexpr = g_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = x_desc.block_type.shape[1]
        tiles_n = gl.cdiv(n_hidden, BLOCK_N)
        tiles = gl.cdiv(n_vocab, BLOCK_M) * tiles_n
        k_tiles = gl.cdiv(n_rows, BLOCK_K)
        it = 0
        j = 0  # the CTA's tiles so far; tile j goes to consumer j % 2
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            off_m = tile // tiles_n * BLOCK_M
            off_n = tile % tiles_n * BLOCK_N
            for kk in range(k_tiles):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), g_desc.block_type.nbytes + x_desc.block_type.nbytes)
                tma_load(g_desc, [kk * BLOCK_K, off_m], ready.index(s), a_bufs.index(s))
                tma_load(x_desc, [kk * BLOCK_K, off_n], ready.index(s), b_bufs.index(s))
                it += 1
            if UPDATE == 1:
                # after the tile's operands: the consumer has freed this buffer (its store two tiles back is done)
                # before it started the tile, so this wait never holds the ring back
                w = j % 2
                mbarrier.wait(c_empty.index(w), ((j // 2) & 1) ^ 1)
                mbarrier.expect(c_ready.index(w), out_desc.block_type.nbytes)
                tma_load(out_desc, [off_m, off_n], c_ready.index(w), c_bufs.index(w))
            j += 1

    @gluon.jit
    def _consumer(g_desc, x_desc, out_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, c_ready, c_empty, n_vocab,
                  n_hidden, n_rows, STAGES: gl.constexpr, UPDATE: gl.constexpr, WHICH: gl.constexpr):  # fmt: skip
        BLOCK_K: gl.constexpr = g_desc.block_type.shape[0]
        BLOCK_M: gl.constexpr = g_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = x_desc.block_type.shape[1]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        c_smem = c_bufs.index(WHICH)
        tiles_n = gl.cdiv(n_hidden, BLOCK_N)
        tiles = gl.cdiv(n_vocab, BLOCK_M) * tiles_n
        k_tiles = gl.cdiv(n_rows, BLOCK_K)
        programs = gl.num_programs(0)
        n = 0  # this consumer's tiles so far: the CTA's tiles WHICH, WHICH + 2, ...
        for tile in range(gl.program_id(0) + WHICH * programs, tiles, 2 * programs):
            off_m = tile // tiles_n * BLOCK_M
            off_n = tile % tiles_n * BLOCK_N
            base = (2 * n + WHICH) * k_tiles
            # the turn, as in gluon_exp_gemm: our MMAs start once the other consumer has issued all of its tile's
            mbarrier.wait(turn.index(WHICH), (n & 1) ^ (WHICH ^ 1))
            # our previous tile's store has long left the buffer (the other consumer's whole main loop ran since):
            # the producer may fetch this tile's block into it
            tma.store_wait(pendings=0)
            mbarrier.arrive(c_empty.index(WHICH), pred=n > 0)
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
            for kk in range(k_tiles):
                it = base + kk
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                # G's tile is [BLOCK_K, BLOCK_M] (V contiguous): its transposed view is wgmma's [M, K] operand;
                # x's is [BLOCK_K, BLOCK_N], the [K, N] operand as it lies
                acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, use_acc=kk > 0,
                                    is_async=True)  # fmt: skip
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kk > 0)
            mbarrier.arrive(turn.index(WHICH ^ 1))
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((base + k_tiles - 1) % STAGES))
            if UPDATE == 1:
                mbarrier.wait(c_ready.index(WHICH), n & 1)
                acc = acc + c_smem.load(mma_layout).to(gl.float32)
            # each thread writes back the elements it read: no other thread's read is overtaken
            c_smem.store(acc.to(out_desc.dtype))
            fence_async_shared()
            if UPDATE == 2:
                _reduce_add(out_desc, [off_m, off_n], c_smem)  # the memory system adds it to the old block
            else:
                tma_store(out_desc, [off_m, off_n], c_smem)  # clipped at V rows and H columns
            n += 1
        tma.store_wait(pendings=0)

    @gluon.jit
    def _weight_grad_kernel(g_desc, x_desc, out_desc, n_vocab, n_hidden, n_rows, STAGES: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, UPDATE: gl.constexpr,
                            num_warps: gl.constexpr):  # fmt: skip
        gl.static_assert(num_warps == 4, "the default partition is consumer 0: one warpgroup")
        BLOCK_K: gl.constexpr = g_desc.block_type.shape[0]
        BLOCK_M: gl.constexpr = g_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = x_desc.block_type.shape[1]
        a_bufs = gl.allocate_shared_memory(g_desc.dtype, [STAGES, BLOCK_K, BLOCK_M], g_desc.layout)
        b_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], x_desc.layout)
        c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2, BLOCK_M, BLOCK_N], out_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        c_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        c_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
            mbarrier.init(c_ready.index(i), count=1)
            mbarrier.init(c_empty.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize(
            [
                (_consumer, (g_desc, x_desc, out_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, c_ready, c_empty,
                             n_vocab, n_hidden, n_rows, STAGES, UPDATE, 0)),
                (_consumer, (g_desc, x_desc, out_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, c_ready, c_empty,
                             n_vocab, n_hidden, n_rows, STAGES, UPDATE, 1)),
                (_producer, (g_desc, x_desc, out_desc, a_bufs, b_bufs, c_bufs, ready, empty, c_ready, c_empty,
                             n_vocab, n_hidden, n_rows, STAGES, UPDATE)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip

    @functools.cache
    def _shared_layouts():
        """The NVMMA shared layouts of G's and x's ``[BLOCK_K, 128]`` boxes and grad_weight's ``[128, 128]``."""
        return tuple(
            gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
            for box in ([_BLOCK_K, _TILE], [_BLOCK_K, _TILE], [_TILE, _TILE])
        )


@functools.cache
def _gluon_family(device: torch.device) -> str | None:
    """``device``'s GPU family where it can run the kernel (a compiled Hopper GPU, Gluon present), else None."""
    if KERNELS_INTERPRETED or device.type != "cuda" or not gluon_available():
        return None
    if torch.cuda.get_device_capability(device) != WGMMA_COMPUTE_CAPABILITY:
        return None
    return family_from_name(torch.cuda.get_device_name(device))


def accumulate_weight_grad(grad_weight: torch.Tensor, g: torch.Tensor, x: torch.Tensor, *, first: bool) -> None:
    """``grad_weight (+)= g.T @ x`` for one row chunk (``first``: overwrite): on the Gluon kernel where
    :mod:`flce_policy.plan.weight_grad_gemm` says it is faster and the tensors suit it (bf16 throughout, contiguous
    gradient, TMA-aligned rows), else cuBLAS (:func:`.gemm.accumulate_mm`). Same result either way, up to fp32
    summation order and, added in memory, the update's own rounding to bf16."""
    family = _gluon_family(g.device)
    gemm = (
        "cublas"
        if family is None
        else weight_grad_gemm_for(family, g.shape[0], first=first, in_memory_available=reduce_add_available())
    )
    if (
        gemm != "cublas"
        and grad_weight.dtype == g.dtype == x.dtype == torch.bfloat16
        and grad_weight.is_contiguous()
        and g.shape[1] % 8 == 0
        and x.shape[1] % 8 == 0
        and tma_tensors(g, x, grad_weight)
    ):
        launch_weight_grad_gemm(grad_weight, g, x, first=first, add_in_memory=gemm == "gluon_in_memory")
    else:
        accumulate_mm(grad_weight, g.t(), x, first=first)


def weight_grad_gemm(
    grad_weight: torch.Tensor, g: torch.Tensor, x: torch.Tensor, *, first: bool, add_in_memory: bool = False
) -> None:
    """``grad_weight (+)= g.T @ x`` in place (``first``: overwrite, grad_weight unread), fp32 accumulation of each
    tile's products, rounded once to bf16 after adding the tile's previous value; with ``add_in_memory`` the
    products are rounded to bf16 and the memory system adds them to the old value (TMA's bulk reduce, rounded again):
    the SMs never read grad_weight.

    ``grad_weight`` bf16 ``[V, H]`` contiguous; ``g`` bf16 ``[n, V]`` and ``x`` bf16 ``[n, H]`` with contiguous
    rows; V, H multiples of 8; all on one Hopper GPU. ValueError or RuntimeError otherwise."""
    _check(grad_weight, g, x)
    if not gluon_available():
        raise RuntimeError("the grad_weight GEMM needs Triton's Gluon Hopper API, absent here")
    if torch.cuda.get_device_capability(g.device) != WGMMA_COMPUTE_CAPABILITY:
        raise RuntimeError("the grad_weight GEMM runs on Hopper (sm_90) only: wgmma")
    launch_weight_grad_gemm(grad_weight, g, x, first=first, add_in_memory=add_in_memory)


def _check(grad_weight: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    """ValueError for tensors the kernel cannot take, from their metadata."""
    for name, t in (("grad_weight", grad_weight), ("g", g), ("x", x)):
        if t.dim() != 2 or t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be a 2-D bf16 tensor, got {t.dtype} of shape {list(t.shape)}")
        if t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
            raise ValueError(f"{name} needs contiguous, 16-byte aligned rows (TMA), got strides {t.stride()}")
    devices = {str(t.device) for t in (grad_weight, g, x)}
    if len(devices) > 1 or g.device.type != "cuda":
        raise ValueError(f"all tensors must be on one CUDA device, got {sorted(devices)}")
    (n, vocab), hidden = g.shape, x.shape[1]
    if x.shape[0] != n or tuple(grad_weight.shape) != (vocab, hidden):
        raise ValueError(
            f"g [n, V], x [n, H] and grad_weight [V, H] needed, got {list(g.shape)}, {list(x.shape)}, "
            f"{list(grad_weight.shape)}"
        )
    if vocab % 8 or hidden % 8:
        raise ValueError(f"V ({vocab}) and H ({hidden}) must be multiples of 8 (TMA: 16-byte row strides)")


def reduce_add_available() -> bool:
    """Whether this Triton's Gluon has the TMA bulk reduce that ``add_in_memory`` uses."""
    return gluon_available() and tma_reduce_add is not None


def launch_weight_grad_gemm(
    grad_weight: torch.Tensor, g: torch.Tensor, x: torch.Tensor, *, first: bool, add_in_memory: bool = False
) -> None:
    """:func:`weight_grad_gemm` with nothing checked: the driver's launch on tensors its routing let through."""
    if add_in_memory and not reduce_add_available():  # the kernel would compile a plain store in its place
        raise RuntimeError(
            f"adding grad_weight in memory ({WEIGHT_GRAD_GEMM_ENV_VAR}=reduce) needs TMA's bulk reduce in Triton's "
            "Gluon, which this Triton lacks"
        )
    n, vocab = g.shape
    hidden = x.shape[1]
    if n == 0:
        if first:
            grad_weight.zero_()
        return
    stages, consumer_regs, producer_regs = _LAUNCH
    g_layout, x_layout, c_layout = _shared_layouts()
    g_desc = TensorDescriptor.from_tensor(g, [_BLOCK_K, _TILE], g_layout)
    x_desc = TensorDescriptor.from_tensor(x, [_BLOCK_K, _TILE], x_layout)
    c_desc = TensorDescriptor.from_tensor(grad_weight, [_TILE, _TILE], c_layout)
    tiles = -(-vocab // _TILE) * -(-hidden // _TILE)
    _weight_grad_kernel[(min(sm_count(g.device), tiles),)](
        g_desc, x_desc, c_desc, vocab, hidden, n, STAGES=stages, CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, UPDATE=0 if first else 2 if add_in_memory else 1, num_warps=4,
    )  # fmt: skip
