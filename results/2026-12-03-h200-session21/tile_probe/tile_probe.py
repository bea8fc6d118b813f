# ruff: noqa
"""Session 21 probe (issue 26): the filtered grad_weight kernel's time per kept element at smaller tiles.

The rescue-scheme pricer (--tiles) says how much of grad_weight's error a finer tile removes at a given multiplied
share; this says what a finer tile costs the kernel. kernels/weight_grad_filter.py's _listed_tma_kernel launched
directly on synthetic lists (no rescue, FIRST), BLOCK_K = tile rows, BLOCK_V = tile columns, at 8192 x H x V:
kept tiles drawn uniformly at a share s, or skewed (the first 10% of column blocks every tile, the rest s' so that
the total is s). Time over cuBLAS's G^T x (median of 5 interleaved rounds of 10 launches behind a sleep).
"""

import statistics, sys
import torch, triton
from flce_policy.kernels import weight_grad_filter as wgf
from flce_policy.kernels.tma import TensorDescriptor

torch.manual_seed(0)
dev = "cuda"


def lists(row_tiles, col_blocks, share, skewed, gen):
    if skewed:
        heavy = max(1, col_blocks // 10)
        rest = max(0.0, (share * col_blocks - heavy) / (col_blocks - heavy))
        p = torch.full((col_blocks, 1), rest, device=dev)
        p[:heavy] = 1.0
        keep = torch.rand(col_blocks, row_tiles, device=dev, generator=gen) < p
    else:
        keep = torch.rand(col_blocks, row_tiles, device=dev, generator=gen) < share
    counts = keep.sum(1).to(torch.int32)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True).to(torch.int32)  # kept rows first, ascending
    return keep, order.contiguous(), counts.contiguous()


def launch(g, x, out, tiles, counts, ends, rows, cols, block_h, warps, stages):
    hidden = x.shape[1]
    wgf._listed_tma_kernel[(triton.cdiv(hidden, block_h), triton.cdiv(g.shape[1], cols))](
        TensorDescriptor.from_tensor(g, [rows, cols]),
        TensorDescriptor.from_tensor(x, [rows, block_h]),
        tiles,
        tiles.stride(0),
        counts,
        ends,
        out,
        out.stride(0),
        None,
        g.shape[1],
        hidden,
        MAX_LEVEL=0,
        FIRST=True,
        HAS_WEIGHT=True,
        HAS_BIAS=False,
        IEEE=False,
        BLOCK_V=cols,
        BLOCK_H=block_h,
        BLOCK_K=rows,
        STAGES=stages,
        num_warps=warps,
        num_stages=stages,
    )


configs = [  # (tile rows, tile cols, block_h, warps, stages)
    (64, 128, 256, 8, 4),
    (32, 128, 256, 8, 4),
    (32, 128, 256, 8, 6),
    (64, 64, 256, 4, 4),
    (64, 64, 256, 4, 5),
    (32, 64, 256, 4, 6),
    (16, 128, 256, 8, 8),
]
n, hidden, vocab = (
    8192,
    int(sys.argv[1]) if len(sys.argv) > 1 else 1024,
    int(sys.argv[2]) if len(sys.argv) > 2 else 131072,
)
g = (torch.randn(n, vocab, device=dev) * 0.01).bfloat16()
x = torch.randn(n, hidden, device=dev).bfloat16()
out = torch.empty(vocab, hidden, device=dev, dtype=torch.bfloat16)
ref_out = torch.empty_like(out)
gen = torch.Generator(device=dev).manual_seed(0)
for skewed in (False, True):
    for share in (0.2, 0.3, 0.4, 1.0):
        if skewed and share == 1.0:
            continue
        runs = {"cublas": lambda: torch.mm(g.t(), x, out=ref_out)}
        for rows, cols, bh, warps, stages in configs:
            keep, tiles, counts = lists(n // rows, vocab // cols, share, skewed, gen)
            ends = torch.zeros(1, device=dev, dtype=torch.int32)
            name = f"{rows}x{cols}/{bh}/{warps}/{stages}"
            try:
                launch(g, x, out, tiles, counts, ends, rows, cols, bh, warps, stages)
                torch.cuda.synchronize()
            except Exception as exc:  # out of resources and the like
                print(f"  {name}: ERR {type(exc).__name__} {str(exc)[:80]}")
                continue
            if share in (0.3,) and not skewed:
                mask = keep.t().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
                ref = (g.float() * mask).t() @ x.float()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                print(f"  {name}: rel err vs fp32 masked {err:.2e}, kept {keep.float().mean().item():.3f}")
            runs[name] = lambda a=(g, x, out, tiles, counts, ends, rows, cols, bh, warps, stages): launch(*a)
        times = {k: [] for k in runs}
        for _ in range(5):
            for k, f in runs.items():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(2_000_000)
                a.record()
                for _ in range(10):
                    f()
                b.record()
                b.synchronize()
                times[k].append(a.elapsed_time(b) / 10)
        base = statistics.median(times["cublas"])
        print(
            f"== {n}x{hidden}x{vocab} share {share} {'skewed' if skewed else 'uniform'}: cublas {base:.3f} ms | "
            + " | ".join(f"{k} {statistics.median(v) / base:.3f}" for k, v in times.items() if k != "cublas"),
            flush=True,
        )
