"""The GEMMs alone of a row-chunked pass, by how a chunk's backward GEMMs are scheduled, against the floor.

``python -m flce_policy.benchmarks.chunk_gemm_bound SHAPE CHUNK... [--split-k K ...]`` times, in one run, the
three-GEMM floor (:func:`.methods.gemm_floor`) and, at each chunk size, the three cuBLAS GEMMs a logits-slab
chunk runs (no cross-entropy kernel: the logits stand in for dL/dlogits) under each schedule:

- ``serial``: the logits GEMM, ``grad_input = G @ W``, ``grad_weight (+)= G.T @ x_c``, one after another (the
  driver's order);
- ``overlap``: grad_weight's GEMM on a second stream beside grad_input's (``Geometry.overlap_weight_grad``,
  :mod:`flce_policy.kernels.side_stream`);
- ``split_k{K}``: grad_input's GEMM over K slices of the vocab at once (one batched GEMM into fp32 partials,
  summed): at a small chunk ``[chunk, H]`` has too few output tiles to fill the GPU, its K = V is long;
- ``split_k{K}+overlap``: both.

A lower bound on each schedule of the driver, to tell which to build before building it. Why a small slab is
slow: each chunk's grad_weight GEMM reads and writes the whole ``[V, H]`` gradient; grad_input's leaves SMs idle.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import torch

from flce_policy.kernels.gemm import accumulate_mm
from flce_policy.kernels.side_stream import WeightGradStream

from .measure import measure
from .methods import Inputs, gemm_floor, make_inputs
from .suite import format_shape, parse_shape

__all__ = ["chunk_gemms", "schedules"]

Step = Callable[[], None]


def chunk_gemms(
    inputs: Inputs, chunk_size: int, *, split_k: int = 1, overlap: bool = False
) -> tuple[Step, torch.Tensor, torch.Tensor]:
    """One pass's GEMMs in chunks of ``chunk_size`` rows: the step, and the grad_input and grad_weight it writes.

    ``split_k`` > 1 splits grad_input's GEMM over that many vocab slices (V must divide); ``overlap`` queues
    grad_weight's GEMM on a side stream (CUDA only; in order elsewhere).
    """
    x, weight = inputs.x, inputs.weight
    tokens, vocab = x.shape[0], weight.shape[0]
    if vocab % split_k:
        raise ValueError(f"split_k={split_k} must divide V={vocab}")
    slab = torch.empty(chunk_size, vocab, device=x.device, dtype=x.dtype)
    grad_input, grad_weight = torch.empty_like(x), torch.empty_like(weight)
    slices = weight.view(split_k, vocab // split_k, weight.shape[1])
    streams = _streams(x.device, overlap)

    def step() -> None:
        for index, start in enumerate(range(0, tokens, chunk_size)):
            x_chunk = x[start : start + chunk_size]
            logits = slab[: x_chunk.shape[0]]
            torch.mm(x_chunk, weight.t(), out=logits)
            streams.fork()
            _grad_input(logits, weight, slices, grad_input[start : start + x_chunk.shape[0]])
            with streams.beside():
                accumulate_mm(grad_weight, logits.t(), x_chunk, first=index == 0)

    return step, grad_input, grad_weight


def _grad_input(logits: torch.Tensor, weight: torch.Tensor, slices: torch.Tensor, out: torch.Tensor) -> None:
    split_k = slices.shape[0]
    if split_k == 1:
        torch.mm(logits, weight, out=out)
        return
    # [rows, V] as [K, rows, V / K] (a strided batch, no copy); each slice's product in fp32, summed once
    per_slice = logits.view(logits.shape[0], split_k, -1).transpose(0, 1)
    if logits.is_cuda and logits.dtype != torch.float32:
        partials = torch.bmm(per_slice, slices, out_dtype=torch.float32)
    else:
        partials = torch.bmm(per_slice.float(), slices.float())
    out.copy_(partials.sum(dim=0))


def _streams(device: torch.device, overlap: bool) -> WeightGradStream:
    if not overlap or device.type != "cuda":
        return WeightGradStream(None, None)
    return WeightGradStream(torch.cuda.current_stream(device), torch.cuda.Stream(device))


def schedules(split_ks: Sequence[int]) -> list[tuple[str, dict]]:
    """Each schedule's label and :func:`chunk_gemms` options."""
    rows = [("serial", {}), ("overlap", {"overlap": True})]
    for k in split_ks:
        rows += [(f"split_k{k}", {"split_k": k}), (f"split_k{k}+overlap", {"split_k": k, "overlap": True})]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flce_policy.benchmarks.chunk_gemm_bound", description=__doc__)
    parser.add_argument("shape", type=parse_shape, help="BTxHxV")
    parser.add_argument("chunks", type=int, nargs="+", help="rows per chunk")
    parser.add_argument("--split-k", type=int, nargs="*", default=[2, 4], help="grad_input's vocab slices (2 4)")
    parser.add_argument("--busy-start", action="store_true", help="each timed call behind a sleep kernel")
    args = parser.parse_args(argv)
    inputs = make_inputs(*args.shape, logit_std=4.0)
    floor_ms = measure(gemm_floor(inputs), busy_start=args.busy_start).median_ms
    print(f"{format_shape(args.shape)}: three-GEMM floor {floor_ms:.2f} ms")
    for chunk in args.chunks:
        for label, options in schedules(args.split_k):
            try:
                step = chunk_gemms(inputs, chunk, **options)[0]
            except ValueError as err:
                print(f"  {chunk} rows, {label}: not run ({err})")
                continue
            ms = measure(step, busy_start=args.busy_start).median_ms
            print(f"  {chunk} rows, {label}: {ms:.2f} ms = {ms / floor_ms:.3f}x the floor", flush=True)
            del step
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
