"""Time the CE kernels alone on one slab for kernel-setting variants (development tool).

``python -m flce_policy.benchmarks.tune_ce_kernel ROWS V`` prints partial+finish time and the
bandwidth it implies (2 reads + 1 write of the slab) for block width, warps and program count.
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton.testing

from flce_policy.kernels import ce_kernel


def time_variant(rows: int, vocab: int, block: int, warps: int, programs: int) -> float:
    ce_kernel.MAX_BLOCK_V, ce_kernel.WIDE_BLOCK_WARPS, ce_kernel.TARGET_PROGRAMS = block, warps, programs
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen).mul_(4).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    loss = torch.empty(rows, device="cuda")
    scale = torch.ones(2, device="cuda")
    workspace = ce_kernel.ce_workspace(rows, vocab, logits.device)

    def run() -> None:
        ce_kernel.ce_rows(logits, target, loss, workspace, ignore_index=-100, grad_scale=scale)

    return triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")


def main(argv: list[str]) -> None:
    rows, vocab = int(argv[0]), int(argv[1])
    slab_bytes = rows * vocab * 2
    for block, warps, programs in itertools.product((2048, 4096, 8192), (4, 8, 16), (2048, 8192)):
        ms = time_variant(rows, vocab, block, warps, programs)
        print(
            f"rows {rows} V {vocab} block {block:5d} warps {warps:2d} programs {programs:5d}: "
            f"{ms:.3f} ms  {3 * slab_bytes / ms / 1e9:.0f} GB/s",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
