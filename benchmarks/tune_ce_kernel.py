"""Time the CE kernels alone on one slab for kernel-setting variants (development tool).

``python -m flce_policy.benchmarks.tune_ce_kernel ROWS V`` prints partial+finish time and the
bandwidth it implies (2 reads + 1 write of the slab) for block width, warps and program count.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import triton.testing

from flce_policy.kernels import ce_kernel

#: the variants timed: ce_kernel's MAX_BLOCK_V, WIDE_BLOCK_WARPS and TARGET_PROGRAMS
BLOCKS, WARPS, PROGRAMS = (2048, 4096, 8192), (4, 8, 16), (2048, 8192)


@contextlib.contextmanager
def kernel_settings(block: int, warps: int, programs: int) -> Iterator[None]:
    """ce_kernel's block width, warps per wide block and program target for the calls inside; restored after."""
    saved = ce_kernel.MAX_BLOCK_V, ce_kernel.WIDE_BLOCK_WARPS, ce_kernel.TARGET_PROGRAMS
    ce_kernel.MAX_BLOCK_V, ce_kernel.WIDE_BLOCK_WARPS, ce_kernel.TARGET_PROGRAMS = block, warps, programs
    try:
        yield
    finally:
        ce_kernel.MAX_BLOCK_V, ce_kernel.WIDE_BLOCK_WARPS, ce_kernel.TARGET_PROGRAMS = saved


@dataclass
class SlabCall:
    """One chunk's CE call: per-row loss into ``loss``, the gradient written over ``logits`` (grad scale 1)."""

    logits: torch.Tensor
    target: torch.Tensor
    loss: torch.Tensor
    workspace: ce_kernel.CEWorkspace
    run: Callable[[], None]


def slab_call(rows: int, vocab: int, device: str = "cuda") -> SlabCall:
    """A bf16 slab of logits with std 4 and its call; the workspace is planned with the settings in force now."""
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, generator=gen).mul_(4).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    loss = torch.empty(rows, device=device)
    scale = torch.ones(2, device=device)
    workspace = ce_kernel.ce_workspace(rows, vocab, logits.device)

    def run() -> None:
        ce_kernel.ce_rows(logits, target, loss, workspace, ignore_index=-100, grad_scale=scale)

    return SlabCall(logits, target, loss, workspace, run)


def time_variant(rows: int, vocab: int, block: int, warps: int, programs: int) -> float:
    with kernel_settings(block, warps, programs):
        call = slab_call(rows, vocab)
        return triton.testing.do_bench(call.run, warmup=25, rep=200, return_mode="median")


def main(argv: list[str]) -> None:
    rows, vocab = int(argv[0]), int(argv[1])
    slab_bytes = rows * vocab * 2
    for block, warps, programs in itertools.product(BLOCKS, WARPS, PROGRAMS):
        ms = time_variant(rows, vocab, block, warps, programs)
        print(
            f"rows {rows} V {vocab} block {block:5d} warps {warps:2d} programs {programs:5d}: "
            f"{ms:.3f} ms  {3 * slab_bytes / ms / 1e9:.0f} GB/s",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
