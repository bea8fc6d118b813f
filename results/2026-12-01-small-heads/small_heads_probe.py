# ruff: noqa: B023, E501
"""Issue 25 probe: where a small head's time goes, and whether Triton GEMMs with a scaled-exp
epilogue / scaled operand load can replace cuBLAS + the CE passes.

python proto/small_heads_probe.py  (on the H200)
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

LOG2E = 1.4426950408889634


def _configs(fwd: bool):
    out = []
    for bm, bn, bk, w, s in [
        (128, 256, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 64, 8, 4),
        (256, 128, 64, 8, 3),
        (128, 256, 64, 8, 4),
        (64, 256, 64, 4, 4),
    ]:
        out.append(triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=s))
    return out


@triton.autotune(configs=_configs(True), key=["M", "N", "K", "EPILOGUE"])
@triton.jit
def fwd_kernel(
    x_ptr,
    w_ptr,
    e_ptr,
    m_ptr,
    d_ptr,
    M,
    N,
    K,
    sxm,
    swn,
    sem,
    spm,
    EPILOGUE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    in_group = GROUP_M * num_pid_n
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % in_group) % size_m)
    pid_n = (pid % in_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = x_ptr + (rm % M)[:, None].to(tl.int64) * sxm + rk[None, :]
    b_ptrs = w_ptr + (rn % N)[None, :].to(tl.int64) * swn + rk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        a = tl.load(a_ptrs, mask=rk[None, :] < K - k * BK, other=0.0)
        b = tl.load(b_ptrs, mask=rk[:, None] < K - k * BK, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    if EPILOGUE:
        acc = tl.where(rn[None, :] < N, acc, -float("inf"))
        m = tl.max(acc, 1)
        e = tl.exp2((acc - m[:, None]) * 1.4426950408889634)
        d = tl.sum(e, 1)
        tl.store(m_ptr + rm * spm + pid_n, m, mask=rm < M)
        tl.store(d_ptr + rm * spm + pid_n, d, mask=rm < M)
        out = e
    else:
        out = acc
    e_ptrs = e_ptr + rm[:, None].to(tl.int64) * sem + rn[None, :]
    tl.store(e_ptrs, out.to(e_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def fwd(x, w, epilogue: bool, out=None):
    M, K = x.shape
    N = w.shape[0]
    e = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    tiles = triton.cdiv(N, 64)  # enough slots for any BN >= 64
    m = torch.empty((M, tiles), dtype=torch.float32, device=x.device)
    d = torch.empty((M, tiles), dtype=torch.float32, device=x.device)
    grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
    fwd_kernel[grid](x, w, e, m, d, M, N, K, x.stride(0), w.stride(0), e.stride(0), m.stride(0), EPILOGUE=epilogue)
    return e, m, d


@triton.jit
def finish_kernel(e_ptr, s_ptr, M, N, sem, sps, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """In place: G = e * s[row, col // TILE] (the one-hot part is applied elsewhere)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    e = tl.load(e_ptr + row.to(tl.int64) * sem + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + row * sps + cols // TILE, mask=mask, other=0.0)
    tl.store(e_ptr + row.to(tl.int64) * sem + cols, (e * s).to(e_ptr.dtype.element_ty), mask=mask)


def _bwd_configs():
    out = []
    for bm, bn, bk, w, s in [
        (128, 128, 64, 8, 4),
        (128, 256, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (128, 64, 64, 4, 4),
    ]:
        out.append(triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=s))
    return out


@triton.autotune(configs=_bwd_configs(), key=["M", "N", "K", "SCALE"])
@triton.jit
def gin_kernel(
    e_ptr,
    s_ptr,
    w_ptr,
    o_ptr,
    M,
    N,
    K,
    sem,
    sps,
    swk,
    som,
    SCALE: tl.constexpr,
    TILE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """o[M, N=H] = (e * s)[M, K=V] @ w[K=V, N=H]."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    in_group = GROUP_M * num_pid_n
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % in_group) % size_m)
    pid_n = (pid % in_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = e_ptr + (rm % M)[:, None].to(tl.int64) * sem + rk[None, :]
    b_ptrs = w_ptr + rk[:, None].to(tl.int64) * swk + (rn % N)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        kmask = rk < K - k * BK
        a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
        if SCALE:
            s = tl.load(s_ptr + (rm % M) * sps + (k * BK) // TILE)
            a = (a.to(tl.float32) * s[:, None]).to(a_ptrs.dtype.element_ty)
        b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK * swk
    o_ptrs = o_ptr + rm[:, None].to(tl.int64) * som + rn[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def gin(e, s, w, tile, scale):
    M, K = e.shape
    N = w.shape[1]
    o = torch.empty((M, N), dtype=e.dtype, device=e.device)
    grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
    gin_kernel[grid](e, s, w, o, M, N, K, e.stride(0), s.stride(0), w.stride(0), o.stride(0), SCALE=scale, TILE=tile)
    return o


@triton.autotune(configs=_bwd_configs(), key=["M", "N", "K", "SCALE"])
@triton.jit
def gw_kernel(
    e_ptr,
    s_ptr,
    x_ptr,
    o_ptr,
    M,
    N,
    K,
    sek,
    sps,
    sxk,
    som,
    SCALE: tl.constexpr,
    TILE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """o[M=V, N=H] = (e * s)^T[V, K=rows] @ x[rows, H]; e is [rows, V] row-major."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    in_group = GROUP_M * num_pid_n
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % in_group) % size_m)
    pid_n = (pid % in_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = e_ptr + rk[None, :].to(tl.int64) * sek + (rm % M)[:, None]
    b_ptrs = x_ptr + rk[:, None].to(tl.int64) * sxk + (rn % N)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    tile = (pid_m * BM) // TILE
    for k in range(0, tl.cdiv(K, BK)):
        kmask = rk < K - k * BK
        a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
        if SCALE:
            s = tl.load(s_ptr + (k * BK + rk) * sps + tile, mask=kmask, other=0.0)
            a = (a.to(tl.float32) * s[None, :]).to(a_ptrs.dtype.element_ty)
        b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK * sek
        b_ptrs += BK * sxk
    o_ptrs = o_ptr + rm[:, None].to(tl.int64) * som + rn[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def gw(e, s, x, tile, scale, out_dtype):
    K, M = e.shape
    N = x.shape[1]
    o = torch.empty((M, N), dtype=out_dtype, device=e.device)
    grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
    gw_kernel[grid](e, s, x, o, M, N, K, e.stride(0), s.stride(0), x.stride(0), o.stride(0), SCALE=scale, TILE=tile)
    return o


def bench(fn):
    return do_bench(fn, warmup=10, rep=60)


def probe(bt: int, h: int, v: int, chunk: int) -> None:
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(chunk, h, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(v, h, device=dev, dtype=torch.bfloat16) * (4.0 / h**0.5)).to(torch.bfloat16)
    flop = 2 * chunk * h * v
    logits = torch.empty(chunk, v, device=dev, dtype=torch.bfloat16)
    t_cub_fwd = bench(lambda: torch.mm(x, w.t(), out=logits))
    t_tri_plain = bench(lambda: fwd(x, w, False, out=logits))
    t_tri_epi = bench(lambda: fwd(x, w, True, out=logits))
    g = logits  # stand-in gradient slab
    gin_out = torch.empty(chunk, h, device=dev, dtype=torch.bfloat16)
    gw_out = torch.empty(v, h, device=dev, dtype=torch.float32)
    t_cub_gin = bench(lambda: torch.mm(g, w, out=gin_out))
    t_cub_gw = bench(lambda: torch.addmm(gw_out, g.t(), x, out_dtype=torch.float32, out=gw_out))
    t_cub_gw_bf = bench(lambda: torch.mm(g.t(), x))
    tile = 256
    s = torch.rand(chunk, triton.cdiv(v, 64), device=dev)
    t_tri_gin = bench(lambda: gin(g, s, w, tile, False))
    t_tri_gin_s = bench(lambda: gin(g, s, w, tile, True))
    t_tri_gw = bench(lambda: gw(g, s, x, tile, False, torch.float32))
    t_tri_gw_s = bench(lambda: gw(g, s, x, tile, True, torch.float32))
    t_finish = bench(
        lambda: finish_kernel[(chunk, triton.cdiv(v, 4096))](
            g, s, chunk, v, g.stride(0), s.stride(0), TILE=tile, BLOCK=4096
        )
    )
    # our CE kernels alone over the slab
    from flce_policy.kernels.ce_kernel import ce_rows, ce_workspace

    tgt = torch.randint(0, v, (chunk,), device=dev)
    loss_rows = torch.empty(chunk, device=dev)
    ws = ce_workspace(chunk, v, x.device)
    scale = torch.tensor([1.0 / bt, 0.0], device=dev)
    torch.mm(x, w.t(), out=logits)
    t_ce = bench(lambda: ce_rows(logits, tgt, loss_rows, ws, ignore_index=-100, grad_scale=scale))
    print(f"\n=== chunk {chunk} x H {h} x V {v} (BT {bt}: {bt // chunk} chunks) ===")
    tf = lambda t: flop / t / 1e9  # noqa: E731
    print(f"fwd   cuBLAS mm          {t_cub_fwd:7.3f} ms  {tf(t_cub_fwd):6.0f} TFLOP/s")
    print(f"fwd   triton plain       {t_tri_plain:7.3f} ms  {tf(t_tri_plain):6.0f}  cfg {fwd_kernel.best_config}")
    print(f"fwd   triton +exp epi    {t_tri_epi:7.3f} ms  {tf(t_tri_epi):6.0f}")
    print(
        f"ce    ours (2 passes)    {t_ce:7.3f} ms   (slab {chunk * v * 2 / 2**30:.2f} GiB; {3 * chunk * v * 2 / t_ce / 1e9:.0f} GB/s at 3 passes)"
    )
    print(f"ce    finish-only scale  {t_finish:7.3f} ms   ({2 * chunk * v * 2 / t_finish / 1e9:.0f} GB/s at 2 passes)")
    print(f"gin   cuBLAS mm          {t_cub_gin:7.3f} ms  {tf(t_cub_gin):6.0f}")
    print(f"gin   triton plain       {t_tri_gin:7.3f} ms  {tf(t_tri_gin):6.0f}  cfg {gin_kernel.best_config}")
    print(f"gin   triton scaled-A    {t_tri_gin_s:7.3f} ms  {tf(t_tri_gin_s):6.0f}")
    print(f"gw    cuBLAS addmm fp32  {t_cub_gw:7.3f} ms  {tf(t_cub_gw):6.0f}")
    print(f"gw    cuBLAS mm bf16     {t_cub_gw_bf:7.3f} ms  {tf(t_cub_gw_bf):6.0f}")
    print(f"gw    triton plain fp32  {t_tri_gw:7.3f} ms  {tf(t_tri_gw):6.0f}  cfg {gw_kernel.best_config}")
    print(f"gw    triton scaled fp32 {t_tri_gw_s:7.3f} ms  {tf(t_tri_gw_s):6.0f}")
    cur = t_cub_fwd + t_ce + t_cub_gin + t_cub_gw
    fused = t_tri_epi + t_tri_gin_s + t_tri_gw_s
    floor = t_cub_fwd + t_cub_gin + t_cub_gw_bf
    print(
        f"per chunk: today ~{cur:.3f} ms ({cur / floor:.3f}x of the 3 cuBLAS GEMMs {floor:.3f}); "
        f"all-fused triton ~{fused:.3f} ({fused / floor:.3f}x); epi+finish+cuBLAS bwd "
        f"{t_tri_epi + t_finish + t_cub_gin + t_cub_gw:.3f} ({(t_tri_epi + t_finish + t_cub_gin + t_cub_gw) / floor:.3f}x)"
    )


def check() -> None:
    """Correctness of the prototypes against fp32 torch at an odd shape."""
    torch.manual_seed(1)
    M, K, N = 300, 192, 1000
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") * (4 / K**0.5)).to(torch.bfloat16)
    e, m, d = fwd(x, w, True)
    bn = fwd_kernel.best_config.kwargs["BN"]
    ref = x.float() @ w.float().t()
    tiles = triton.cdiv(N, bn)
    lse = torch.logsumexp(ref, 1)
    mt, dt = m[:, :tiles], d[:, :tiles]
    lse_k = torch.logsumexp(mt + dt.log(), 1)
    print("check fwd lse max err", (lse_k - lse).abs().max().item())
    s = torch.exp(mt - lse_k[:, None])  # per (row, tile): p = e * s
    p_ref = torch.softmax(ref, 1)
    col_tile = torch.arange(N, device="cuda") // bn
    p_k = e.float() * s[:, col_tile]
    print("check p rel err (scaled-exp)", ((p_k - p_ref).norm() / p_ref.norm()).item())
    p_bf = torch.softmax(ref.to(torch.bfloat16).float(), 1)
    print("check p rel err (bf16 logits)", ((p_bf - p_ref).norm() / p_ref.norm()).item())
    s_full = torch.zeros(M, triton.cdiv(N, 64), device="cuda")
    s_full[:, :tiles] = s
    wt = w.t().contiguous()  # [K=V? no]
    g_in = gin(e, s_full, w, bn, True)  # e [M, N=V] @ w [V, K=H]
    print("check gin rel err", ((g_in.float() - p_ref @ w.float()).norm() / (p_ref @ w.float()).norm()).item())
    g_w = gw(e, s_full, x, bn, True, torch.float32)
    ref_gw = p_ref.t() @ x.float()
    print("check gw rel err", ((g_w - ref_gw).norm() / ref_gw.norm()).item())
    del wt


if __name__ == "__main__":
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))
    check() if "--check" in sys.argv else None
    sys.argv = [a for a in sys.argv if a != "--check"]
    shapes = [
        (16384, 896, 151936, 4096),
        (16384, 1024, 131072, 8192),
        (16384, 2048, 128256, 8192),
        (16384, 3072, 128256, 8192),
        (16384, 1152, 262144, 4096),
    ]
    for shape in shapes[: int(sys.argv[1]) if len(sys.argv) > 1 else None]:
        probe(*shape)
