"""``measured`` on a GPU standing for one no rule names, against the GPU's own measured rule.

    python -m flce_policy.benchmarks.measured_policy [--shapes SET|BTxHxV ...] [--calls N] [--first-calls N]
                                                    [--inputs random|trained|FILE] [--out DIR]

The packaged policy with this GPU's own rules removed stands for an unknown GPU (a family no rule names: the
last rule, ``measured`` within the H100's rule, on a card of 80 GB or more; the default below). Three checks, each
of the issue's goals:

1. **After the warm-up** (each shape, default the nine of ``small-heads`` and ``large-heads``): the calls of
   ``measured`` until its pick (counted by the clock: its measuring calls), then ``--calls`` fwd+bwd calls timed
   with CUDA events against as many of the packaged rule's, one call of each in turn; the ratio of the medians
   (goal <= 1.03). The largest
   slab any call ran against the limit's slab, and the peak over the inputs of the measuring calls against the
   peak of a plain call at the limit in each form measured (goal: never above).
2. **The first calls of a training** (``--inputs trained``: the small trained Llama's head, one shape): a fresh
   process (fresh Triton and pick caches) times ``--first-calls`` calls (the wall clock, compile included) under
   ``measured``, another under the rule; ``--pairs`` such pairs, in turn (the first call's compile alone swings by
   about a second from one process to the next); the overhead ``median(measured) / median(rule) - 1`` (goal
   <= 2%), and the same over the calls after each process's first. Each side reports its first call's time and the
   forms it measured, where the warm-up went; each side's line goes to stderr as it ends. ``--triton-cache
   rule-warm``: each side starts from a copy of a Triton cache that a rule process filled first, so the compile of
   the kernels both sides run (seconds, swinging by one from one process to the next) leaves the comparison, and
   what ``measured`` compiles beyond them stays in it.
3. **A second process** on the last pair's pick cache: its measuring calls (goal 0).

On the CPU (``TRITON_INTERPRET=1``) it runs as a smoke test: the host's clock, the CPU's rule removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flce_policy.engine import pick_cache
from flce_policy.engine.clock import CudaClock, HostClock
from flce_policy.engine.policy import FLCEPolicy
from flce_policy.engine.probe import device_for_tensor_device
from flce_policy.loss import fused_linear_cross_entropy
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem

from .cli import int_at_least
from .methods import Inputs, make_inputs
from .suite import SHAPE_SETS, expand_shapes, format_shape, parse_shapes

__all__ = ["CountingClock", "unknown_gpu_policy", "main"]

#: the nine shapes of the goal: the small heads and the large ones
NINE_SHAPES = (*SHAPE_SETS["small-heads"], *SHAPE_SETS["large-heads"])


class CountingClock:
    """A clock that counts the measuring calls and keeps the geometry each ran (the inner clock times them)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ran: list[Geometry] = []
        self.laps: list[tuple[Geometry, Any]] = []  # each measuring call's geometry and lap, warm-up calls included

    def start(self, device: Any) -> Any:
        return _CountedLap(self, self.inner.start(device))


class _CountedLap:
    def __init__(self, clock: CountingClock, lap: Any) -> None:
        self.clock, self.lap = clock, lap

    def stop(self, geometry: Geometry) -> None:
        self.clock.ran.append(geometry)
        self.clock.laps.append((geometry, self.lap))
        self.lap.stop(geometry)

    def seconds(self) -> float:
        return self.lap.seconds()


def unknown_gpu_policy(device: DeviceInfo, clock: Any = None) -> FLCEPolicy:
    """The packaged policy without the rules that name ``device`` (its ``match: "*"`` rule stays): ``device`` stands
    for a GPU no rule names, which the packaged policy measures."""
    packaged = FLCEPolicy.packaged()
    rules = [rule for rule in packaged.rules if not (rule.names(device) and rule.match != "*")]
    return FLCEPolicy(
        default=packaged.default_strategy, rules=rules, oom_fallback=packaged.oom_fallback,
        min_chunk_size=packaged.min_chunk_size, source="packaged, this GPU's rules removed", clock=clock,
    )  # fmt: skip


