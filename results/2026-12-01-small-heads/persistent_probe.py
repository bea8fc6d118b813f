# ruff: noqa: B023, E501
"""Issue 25 probe 2: a persistent TMA Triton GEMM (logits = x @ W.T) with and without the scaled-exp
epilogue, against cuBLAS, at the small heads' chunk shapes."""

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count


def _cfgs():
    out = []
    for bm, bn, bk, w, s in [
        (128, 256, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 64, 8, 4),
        (128, 256, 64, 8, 4),
        (256, 128, 64, 8, 3),
        (128, 128, 128, 8, 3),
        (64, 256, 64, 4, 4),
    ]:
        for flat in (False, True):
            out.append(
                triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "FLATTEN": flat}, num_warps=w, num_stages=s)
            )
    return out


def _pre(nargs):
    bm, bn, bk = nargs["BM"], nargs["BN"], nargs["BK"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn]


@triton.autotune(
    configs=[triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=_pre) for c in _cfgs()],
    key=["M", "N", "K", "EPILOGUE"],
)
@triton.jit
def pfwd(
    a_desc,
    b_desc,
    c_desc,
    m_ptr,
    d_ptr,
    M,
    N,
    K,
    spm,
    NUM_SMS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    in_group = GROUP_M * num_pid_n
    for tile_id in tl.range(start, num_tiles, NUM_SMS, flatten=FLATTEN):
        group = tile_id // in_group
        first_m = group * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + ((tile_id % in_group) % size_m)
        pid_n = (tile_id % in_group) // size_m
        om = pid_m * BM
        on = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([om, ki * BK])
            b = b_desc.load([on, ki * BK])
            acc = tl.dot(a, b.T, acc)
        if EPILOGUE:
            rn = on + tl.arange(0, BN)
            rm = om + tl.arange(0, BM)
            acc = tl.where(rn[None, :] < N, acc, -float("inf"))
            m = tl.max(acc, 1)
            acc = tl.exp2((acc - m[:, None]) * 1.4426950408889634)
            d = tl.sum(acc, 1)
            tl.store(m_ptr + rm * spm + pid_n, m, mask=rm < M)
            tl.store(d_ptr + rm * spm + pid_n, d, mask=rm < M)
        c_desc.store([om, on], acc.to(tl.bfloat16))


def run(x, w, out, epilogue):
    M, K = x.shape
    N = w.shape[0]
    dummy = [1, 1]
    a = TensorDescriptor(x, x.shape, x.stride(), dummy)
    b = TensorDescriptor(w, w.shape, w.stride(), dummy)
    c = TensorDescriptor(out, out.shape, out.stride(), dummy)
    m = torch.empty((M, triton.cdiv(N, 64)), device=x.device)
    d = torch.empty_like(m)
    grid = lambda meta: (min(NUM_SMS, triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"])),)  # noqa: E731
    pfwd[grid](a, b, c, m, d, M, N, K, m.stride(0), NUM_SMS=NUM_SMS, EPILOGUE=epilogue)
    return m, d


def main():
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0), NUM_SMS, "SMs")
    torch.manual_seed(0)
    # correctness at an odd shape
    x = torch.randn(300, 192, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(1000, 192, device="cuda") * 0.3).to(torch.bfloat16)
    out = torch.empty(300, 1000, device="cuda", dtype=torch.bfloat16)
    run(x, w, out, False)
    print("plain max err", (out.float() - x.float() @ w.float().t()).abs().max().item())
    for chunk, h, v in [(4096, 896, 151936), (8192, 1024, 131072), (4096, 1152, 262144), (8192, 2048, 128256)]:
        x = torch.randn(chunk, h, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(v, h, device="cuda") * (4 / h**0.5)).to(torch.bfloat16)
        out = torch.empty(chunk, v, device="cuda", dtype=torch.bfloat16)
        flop = 2 * chunk * h * v
        t_c = do_bench(lambda: torch.mm(x, w.t(), out=out), warmup=10, rep=80)
        t_p = do_bench(lambda: run(x, w, out, False), warmup=10, rep=80)
        cfg_p = pfwd.best_config
        t_e = do_bench(lambda: run(x, w, out, True), warmup=10, rep=80)
        cfg_e = pfwd.best_config
        print(
            f"{chunk}x{h}x{v}: cuBLAS {t_c:.3f} ms ({flop / t_c / 1e9:.0f} TF/s) | persistent TMA plain {t_p:.3f} "
            f"({t_p / t_c:.3f}x) [{cfg_p}] | + exp epilogue {t_e:.3f} ({t_e / t_c:.3f}x) [{cfg_e}]",
            flush=True,
        )


if __name__ == "__main__":
    main()
