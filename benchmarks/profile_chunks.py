"""Where a fwd+bwd's time goes: ``python -m flce_policy.benchmarks.profile_chunks BTxHxV CHUNK... [--slab-forms
FORM...] [--floor]``.

For the three cuBLAS GEMMs of the floor (``--floor``), our loss at each chunk size (in the engine's form, or in each
form of ``--slab-forms``, pinned), and for liger-kernel at C=1 and C=16 when it is installed: the
CUDA time of each kernel name summed over one profiled fwd+bwd (after a warm-up), the step's
wall time (CUDA events, GPU idle included) and the host time to issue it with an empty queue
(a step whose host time exceeds its kernel time is bound by the CPU, not the GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from flce_policy.plan.scaled_exp import SLAB_FORMS

from .methods import Inputs, _fixed_for_inputs, _leaf_step, gemm_floor, liger, make_inputs, ours
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


def profiled_steps(
    shape: tuple[int, int, int],
    chunks: list[int],
    device: str = "cuda",
    *,
    slab_forms: Sequence[str | None] = (None,),
    floor: bool = False,
) -> dict[str, Callable]:
    """label -> fwd+bwd step: the three cuBLAS GEMMs (``floor``), ours at each chunk size in each of ``slab_forms``
    (None: the form the engine chooses; a name: pinned), then liger-kernel at C=1 and C=16 where it builds (a peer
    that cannot is said and left out). ``device``: the GPU, or the CPU of the smoke test."""
    inputs: Inputs = make_inputs(*shape, logit_std=4.0, device=device)
    steps = {}
    if floor:
        steps["floor (three cuBLAS GEMMs)"] = gemm_floor(inputs)
    for chunk in chunks:
        for form in slab_forms:
            label = f"ours chunk {chunk}" if form is None else f"ours chunk {chunk} {form}"
            policy = _fixed_for_inputs(chunk, form, inputs)
            steps[label] = _leaf_step(inputs, ours(lambda i, p=policy: p)(inputs))
    for chunk_mem_const in (1, 16):
        try:
            steps[f"liger c={chunk_mem_const}"] = _leaf_step(inputs, liger(chunk_mem_const)(inputs))
        except Exception as err:  # noqa: BLE001 - a missing peer only skips its row
            print("liger:", err)
    return steps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flce_policy.benchmarks.profile_chunks", description=__doc__)
    parser.add_argument("shape", type=parse_shape, help="BTxHxV")
    parser.add_argument("chunks", type=int, nargs="+", help="chunk sizes (rows)")
    parser.add_argument(
        "--slab-forms", nargs="+", choices=SLAB_FORMS, help="pin each of these forms in turn (default: the engine's)"
    )
    parser.add_argument("--floor", action="store_true", help="the three cuBLAS GEMMs' kernels first")
    return parser


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    forms = args.slab_forms or [None]
    for label, step in profiled_steps(args.shape, args.chunks, slab_forms=forms, floor=args.floor).items():
        try:
            show(label, step)
        except Exception as err:  # noqa: BLE001 - a peer that fails only skips its row
            if label.startswith("ours"):
                raise
            print(f"{label}: {err}")


if __name__ == "__main__":
    main(sys.argv[1:])
