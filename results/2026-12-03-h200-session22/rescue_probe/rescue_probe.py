# ruff: noqa
"""Session 22 probe (issue 26): what the rescue's per-level loops cost the filtered grad_weight kernel, and two
single-loop forms.

kernels/weight_grad_filter.py's _listed_tma_kernel runs the rescued tiles in one pipelined loop per level (the
accumulator doubled after each), then the kept tiles. Variants, on synthetic lists (per column block: a share of
tiles kept, a share rescued spread evenly over levels 1..4), 16384 x H x V, one launch (FIRST, no bias):
- levels: the kernel as it is (MAX_LEVEL=4);
- flat:   the kernel with MAX_LEVEL=0 over the same listed tiles (no factors: a lower bound, wrong sums);
- gscale: one loop, each G tile scaled by its 2^L in registers before the dot;
- xstack: one loop, x read from a stacked copy [x; 2x; 4x; 8x; 16x] at the tile's level (built per call, timed).
Each against an fp32 reference of the factored sum, and timed over cuBLAS's G^T x (median of 5 interleaved
rounds of 10 launches behind a sleep).
"""

import os, statistics, sys
import torch, triton
import triton.language as tl
from flce_policy.kernels import weight_grad_filter as wgf
from flce_policy.kernels.tma import TensorDescriptor

SMALL = os.environ.get("TRITON_INTERPRET") == "1"  # a CPU check of the sums at small shapes
dev = "cpu" if SMALL else "cuda"
DT = torch.float32 if SMALL else torch.bfloat16  # the interpreter's bf16 arithmetic is wrong
MAXL = 4


