"""grad_weight's per-chunk GEMM on cuBLAS and on the Gluon kernel, alone and inside the loss.

``python -m flce_policy.benchmarks.weight_grad_gemm_bench [--gemm VxH ...] [--rows N ...] [--loss BTxHxV ...]
[--chunks N ...] [--repeats R]``:

- per chunk (``--gemm``, ``--rows``): ``grad_weight (+)= G.T @ x_c`` for a chunk of N rows, cuBLAS's beta=1 GEMM
  (a chunk after the first), its beta=0 GEMM (the first) and the Gluon kernel
  (:mod:`flce_policy.kernels.weight_grad_gemm`, accumulating: reading the old block, ``gluon``, and adding in
  memory, ``gluon_in_memory``; writing as for the first chunk, ``gluon_beta0``, its main loop against cuBLAS's
  beta=0 GEMM), each timed alone behind a busy start;
- in the loss (``--loss``, ``--chunks``): fixed chunks on the logits and the row-scaled slab, each with
  ``FLCE_POLICY_WEIGHT_GRAD_GEMM`` at ``auto`` (the rule: :mod:`flce_policy.plan.weight_grad_gemm`), at
  ``cublas`` and at ``reduce``, and the three-GEMM floor, interleaved (each round starting one row later), busy
  start; the median's ratio to the floor's.

Where the Gluon kernel cannot run (no Hopper GPU, no Gluon, no TMA bulk reduce) its rows say so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from functools import partial

import torch

from flce_policy.kernels.gemm import accumulate_mm
from flce_policy.kernels.weight_grad_gemm import reduce_add_available, weight_grad_gemm
from flce_policy.plan.weight_grad_gemm import WEIGHT_GRAD_GEMM_ENV_VAR

from .cli import int_at_least
from .measure import measure, rotated, time_call, warm_up
from .methods import Inputs, _fixed_for_inputs, _leaf_step, gemm_floor, make_inputs, ours
from .suite import format_shape, parse_shape

__all__ = ["available_settings", "chunk_gemms", "loss_rows"]

Step = Callable[[], None]
#: The slab forms the loss rows run, pinned.
LOSS_FORMS = ("logits", "scaled_exp_rows")
#: ``WEIGHT_GRAD_GEMM_ENV_VAR``'s settings, each row run under one.
SETTINGS = ("auto", "cublas", "reduce")


def chunk_gemms(vocab: int, hidden: int, rows: int, *, device: str = "cuda") -> tuple[dict[str, Step], tuple]:
    """One chunk's grad_weight GEMM, each way: ``cublas_beta1``, ``cublas_beta0``, ``gluon`` and ``gluon_in_memory``
    (accumulating) and ``gluon_beta0`` (writing; the Gluon rows raise where the kernel cannot run), and the tensors
    they use: random bf16 ``G [rows, V]``, ``x [rows, H]`` and the ``[V, H]`` gradient they write."""
    gen = torch.Generator(device=device).manual_seed(0)
    g = torch.randn(rows, vocab, device=device, generator=gen, dtype=torch.bfloat16) * 0.01
    x = torch.randn(rows, hidden, device=device, generator=gen, dtype=torch.bfloat16)
    grad_weight = torch.zeros(vocab, hidden, device=device, dtype=torch.bfloat16)
    steps = {
        "cublas_beta1": lambda: accumulate_mm(grad_weight, g.t(), x, first=False),
        "cublas_beta0": lambda: accumulate_mm(grad_weight, g.t(), x, first=True),
        "gluon": lambda: weight_grad_gemm(grad_weight, g, x, first=False),
        "gluon_in_memory": lambda: weight_grad_gemm(grad_weight, g, x, first=False, add_in_memory=True),
        "gluon_beta0": lambda: weight_grad_gemm(grad_weight, g, x, first=True),
    }
    return steps, (g, x, grad_weight)


def available_settings() -> tuple[str, ...]:
    """:data:`SETTINGS` less "reduce" where this Triton has no TMA bulk reduce (its rows would raise)."""
    return SETTINGS if reduce_add_available() else tuple(s for s in SETTINGS if s != "reduce")


def loss_rows(inputs: Inputs, chunks: Sequence[int]) -> dict[str, tuple[Step, str | None]]:
    """The loss's rows: ``floor``, and ``{form}_chunk{N}_{setting}`` for each chunk, form and setting: the step,
    and the setting it runs under (None: the floor)."""
    rows: dict[str, tuple[Step, str | None]] = {"floor": (gemm_floor(inputs), None)}
    for chunk in chunks:
        for form in LOSS_FORMS:
            step = _leaf_step(inputs, ours(partial(_fixed_for_inputs, chunk, form))(inputs))
            for setting in available_settings():
                rows[f"{form}_chunk{chunk}_{setting}"] = (step, setting)
    return rows


def _under(step: Step, setting: str | None) -> Step:
    def run() -> None:
        if setting is not None:
            os.environ[WEIGHT_GRAD_GEMM_ENV_VAR] = setting
        step()

    return run


def _per_chunk(shapes: Sequence[tuple[int, int]], rows_list: Sequence[int], repeats: int) -> None:
    for vocab, hidden in shapes:
        for rows in rows_list:
            times = {}
            for name, step in chunk_gemms(vocab, hidden, rows)[0].items():
                try:
                    times[name] = measure(step, repeats=repeats, busy_start=True).median_ms
                except (RuntimeError, ValueError) as err:
                    print(f"  {vocab}x{hidden}, {rows} rows, {name}: not run ({err})")
            cells = "  ".join(f"{name} {ms:.3f} ms ({ms / times['cublas_beta1']:.3f}x)" for name, ms in times.items())
            print(f"{vocab}x{hidden}, {rows} rows: {cells}", flush=True)
            torch.cuda.empty_cache()


def _in_the_loss(shapes: Sequence[tuple[int, int, int]], chunks: Sequence[int], repeats: int) -> None:
    for shape in shapes:
        rows = loss_rows(make_inputs(*shape, logit_std=4.0), chunks)
        steps = {name: _under(step, setting) for name, (step, setting) in rows.items()}
        for step in steps.values():
            warm_up(step, 2)
        times: dict[str, list[float]] = {name: [] for name in steps}
        for round_index in range(repeats):
            for name in rotated(list(steps), round_index):
                times[name].append(time_call(steps[name], busy_start=True))
        floor = statistics.median(times["floor"])
        print(f"{format_shape(shape)}: floor {floor:.2f} ms")
        for name, values in times.items():
            ms = statistics.median(values)
            print(f"  {name}: {ms:.2f} ms = {ms / floor:.3f}x the floor", flush=True)
        del rows, steps
        torch.cuda.empty_cache()
    os.environ.pop(WEIGHT_GRAD_GEMM_ENV_VAR, None)


def _vocab_hidden(text: str) -> tuple[int, int]:
    try:
        vocab, hidden = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected VxH (e.g. 262144x5376), got {text!r}") from None
    return vocab, hidden


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m flce_policy.benchmarks.weight_grad_gemm_bench"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--gemm", type=_vocab_hidden, nargs="*", default=[(262144, 5376)], help="VxH per chunk")
    parser.add_argument("--rows", type=int_at_least(1), nargs="*", default=[256, 512, 1024], help="rows per chunk")
    parser.add_argument("--loss", type=parse_shape, nargs="*", default=[(8192, 5376, 262144)], help="BTxHxV")
    parser.add_argument("--chunks", type=int_at_least(1), nargs="*", default=[256, 512], help="chunk rows in the loss")
    parser.add_argument("--repeats", type=int_at_least(1), default=7, help="timed calls per row (7)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    _per_chunk(args.gemm, args.rows, args.repeats)
    _in_the_loss(args.loss, args.chunks, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
