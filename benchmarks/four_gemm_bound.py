"""The GEMMs alone of a vocab-tiled pass, against the three-GEMM floor and liger-kernel fp32.

``python -m flce_policy.benchmarks.four_gemm_bound SHAPE VOCAB_CHUNK...`` times, in one run: the
floor (:func:`.methods.gemm_floor`), the four cuBLAS GEMMs one row chunk of vocab tiles must run
(logits per tile twice, ``G @ W_tile`` into an fp32 grad_input, ``G.T @ x`` into each grad_weight
slice; no cross-entropy kernel, no accumulator layout), and liger-kernel with fp32 accumulation at
C=1 and C=16 when installed. A lower bound on any fp32-accurate vocab-tiled design, measured.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from flce_policy.kernels.gemm import accumulate_mm

from .measure import measure
from .methods import Inputs, gemm_floor, liger, make_inputs
from .suite import parse_shape


def four_gemms(inputs: Inputs, vocab_chunk: int) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """The GEMMs of one row chunk of ``vocab_chunk``-column tiles, nothing else.

    Returns the step and the grad_input (fp32) and grad_weight buffers it writes; the logits
    stand in for dL/dlogits.
    """
    x, weight = inputs.x, inputs.weight
    tokens, vocab = x.shape[0], weight.shape[0]
    slab = torch.empty(tokens, vocab_chunk, device=x.device, dtype=x.dtype)
    grad_input = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    grad_weight = torch.empty_like(weight)
    starts = range(0, vocab, vocab_chunk)

    def step() -> None:
        for start in starts:  # pass 1: the logits a log-sum-exp needs
            tile = weight[start : start + vocab_chunk]
            torch.mm(x, tile.t(), out=slab[:, : tile.shape[0]])
        for index, start in enumerate(starts):  # pass 2: the same logits again, then both gradients
            tile = weight[start : start + vocab_chunk]
            logits = slab[:, : tile.shape[0]]
            torch.mm(x, tile.t(), out=logits)
            accumulate_mm(grad_input, logits, tile, first=index == 0)
            torch.mm(logits.t(), x, out=grad_weight[start : start + tile.shape[0]])

    return step, grad_input, grad_weight


def main(argv: list[str]) -> None:
    shape = parse_shape(argv[0])
    inputs = make_inputs(*shape, logit_std=4.0)
    floor_ms = measure(gemm_floor(inputs)).median_ms
    print(f"{'x'.join(map(str, shape))}: three-GEMM floor {floor_ms:.1f} ms")
    rows = [(f"four GEMMs, tiles of {c}", lambda c=c: four_gemms(inputs, c)[0]) for c in map(int, argv[1:])]
    rows += [(f"liger fp32 C={c}", lambda c=c: liger(c, torch.float32)(inputs)) for c in (1, 16)]
    for label, build in rows:
        try:
            step = build()
        except Exception as err:  # noqa: BLE001 - a missing peer only skips its row
            print(f"  {label}: not run ({err})")
            continue
        ms = measure(step).median_ms
        print(f"  {label}: {ms:.1f} ms = {ms / floor_ms:.3f}x the floor")
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