def _clock(device: torch.device) -> Any:
    return CudaClock() if device.type == "cuda" else HostClock()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(inputs: Inputs, policy: Any) -> None:
    x = inputs.x.detach().requires_grad_()
    w = inputs.weight.detach().requires_grad_()
    fused_linear_cross_entropy(x, w, inputs.target, policy=policy).backward()


def _timed_calls(inputs: Inputs, policy: Any, calls: int) -> list[float]:
    """Each call's milliseconds (CUDA events around fwd+bwd on a GPU, the host clock on the CPU)."""
    device = inputs.x.device
    times = []
    for _ in range(calls):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            _step(inputs, policy)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            start = time.perf_counter()
            _step(inputs, policy)
            times.append((time.perf_counter() - start) * 1e3)
    return times


def _peak_bytes(inputs: Inputs, action: Any) -> int | None:
    """The peak allocated over the inputs while ``action`` runs (None on the CPU)."""
    device = inputs.x.device
    if device.type != "cuda":
        action()
        return None
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    action()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def compare_shape(inputs: Inputs, calls: int, max_measuring_calls: int = 200) -> dict[str, Any]:
    """Check 1 at one shape (the pick cache is the caller's: a fresh folder)."""
    device = inputs.x.device
    info = device_for_tensor_device(device)
    clock = CountingClock(_clock(device))
    measured = unknown_gpu_policy(info, clock)
    problem = Problem(*inputs.shape, dtype=str(inputs.x.dtype).removeprefix("torch."))
    limit = measured.resolve_rule(info)[1].limit(problem, info)  # type: ignore[attr-defined]

    def measure() -> None:
        for _ in range(max_measuring_calls):
            before = len(clock.ran)
            _step(inputs, measured)
            if len(clock.ran) == before:  # a call that timed nothing: the pick is kept
                return

    measuring_peak = _peak_bytes(inputs, measure)
    # the search's calls in the order they ran (the first of each candidate untimed by the search): what it saw
    search_ms = [[g.chunk_size, g.slab_form, round(lap.seconds() * 1e3, 4)] for g, lap in clock.laps]
    pick, source = measured.measured_pick(problem, info) or (None, "none")
    forms = sorted({g.slab_form for g in clock.ran}) or [limit.slab_form]
    limit_peaks = {
        form: _peak_bytes(inputs, lambda f=form: _step(inputs, limit.with_slab_form(f))) for form in forms
    }  # the limit's rows in each form measured, run plainly
    packaged = FLCEPolicy.packaged()
    for policy in (measured, packaged):
        _timed_calls(inputs, policy, 2)  # warm: the rule's first calls compile its kernels
    # one call of each side in turn: a drift of the GPU's clocks over the run reaches both sides alike
    measured_laps, rule_laps = [], []
    for _ in range(calls):
        measured_laps += _timed_calls(inputs, measured, 1)
        rule_laps += _timed_calls(inputs, packaged, 1)
    after, rule = statistics.median(measured_laps), statistics.median(rule_laps)
    largest = max((g.slab_bytes for g in [*clock.ran, *([pick] if pick else [])]), default=0)
    peaks = [p for p in limit_peaks.values() if p is not None]
    return {
        "shape": format_shape(inputs.shape),
        "limit": limit.describe(),
        "measuring_calls": len(clock.ran),
        "search_ms": search_ms,
        "pick": None if pick is None else pick.describe(),
        "pick_source": source,
        "measured_ms": round(after, 4),
        "rule_ms": round(rule, 4),
        "rule": packaged.resolve(problem, info).describe(),
        "ratio": round(after / rule, 4),
        "within_3pct": after <= 1.03 * rule,
        "largest_slab_bytes": largest,
        "limit_slab_bytes": limit.slab_bytes,
        "measuring_peak_bytes": measuring_peak,
        "limit_peak_bytes": limit_peaks,
        "peak_within_limit": largest <= limit.slab_bytes
        and (measuring_peak is None or not peaks or measuring_peak <= max(peaks)),
    }


