# ruff: noqa
"""Issue 26 probe (session 24): ALL_KEPT_COST at 32-row tiles. The filtered grad_weight kernel
(filtered_weight_grad, dense_fallback=False) with a share of its tiles kept, drawn uniformly, over cuBLAS's
addmm of the same chunk; wide TMA (hidden a multiple of 256), narrow TMA (896) and pointer (x with an unaligned
row stride). The kept share from which cuBLAS is faster is 1 / (time at 100% / cuBLAS) if the time is linear."""

import os, torch, triton
import flce_policy.kernels.weight_grad_filter as wgf
from flce_policy.plan.weight_filter import ALL_KEPT_COST, FILTER_COLS, FILTER_ROWS, KEPT_FLAG

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
dev = "cuda" if CUDA else "cpu"
gen = torch.Generator(device=dev).manual_seed(0)
if CUDA:
    from triton.testing import do_bench

    shapes = [
        (4096, 1024, 131072, False),
        (8192, 1024, 131072, False),
        (16384, 1024, 131072, False),
        (4096, 896, 151936, False),
        (8192, 896, 151936, False),
        (4096, 2048, 151936, False),
        (8192, 2048, 151936, False),
        (1152, 5376, 262144, False),
        (4096, 1024, 131072, True),
    ]
    shares = (1.0, 0.9, 0.8, 0.5)
else:
    shapes, shares = [(96, 64, 512, False), (96, 48, 384, True)], (1.0, 0.5)
print("FILTER_ROWS", FILTER_ROWS, "FILTER_COLS", FILTER_COLS, "ALL_KEPT_COST", ALL_KEPT_COST, flush=True)
for n, h, v, pointer in shapes:
    g = (torch.rand(n, v, device=dev, generator=gen) * 1e-3).bfloat16()
    if pointer:
        x = torch.randn(n, h + 1, device=dev, generator=gen).bfloat16()[:, :h]
    else:
        x = torch.randn(n, h, device=dev, generator=gen).bfloat16()
    launch = "pointer" if not wgf.tma_tensors(g, x) else ("tma_narrow" if h % wgf._TMA_LAUNCH[0] else "tma")
    gw = torch.zeros(v, h, device=dev, dtype=torch.bfloat16)
    ref = torch.zeros(v, h, device=dev, dtype=torch.bfloat16)
    scratch = wgf.filter_scratch(n, v, torch.device(dev))
    cols = triton.cdiv(v, FILTER_COLS)
    line = [f"{n}x{h}x{v} {launch}"]
    t_ref = None
    if CUDA:
        t_ref = min(do_bench(lambda: torch.addmm(ref, g.t(), x, out=ref), warmup=5, rep=60) for _ in range(3))
        line.append(f"cuBLAS {t_ref:.3f} ms")
    for share in shares:
        tiles = torch.rand(triton.cdiv(n, FILTER_ROWS), cols, device=dev, generator=gen) < share
        keep_rows = tiles.repeat_interleave(FILTER_ROWS, 0)[:n]
        scratch.flags[:n, :cols].copy_(torch.where(keep_rows, KEPT_FLAG, KEPT_FLAG - 20).to(torch.uint8))
        wgf.filtered_weight_grad(gw, g, x, scratch, first=True, dense_fallback=False)
        keep = keep_rows.repeat_interleave(FILTER_COLS, 1)[:, :v].float()
        want = (g.float() * keep).t() @ x.float()
        err = float((gw.float() - want).norm() / want.norm())
        if not CUDA:
            line.append(f"kept {share:.0%}: err {err:.2e}")
            continue
        t = min(
            do_bench(
                lambda: wgf.filtered_weight_grad(gw, g, x, scratch, first=False, dense_fallback=False), warmup=5, rep=60
            )
            for _ in range(3)
        )
        line.append(f"kept {share:.0%}: {t / t_ref:.3f} (err {err:.1e})")
    print(" | ".join(line), flush=True)
    del g, x, gw, ref, scratch
