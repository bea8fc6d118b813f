"""One row chunk's grad_weight alone: cuBLAS's ``addmm`` (beta=1, as the driver runs it) against the Triton kernel
that loads the old block before its K loop (:mod:`flce_policy.kernels.weight_grad_gemm`), at a few launches.

    python -m flce_policy.benchmarks.weight_grad_gemm_bench [SHAPE] [ROWS ...] [--rounds N] [--out FILE]

SHAPE is BTxHxV (its H and V count; default 8192x5376x262144), ROWS the chunk rows (default 256 512 1024). Each
method accumulates into one bf16 ``[V, H]`` buffer; calls interleaved, one of each method a round, CUDA events;
the median per method, its bytes (the buffer read and written, G and x read) over that time, and its largest
difference from cuBLAS's result on the same operands, over the largest value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from flce_policy.kernels.gemm import accumulate_mm
from flce_policy.kernels.weight_grad_gemm import WeightGradLaunch, weight_grad_gemm

from .measure import time_call
from .suite import parse_shapes

#: the launches timed: (block_v, block_h, block_r, warps, stages)
LAUNCHES = tuple(
    WeightGradLaunch(*launch)
    for launch in (
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 3),
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (128, 128, 32, 4, 4),
        (64, 256, 64, 4, 3),
        (128, 64, 64, 4, 4),
    )
)


def _methods() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]]:
    methods: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = {
        "cublas_addmm": lambda acc, g, x: accumulate_mm(acc, g.t(), x, first=False),
    }
    for launch in LAUNCHES:
        name = "triton_{}x{}x{}_w{}_s{}".format(*launch)
        methods[name] = lambda acc, g, x, launch=launch: weight_grad_gemm(acc, g, x, first=False, launch=launch)
    return methods


def run(hidden: int, vocab: int, rows: int, rounds: int, device: torch.device) -> dict[str, dict[str, float]]:
    """Each method's median ms, GB/s and relative difference from cuBLAS at one chunk of ``rows``."""
    gen = torch.Generator(device=device).manual_seed(rows)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's smoke test: fp32
    g = torch.randn(rows, vocab, device=device, generator=gen).to(dtype)
    x = torch.randn(rows, hidden, device=device, generator=gen).to(dtype)
    start = torch.randn(vocab, hidden, device=device, generator=gen).to(dtype)
    methods = _methods()
    reference = start.clone()
    methods["cublas_addmm"](reference, g, x)
    scale = reference.float().abs().max().item()
    out: dict[str, dict[str, float]] = {}
    acc = start.clone()
    for name, method in methods.items():  # the error on the same operands, and each compiled before timing
        acc.copy_(start)
        method(acc, g, x)
        out[name] = {"max_diff_rel": (acc.float() - reference.float()).abs().max().item() / scale}
        method(acc, g, x)
    del reference
    laps: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, method in methods.items():
            laps[name].append(_milliseconds(lambda method=method: method(acc, g, x), device))
    moved = (2 * vocab * hidden + rows * (vocab + hidden)) * g.element_size()
    for name, times in laps.items():
        ms = statistics.median(times)
        out[name].update(ms=round(ms, 4), gb_per_s=round(moved / ms / 1e6, 1))
    return out


def _milliseconds(action: Callable[[], None], device: torch.device) -> float:
    """One call's time: :func:`.measure.time_call` on a GPU, the host's clock on the CPU (the interpreter's test)."""
    if device.type == "cuda":
        return time_call(action)
    begin_s = time.perf_counter()
    action()
    return (time.perf_counter() - begin_s) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flce_policy.benchmarks.weight_grad_gemm_bench", description=__doc__
    )
    parser.add_argument("shape", nargs="?", type=parse_shapes, default=None, help="BTxHxV (default 8192x5376x262144)")
    parser.add_argument("rows", nargs="*", type=int, default=[256, 512, 1024], help="chunk rows (256 512 1024)")
    parser.add_argument("--rounds", type=int, default=15, help="timed calls per method (15)")
    parser.add_argument("--out", type=Path, help="a JSON file for the results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    _, hidden, vocab = args.shape[0] if args.shape else (8192, 5376, 262144)
    device = torch.device("cuda")
    results = {}
    for rows in args.rows:
        results[rows] = run(hidden, vocab, rows, args.rounds, device)
        base = results[rows]["cublas_addmm"]["ms"]
        print(f"{rows} rows x H={hidden} x V={vocab}:")
        for name, row in results[rows].items():
            print(
                f"  {name:28s} {row['ms']:8.3f} ms  {row['ms'] / base:6.3f}x cuBLAS  {row['gb_per_s']:7.1f} GB/s  "
                f"diff {row['max_diff_rel']:.2e}"
            )
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