def first_calls(inputs: Inputs, which: str, calls: int) -> dict[str, Any]:
    """Check 2's one side, in this (fresh) process: ``calls`` calls' wall time, compile and measuring included; the
    first call's alone (its kernels' compile) and the forms measured (each compiles its own kernels)."""
    device = inputs.x.device
    info = device_for_tensor_device(device)
    clock = CountingClock(_clock(device))
    policy = unknown_gpu_policy(info, clock) if which == "measured" else FLCEPolicy.packaged()
    _sync(device)
    start = time.perf_counter()
    first = None
    for _ in range(calls):
        _step(inputs, policy)
        if first is None:
            _sync(device)
            first = time.perf_counter() - start
    _sync(device)
    seconds = time.perf_counter() - start
    return {
        "which": which,
        "calls": calls,
        "seconds": round(seconds, 4),
        "first_call_seconds": round(first or 0.0, 4),
        "measuring_calls": len(clock.ran),
        "forms_measured": sorted({g.slab_form for g in clock.ran}),
    }


def _inputs(spec: str, shape: Sequence[int] | None, device: torch.device) -> Inputs:
    if spec == "random":
        tokens, hidden, vocab = shape  # type: ignore[misc]
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        return make_inputs(tokens, hidden, vocab, logit_std=4.0, dtype=dtype, device=str(device))
    from .trained_inputs import inputs_from_spec

    inputs, _ = inputs_from_spec(spec, device)
    return inputs  # type: ignore[return-value]


def _inputs_file(spec: str) -> str:
    """The file every side loads for ``spec`` (trained: built here first, before either side: a side that built them
    would train the model on this package's kernels in its own Triton cache, its first calls then starting warm;
    each side's cache folder differs, so ``trained`` there would not find this build)."""
    if spec != "trained":
        return spec
    from .trained_config import TrainedConfig
    from .trained_inputs import cache_path, inputs_from_spec

    inputs_from_spec(spec, "cpu")  # loads or builds (trains on the GPU) the default build's file
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return str(cache_path(TrainedConfig()).resolve())