@triton.jit
def one_loop_kernel(
    grad_desc,
    x_desc,
    tiles_ptr,
    tile_stride,
    counts_ptr,
    ends_ptr,
    out_ptr,
    out_stride,
    n_cols,
    hidden,
    n_rows,
    MAX_LEVEL: tl.constexpr,
    LEVELS: tl.constexpr,
    XSTACK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_v = tl.program_id(1)
    kept = tl.load(counts_ptr + pid_v)
    listed = tiles_ptr + pid_v * tile_stride
    lv = tl.arange(0, LEVELS)
    ends = tl.load(ends_ptr + pid_v * MAX_LEVEL + lv, mask=lv < MAX_LEVEL, other=0)
    acc = tl.zeros([BLOCK_V, BLOCK_H], dtype=tl.float32)
    next_tile = tl.load(listed, mask=kept > 0, other=0)
    for i in tl.range(0, kept, num_stages=STAGES):
        row = next_tile * BLOCK_K
        next_tile = tl.load(listed + i + 1, mask=i + 1 < kept, other=0)
        level = tl.sum((i < ends).to(tl.int32), axis=0)
        g = grad_desc.load([row, pid_v * BLOCK_V])
        if XSTACK:
            x = x_desc.load([row + level * n_rows, pid_h * BLOCK_H])
        else:
            factor = (tl.full([], 1, tl.int32) << level).to(tl.float32)
            g = g * factor.to(g.dtype)
            x = x_desc.load([row, pid_h * BLOCK_H])
        acc = tl.dot(tl.trans(g), x, acc)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    out = out_ptr + cols.to(tl.int64)[:, None] * out_stride + hs[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(cols < n_cols)[:, None] & (hs < hidden)[None, :])


def lists(row_tiles, col_blocks, kept_share, rescued_share, gen):
    u = torch.rand(col_blocks, row_tiles, device=dev, generator=gen)
    key = torch.full_like(u, MAXL + 1, dtype=torch.int32)  # skipped
    key[u < kept_share + rescued_share] = 0
    band = ((u - kept_share) / rescued_share * MAXL).clamp(0, MAXL - 1).to(torch.int32)  # 0..3
    resc = (u >= kept_share) & (u < kept_share + rescued_share)
    key = torch.where(u < kept_share, torch.full_like(key, MAXL), key)
    key = torch.where(resc, band, key)  # key j < MAXL: level MAXL - j, listed first
    order = torch.argsort(key, dim=1, stable=True).to(torch.int32).contiguous()
    counts = (key <= MAXL).sum(1).to(torch.int32).contiguous()
    ends = torch.stack([(key <= j).sum(1) for j in range(MAXL)], 1).to(torch.int32).contiguous()
    level = torch.where(key < MAXL, MAXL - key, torch.zeros_like(key))  # 0 for kept
    factor = torch.where(key <= MAXL, 2.0 ** level.float(), torch.zeros_like(u))
    return order, counts, ends, factor


def run(kind, g, x, xs, out, tiles, counts, ends, rows, cols, bh, warps, stages):
    n, hidden = x.shape
    grid = (triton.cdiv(hidden, bh), triton.cdiv(g.shape[1], cols))
    gd = TensorDescriptor.from_tensor(g, [rows, cols])
    if kind in ("levels", "flat"):
        wgf._listed_tma_kernel[grid](
            gd,
            TensorDescriptor.from_tensor(x, [rows, bh]),
            tiles,
            tiles.stride(0),
            counts,
            ends,
            out,
            out.stride(0),
            None,
            g.shape[1],
            hidden,
            MAX_LEVEL=MAXL if kind == "levels" else 0,
            FIRST=True,
            HAS_WEIGHT=True,
            HAS_BIAS=False,
            IEEE=SMALL,
            BLOCK_V=cols,
            BLOCK_H=bh,
            BLOCK_K=rows,
            STAGES=stages,
            num_warps=warps,
            num_stages=stages,
        )
        return
    if kind == "xstack":
        torch.mul(x.unsqueeze(0), xs_scale, out=xs.view(MAXL + 1, n, hidden))
    xd = TensorDescriptor.from_tensor(xs if kind == "xstack" else x, [rows, bh])
    one_loop_kernel[grid](
        gd,
        xd,
        tiles,
        tiles.stride(0),
        counts,
        ends,
        out,
        out.stride(0),
        g.shape[1],
        hidden,
        n,
        MAX_LEVEL=MAXL,
        LEVELS=triton.next_power_of_2(MAXL),
        XSTACK=kind == "xstack",
        BLOCK_V=cols,
        BLOCK_H=bh,
        BLOCK_K=rows,
        STAGES=stages,
        num_warps=warps,
        num_stages=stages,
    )


n, hidden, vocab = (
    (512, 64, 1024)
    if SMALL
    else (16384, int(sys.argv[1]) if len(sys.argv) > 1 else 1024, int(sys.argv[2]) if len(sys.argv) > 2 else 131072)
)
torch.manual_seed(0)
g = (torch.randn(n, vocab, device=dev) * 0.01).to(DT)
x = torch.randn(n, hidden, device=dev).to(DT)
xs = torch.empty((MAXL + 1) * n, hidden, device=dev, dtype=DT)
xs_scale = (2.0 ** torch.arange(MAXL + 1, device=dev)).view(-1, 1, 1).to(DT)
out = torch.empty(vocab, hidden, device=dev, dtype=DT)
ref_out = torch.empty_like(out)
gen = torch.Generator(device=dev).manual_seed(0)
for rows, kept_share, rescued_share in ((32, 0.19, 0.09), (64, 0.27, 0.12), (32, 0.19, 0.0)):
    cfg = (rows, 128, 32 if SMALL else 256, 8, 4)
    tiles, counts, ends, factor = lists(n // rows, vocab // 128, kept_share, rescued_share, gen)
    runs = {"cublas": lambda: torch.mm(g.t(), x, out=ref_out)}
    mask = factor.t().repeat_interleave(rows, 0).repeat_interleave(128, 1)
    ref = (g.float() * mask).t() @ x.float()
    del mask
    for kind in ("levels", "flat", "gscale", "xstack"):
        try:
            run(kind, g, x, xs, out, tiles, counts, ends, *cfg)
            if not SMALL:
                torch.cuda.synchronize()
        except Exception as exc:
            print(f"  {kind}: ERR {type(exc).__name__} {str(exc)[:200]}", flush=True)
            continue
        err = ((out.float() - ref).norm() / ref.norm()).item()
        print(f"  rows {rows} kept {kept_share} rescued {rescued_share} {kind}: rel err vs fp32 {err:.2e}", flush=True)
        runs[kind] = lambda a=(kind, g, x, xs, out, tiles, counts, ends, *cfg): run(*a)
    del ref
    if SMALL:
        continue
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
        f"== {n}x{hidden}x{vocab} rows {rows} kept {kept_share} rescued {rescued_share}: cublas {base:.3f} ms | "
        + " | ".join(
            f"{k} {statistics.median(v):.3f} ms ({statistics.median(v) / base:.3f})"
            for k, v in times.items()
            if k != "cublas"
        ),
        flush=True,
    )
