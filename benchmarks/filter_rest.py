"""What the grad_weight filter costs on logits with nothing to skip, averaged over a run of calls.

``python -m flce_policy.benchmarks.filter_rest [--shapes BTxHxV ...] [--calls N] [--rounds R] [--out FILE]``

On random logits (std 4) every tile is kept, so a filtered call pays its flags for nothing. A policy rests after
such a call: its next ``FILTER_REST_CALLS`` filtered calls run dense, without flags
(:class:`flce_policy.plan.weight_filter.FilterRest`), so a single call's time says little; this times ``--calls``
consecutive fwd+bwd calls of each arm (a multiple of ``1 + FILTER_REST_CALLS`` covers whole rests), the arms
interleaved over ``--rounds`` rounds, and reports each arm's mean time per call (median over rounds) over the dense
arm's:

- ``dense``: the packaged policy, no filter;
- ``filtered``: the same policy with ``grad_weight_filter`` (and ``--rescue``): flags, then rests;
- ``filtered_every_call``: the policy's geometry given as a Geometry (no policy: no rest), every call flagged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from flce_policy import FLCEPolicy, fused_linear_cross_entropy
from flce_policy.benchmarks.suite import SHAPE_SETS, Shape, parse_shapes
from flce_policy.engine.probe import device_for_tensor_device
from flce_policy.plan.problem import Problem
from flce_policy.plan.weight_filter import FILTER_REST_CALLS

__all__ = ["ARMS", "rest_overhead"]

ARMS = ("dense", "filtered", "filtered_every_call")
#: random logits' std, as the bench's random inputs
LOGIT_STD = 4.0


def _inputs(shape: Shape, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, hidden, vocab = shape
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, device=device, generator=g) * (LOGIT_STD / hidden**0.5)).to(dtype)
    y = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    return x, w, y


def _arm_calls(
    shape: Shape, eps: float, rescue: int | None, device: str, dtype: torch.dtype
) -> dict[str, Callable[[], None]]:
    x, w, y = _inputs(shape, device, dtype)
    policy = FLCEPolicy.packaged()
    tokens, hidden, vocab = shape
    problem = Problem(tokens=tokens, hidden=hidden, vocab=vocab, dtype=dtype)
    geometry = policy.resolve(problem, device_for_tensor_device(x.device))  # what the loss resolves for the call
    filtered = {"grad_weight_filter": eps, "grad_weight_filter_rescue": rescue}

    def call(given: Any, **options: Any) -> Callable[[], None]:
        def step() -> None:
            xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
            fused_linear_cross_entropy(xl, wl, y, policy=given, **options).backward()

        return step

    return {
        "dense": call(policy),
        "filtered": call(policy, **filtered),
        "filtered_every_call": call(geometry, **filtered),
    }


def _seconds(step: Callable[[], None], calls: int, device: str) -> float:
    """Wall time of ``calls`` consecutive calls, the device drained before and after."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def rest_overhead(
    shape: Shape,
    *,
    eps: float = 2.0**-13.5,
    rescue: int | None = 16,
    calls: int = 2 * (1 + FILTER_REST_CALLS),
    rounds: int = 7,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Per arm the mean milliseconds per call of each round, their median, and its ratio to the dense arm's."""
    arms = _arm_calls(shape, eps, rescue, device, dtype)
    for step in arms.values():  # compiles, and the filtered arm's first flags: its rest starts here
        step()
    per_round: dict[str, list[float]] = {name: [] for name in arms}
    for index in range(rounds):
        order = list(arms)[index % len(arms) :] + list(arms)[: index % len(arms)]  # each arm first in turn
        for name in order:
            per_round[name].append(1e3 * _seconds(arms[name], calls, device) / calls)
    median = {name: statistics.median(times) for name, times in per_round.items()}
    return {
        "shape": "x".join(map(str, shape)),
        "eps": eps,
        "rescue": rescue,
        "calls": calls,
        "rest_calls": FILTER_REST_CALLS,
        "ms_per_call": per_round,
        "median_ms_per_call": median,
        "over_dense": {name: median[name] / median["dense"] for name in arms},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shapes, default=[SHAPE_SETS["small-heads"][:3]])
    parser.add_argument("--eps", type=float, default=2.0**-13.5)
    parser.add_argument("--rescue", type=int, default=16)
    parser.add_argument("--calls", type=int, default=2 * (1 + FILTER_REST_CALLS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 arithmetic is not bf16's
    results = []
    for shape in (s for shapes in args.shapes for s in shapes):
        row = rest_overhead(
            shape, eps=args.eps, rescue=args.rescue or None, calls=args.calls, rounds=args.rounds, device=device,
            dtype=dtype,
        )  # fmt: skip
        results.append(row)
        over = "  ".join(f"{name} {row['over_dense'][name]:.4f}x" for name in ARMS)
        print(f"{row['shape']}: dense {row['median_ms_per_call']['dense']:.3f} ms/call; {over}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