def _in_fresh_process(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """This module's ``--phase`` run in a new Python (its caches as ``env`` says); its JSON line."""
    done = subprocess.run(
        [sys.executable, "-m", "flce_policy.benchmarks.measured_policy", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {args[1]} process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flce_policy.benchmarks.measured_policy", description=__doc__)
    parser.add_argument("--shapes", nargs="+", type=parse_shapes, help="shapes or sets; default: the nine")
    parser.add_argument("--calls", type=int, default=30, help="timed calls after the warm-up, per side (30)")
    parser.add_argument("--first-calls", type=int, default=200, help="calls of check 2 and 3 (200)")
    parser.add_argument("--pairs", type=int_at_least(1), default=3, help="check 2's fresh-process pairs, in turn (3)")
    parser.add_argument(
        "--triton-cache",
        choices=("cold", "rule-warm"),
        default="cold",
        help="check 2's Triton cache per side: empty (cold, default), or a copy of one the rule's kernels were "
        "compiled into first (rule-warm: the compile's swing out of both sides; what measured compiles beyond them "
        "stays in)",
    )
    parser.add_argument("--inputs", default="trained", help="check 2's inputs: trained (default), random, a file")
    parser.add_argument("--first-shape", type=parse_shapes, help="check 2's shape with --inputs random")
    parser.add_argument(
        "--checks", choices=("all", "shapes", "first-calls"), default="all", help="check 1, checks 2 and 3, or all"
    )
    parser.add_argument("--out", type=Path, help="a folder for measured_policy.json")
    parser.add_argument("--phase", choices=("first-calls",), help=argparse.SUPPRESS)
    parser.add_argument("--which", choices=("rule", "measured"), help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    first_shape = args.first_shape[0] if args.first_shape else None
    if args.phase == "first-calls":
        inputs = _inputs(args.inputs, first_shape, device)
        print(json.dumps(first_calls(inputs, args.which, args.first_calls)))
        return 0
    report: dict[str, Any] = {"device": device_for_tensor_device(device).describe(), "shapes": []}
    goals: dict[str, bool] = {}
    with tempfile.TemporaryDirectory() as scratch:
        os.environ[pick_cache.CACHE_ENV_VAR] = str(Path(scratch, "shapes"))
        if args.checks in ("all", "shapes"):
            if device.type == "cuda":  # cuBLAS's workspace, allocated at the first GEMM, outside any peak measured
                torch.mm(torch.ones(8, 8, device=device), torch.ones(8, 8, device=device))
            for shape in expand_shapes(args.shapes, NINE_SHAPES):
                row = compare_shape(_inputs("random", shape, device), args.calls)
                report["shapes"].append(row)
                print(_row_text(row), file=sys.stderr, flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            goals["within_3pct_after_warmup"] = all(r["within_3pct"] for r in report["shapes"])
            goals["peak_never_above_the_limit"] = all(r["peak_within_limit"] for r in report["shapes"])
        if args.checks in ("all", "first-calls"):
            checks = report["first_calls"] = _first_calls_checks(args, scratch, first_shape)
            goals["warmup_overhead_at_most_2pct"] = checks["overhead"] <= 0.02
            goals["second_process_measures_nothing"] = checks["second"]["measuring_calls"] == 0
    report["goals_met"] = goals
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "measured_policy.json").write_text(text + "\n")
    return 0


def _first_calls_checks(args: argparse.Namespace, scratch: str, first_shape: Any) -> dict[str, Any]:
    """Checks 2 and 3: ``args.pairs`` pairs of sides, each side in a fresh process with fresh Triton and pick caches,
    the pair's order alternating; then a second process on the last pair's pick cache."""
    spec = args.inputs if args.inputs == "random" else _inputs_file(args.inputs)
    common = ["--phase", "first-calls", "--first-calls", str(args.first_calls), "--inputs", spec]
    if first_shape is not None:
        common += ["--first-shape", format_shape(first_shape)]
    warmed = None
    if args.triton_cache == "rule-warm":  # one rule process compiles its kernels into a cache each side starts from
        warmed = Path(scratch, "triton-warmed")
        env = {**os.environ, "TRITON_CACHE_DIR": str(warmed), pick_cache.CACHE_ENV_VAR: str(Path(scratch, "warming"))}
        warming = _in_fresh_process([*common, "--which", "rule"], env)
        warmed.mkdir(parents=True, exist_ok=True)  # (under the interpreter nothing compiles into it)
        print(f"first calls, warming the Triton cache: {json.dumps(warming)}", file=sys.stderr, flush=True)
    pairs = []
    for pair in range(args.pairs):
        picks = str(Path(scratch, f"first-calls-{pair}"))
        sides = {}
        for which in ("rule", "measured") if pair % 2 == 0 else ("measured", "rule"):
            triton_cache = Path(scratch, f"triton-{pair}-{which}")
            if warmed is not None:
                shutil.copytree(warmed, triton_cache)  # a copy each: a side's own compiles stay its own
            env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache), pick_cache.CACHE_ENV_VAR: picks}
            sides[which] = _in_fresh_process([*common, "--which", which], env)
            print(f"first calls, pair {pair + 1}: {json.dumps(sides[which])}", file=sys.stderr, flush=True)
        pairs.append(sides)
    env = {**os.environ, pick_cache.CACHE_ENV_VAR: picks}
    second = _in_fresh_process([*common, "--which", "measured"], env)
    seconds = {which: statistics.median(p[which]["seconds"] for p in pairs) for which in ("rule", "measured")}
    # the calls after each process's first: its compile, the same kernels on both sides, swings apart from them
    after_first = {
        which: statistics.median(p[which]["seconds"] - p[which]["first_call_seconds"] for p in pairs)
        for which in ("rule", "measured")
    }
    return {
        "triton_cache": args.triton_cache,
        "pairs": pairs,
        "median_seconds": seconds,
        "median_seconds_after_the_first_call": after_first,
        "second": second,
        "overhead": round(seconds["measured"] / seconds["rule"] - 1, 4),
        "overhead_after_the_first_call": round(after_first["measured"] / after_first["rule"] - 1, 4),
    }


def _row_text(row: dict[str, Any]) -> str:
    return (
        f"{row['shape']}: measured {row['measured_ms']:.3f} ms ({row['pick']}, after {row['measuring_calls']} "
        f"measuring calls) vs rule {row['rule_ms']:.3f} ms: {row['ratio']:.3f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
