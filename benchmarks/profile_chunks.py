"""Where a fwd+bwd's time goes: ``python -m flce_policy.benchmarks.profile_chunks BTxHxV CHUNK...``.

For our loss at each chunk size, and for liger-kernel at C=1 and C=16 when it is installed: the
CUDA time of each kernel name summed over one profiled fwd+bwd (after a warm-up), the step's
wall time (CUDA events, GPU idle included) and the host time to issue it with an empty queue
(a step whose host time exceeds its kernel time is bound by the CPU, not the GPU).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from .methods import Inputs, _leaf_step, liger, make_inputs, ours
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


def wall_and_host_ms(step, repeats: int = 20) -> tuple[float, float]:
    """Median wall time of ``step`` (CUDA events) and median host time to issue it, in ms."""
    step()
    walls, hosts = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        step()
        stop.record()
        hosts.append((time.perf_counter() - began) * 1e3)
        stop.synchronize()
        walls.append(start.elapsed_time(stop))
    return statistics.median(walls), statistics.median(hosts)


def show(label: str, step) -> None:
    totals = kernel_times(step)
    wall, host = wall_and_host_ms(step)
    print(f"--- {label}: {sum(totals.values()):.2f} ms of kernels, {wall:.2f} ms wall, {host:.2f} ms to issue")
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {ms:9.3f} ms  {name}")


def profiled_steps(shape: tuple[int, int, int], chunks: list[int], device: str = "cuda") -> dict[str, Callable]:
    """label -> fwd+bwd step: ours at each chunk size, then liger-kernel at C=1 and C=16 where it builds (a peer
    that cannot is said and left out). ``device``: the GPU, or the CPU of the smoke test."""
    from flce_policy.strategies import FixedChunkSize

    inputs: Inputs = make_inputs(*shape, logit_std=4.0, device=device)
    steps = {}
    for chunk in chunks:
        steps[f"ours chunk {chunk}"] = _leaf_step(inputs, ours(lambda i, c=chunk: FixedChunkSize(c))(inputs))
    for chunk_mem_const in (1, 16):
        try:
            steps[f"liger c={chunk_mem_const}"] = _leaf_step(inputs, liger(chunk_mem_const)(inputs))
        except Exception as err:  # noqa: BLE001 - a missing peer only skips its row
            print("liger:", err)
    return steps


def main(argv: list[str]) -> None:
    for label, step in profiled_steps(parse_shape(argv[0]), [int(c) for c in argv[1:]]).items():
        try:
            show(label, step)
        except Exception as err:  # noqa: BLE001 - a peer that fails only skips its row
            if label.startswith("ours"):
                raise
            print(f"{label}: {err}")


if __name__ == "__main__":
    main(sys.argv[1:])
