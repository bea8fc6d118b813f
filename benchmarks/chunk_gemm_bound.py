"""The GEMMs alone of a row-chunked pass, by how a chunk's backward GEMMs are scheduled, against the floor.

``python -m flce_policy.benchmarks.chunk_gemm_bound SHAPE CHUNK... [--split-k K ...] [--stagger S ...]`` times, in
one run, the three-GEMM floor (:func:`.methods.gemm_floor`) and, at each chunk size, the three cuBLAS GEMMs a
logits-slab chunk runs (no cross-entropy kernel: the logits stand in for dL/dlogits) under each schedule:

- ``serial``: the logits GEMM, ``grad_input = G @ W``, ``grad_weight (+)= G.T @ x_c``, one after another (the
  driver's order);
- ``overlap``: grad_weight's GEMM on a second stream beside grad_input's (``Geometry.overlap_weight_grad``,
  :mod:`flce_policy.kernels.side_stream`);
- ``split_k{K}``: grad_input's GEMM over K slices of the vocab at once (one batched GEMM into fp32 partials,
  summed): at a small chunk ``[chunk, H]`` has too few output tiles to fill the GPU, its K = V is long;
- ``split_k{K}+overlap``: both;
- ``stagger{S}`` (``--stagger S``): grad_weight's K is S chunks, its update one vocab group at a time. The vocab
  is cut into S groups; at chunk c group ``c % S`` takes its columns of the last S chunks in one GEMM of K = S
  chunks, so each chunk's columns wait at most S - 1 chunks and ``[V, H]`` is read and written once per S
  chunks. A kernel built this way holds a chunk plus the columns still waiting: ``(S + 1) / 2`` chunks of
  logits, against S for a chunk of S x CHUNK rows. Here each group keeps its own buffer of S chunks (more
  memory than that design, the same GEMMs); the logits and grad_input GEMMs run per group. ``--stagger 3`` at
  256 rows: 512 rows' logits held, a 512-row slab's bytes, and ``[V, H]`` updated every 768 rows;
- ``stagger{S}+ring``: the same, the chunks whole in a ring of S (S chunks' memory), so that the logits and
  grad_input GEMMs are one each: what a kernel addressing the held blocks could reach.

A lower bound on each schedule of the driver, to tell which to build before building it. Why a small slab is
slow: each chunk's grad_weight GEMM reads and writes the whole ``[V, H]`` gradient; grad_input's leaves SMs idle.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence

import torch

from flce_policy.kernels.gemm import accumulate_mm
from flce_policy.kernels.side_stream import WeightGradStream

from .measure import measure
from .methods import Inputs, gemm_floor, make_inputs
from .suite import format_shape, parse_shape

__all__ = ["chunk_gemms", "schedules", "staggered_gemms", "staggered_rows"]

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


def staggered_rows(chunk_size: int, groups: int) -> float:
    """Rows of logits a staggered kernel holds at once (one chunk and the columns still waiting), for
    ``groups`` vocab groups of ``chunk_size``-row chunks: ``chunk_size * (groups + 1) / 2``."""
    return chunk_size * (groups + 1) / 2


def staggered_gemms(
    inputs: Inputs, chunk_size: int, groups: int, *, ring: bool = False
) -> tuple[Step, torch.Tensor, torch.Tensor]:
    """One pass's GEMMs in chunks of ``chunk_size`` rows, grad_weight's updated a vocab group at a time over up
    to ``groups`` chunks (the module's ``stagger``): the step, and the grad_input and grad_weight it writes.

    The groups split V as evenly as multiples of 8 columns allow. Each group's waiting columns are one
    K-contiguous operand: by default each group has its own buffer and the chunk's logits and grad_input GEMMs run
    per group; with ``ring`` the chunks lie whole in a ring of ``groups`` chunks (a chunk of ``groups x
    chunk_size`` rows' memory), so those two GEMMs are one each, as a kernel addressing blocks of the held
    columns would run them."""
    x, weight = inputs.x, inputs.weight
    tokens, vocab = x.shape[0], weight.shape[0]
    if not 1 <= groups <= vocab // 8:
        raise ValueError(f"stagger={groups} needs 1 to V / 8 = {vocab // 8} groups of at least 8 columns")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    bounds = [vocab * g // groups // 8 * 8 for g in range(groups)] + [vocab]
    columns = [slice(bounds[g], bounds[g + 1]) for g in range(groups)]
    grad_input, grad_weight = torch.empty_like(x), torch.empty_like(weight)
    chunks = [slice(start, min(start + chunk_size, tokens)) for start in range(0, tokens, chunk_size)]
    if ring:
        logits_ring = x.new_empty(groups * chunk_size, vocab)
        x_ring = x.new_empty(groups * chunk_size, x.shape[1])
    else:
        waiting = [x.new_empty(groups * chunk_size, cols.stop - cols.start) for cols in columns]

    def step() -> None:
        held: list[list[int]] = [[] for _ in range(groups)]  # each group's chunks waiting, oldest first
        started = [False] * groups

        def update(group: int, operand: torch.Tensor, x_rows: torch.Tensor) -> None:
            accumulate_mm(grad_weight[columns[group]], operand.t(), x_rows, first=not started[group])
            started[group] = True

        def take(group: int) -> None:
            if not ring:
                rows = slice(chunks[held[group][0]].start, chunks[held[group][-1]].stop)
                update(group, waiting[group][: rows.stop - rows.start], x[rows])
            else:  # the waiting chunks' slots, in runs of adjacent filled rows (one run but at the ends)
                runs: list[list[int]] = []
                for start, stop in sorted(_slot_rows(c, chunks, chunk_size, groups) for c in held[group]):
                    if runs and runs[-1][1] == start:
                        runs[-1][1] = stop
                    else:
                        runs.append([start, stop])
                for start, stop in runs:
                    update(group, logits_ring[start:stop, columns[group]], x_ring[start:stop])
            held[group] = []

        for chunk, rows in enumerate(chunks):
            if ring:
                start, stop = _slot_rows(chunk, chunks, chunk_size, groups)
                logits = logits_ring[start:stop]
                x_ring[start:stop] = x[rows]
                torch.mm(x[rows], weight.t(), out=logits)
                torch.mm(logits, weight, out=grad_input[rows])
            else:
                count = rows.stop - rows.start
                for group in range(groups):
                    offset = rows.start - (chunks[held[group][0]].start if held[group] else rows.start)
                    block = waiting[group][offset : offset + count]
                    torch.mm(x[rows], weight[columns[group]].t(), out=block)
                    accumulate_mm(grad_input[rows], block, weight[columns[group]], first=group == 0)
            for group in range(groups):
                held[group].append(chunk)
            take(chunk % groups)
        for group in range(groups):
            if held[group]:
                take(group)

    return step, grad_input, grad_weight


def _slot_rows(chunk: int, chunks: list[slice], chunk_size: int, groups: int) -> tuple[int, int]:
    """The ring rows ``[start, stop)`` chunk number ``chunk`` lies in."""
    start = chunk % groups * chunk_size
    return start, start + chunks[chunk].stop - chunks[chunk].start


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
    parser.add_argument("--stagger", type=int, nargs="*", default=[], help="vocab groups of a staggered update")
    parser.add_argument("--busy-start", action="store_true", help="each timed call behind a sleep kernel")
    parser.add_argument("--sustained", type=float, default=None, metavar="S", help="each sample S seconds of calls")
    args = parser.parse_args(argv)
    timing = {"busy_start": args.busy_start, "sustained_s": args.sustained}
    inputs = make_inputs(*args.shape, logit_std=4.0)
    floor_ms = measure(gemm_floor(inputs), **timing).median_ms
    print(f"{format_shape(args.shape)}: three-GEMM floor {floor_ms:.2f} ms")
    row_bytes = inputs.weight.shape[0] * inputs.x.element_size()
    for chunk in args.chunks:
        rows = [
            (label, functools.partial(chunk_gemms, inputs, chunk, **options), "")
            for label, options in schedules(args.split_k)
        ]
        for groups in args.stagger:
            held_mib = staggered_rows(chunk, groups) * row_bytes / 2**20
            note = f" (K {groups * chunk} rows, a kernel holding {held_mib:.0f} MiB of logits)"
            for ring in (False, True):
                build = functools.partial(staggered_gemms, inputs, chunk, groups, ring=ring)
                rows.append((f"stagger{groups}{'+ring' if ring else ''}", build, note))
        for label, build, note in rows:
            try:
                step = build()[0]
            except ValueError as err:
                print(f"  {chunk} rows, {label}: not run ({err})")
                continue
            ms = measure(step, **timing).median_ms
            print(f"  {chunk} rows, {label}{note}: {ms:.2f} ms = {ms / floor_ms:.3f}x the floor", flush=True)
            del step
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
