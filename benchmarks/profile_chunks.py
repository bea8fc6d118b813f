"""Where a fwd+bwd's GPU time goes, per kernel: ``python -m flce_policy.benchmarks.profile_chunks BTxHxV CHUNK...``.

Prints the CUDA time of each kernel name summed over one profiled fwd+bwd (after a warm-up),
for our loss at each chunk size and for liger-kernel at the same shape when it is installed.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from .methods import Inputs, liger, make_inputs, ours
from .suite import parse_shape


def kernel_times(step, repeats: int = 3) -> dict[str, float]:
    """Mean CUDA milliseconds per call of ``step``, by kernel name."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.key[:70]] += event.device_time_total / 1000 / repeats
    return dict(totals)


def show(label: str, totals: dict[str, float]) -> None:
    print(f"--- {label}: {sum(totals.values()):.2f} ms of kernels")
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {ms:9.3f} ms  {name}")


def main(argv: list[str]) -> None:
    from flce_policy.strategies import FixedChunkSize

    shape = parse_shape(argv[0])
    inputs: Inputs = make_inputs(*shape, logit_std=4.0)
    for chunk in (int(c) for c in argv[1:]):
        show(f"ours chunk {chunk}", kernel_times(ours(lambda i, c=chunk: FixedChunkSize(c))(inputs)))
    try:
        show("liger c=1", kernel_times(liger(1)(inputs)))
    except Exception as err:  # noqa: BLE001 - a missing peer only skips its row
        print("liger:", err)


if __name__ == "__main__":
    main(sys.argv[1:])
