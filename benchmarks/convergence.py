"""Does a loss option change training? The trained-inputs model trained several times from one seed.

``python -m flce_policy.benchmarks.convergence --out DIR [--steps N] [--filter EPS] [--rescue N]
[--runs-per-arm R]`` prepares the corpus and tokenizer once (:func:`.trained_inputs.prepare_streams`),
then trains the same model from the same seed on the same batches ``2 R`` times, alternating the filter
off and ``grad_weight_filter=EPS`` on (with ``grad_weight_filter_rescue=N`` when given). Runs of one arm
differ only by the GPU's non-deterministic reductions: their spread is the run-to-run noise the filter's
effect is held against (without the filter three H200 runs ended at 2.944, 2.948 and 2.875 nats
held-out). It writes each run's loss curve and held-out loss to ``convergence.json`` and the curves to
``convergence.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .cli import filter_eps_arg, filter_rescue_arg
from .trained_config import TrainedConfig
from .trained_inputs import default_device, log_stderr, prepare_streams

__all__ = ["RUNS_PER_ARM", "compare_arms", "main", "run_all"]

#: Trainings per arm (filter off, filter on) by default: the fewest that measure the spread of both arms.
RUNS_PER_ARM = 2


def run_all(
    config: TrainedConfig,
    eps: float,
    *,
    rescue: int | None = None,
    runs_per_arm: int = RUNS_PER_ARM,
    max_seconds: float | None = None,
    sources: Callable[[], list] | None = None,
    log: Callable[[str], None] = log_stderr,
) -> dict[str, Any]:
    """``runs_per_arm`` trainings without the filter and as many with it, alternating (off first), their
    held-out losses and the comparison of the two arms; ``sources()`` lists the corpus files. ``rescue``: the
    filtered arm's ``grad_weight_filter_rescue``."""
    from .trained_model import held_out_loss, train

    if runs_per_arm < 2:
        raise ValueError(f"runs_per_arm must be >= 2 (the spread of an arm needs two runs), got {runs_per_arm}")
    device = default_device()
    streams = prepare_streams(config, sources=sources, log=log)
    runs = []
    for repeat in range(1, runs_per_arm + 1):
        for filtered in (False, True):
            options = {"grad_weight_filter": eps} if filtered else {}
            if filtered and rescue is not None:
                options["grad_weight_filter_rescue"] = rescue
            label = f"filter {'on' if filtered else 'off'} #{repeat}"
            log(f"training: {label} {options}")
            result = train(
                config,
                streams.train_ids,
                device=device,
                loss_options=options,
                log_every=max(1, config.steps // 10),
                on_log=lambda step, loss, seconds: log(
                    f"step {step + 1}/{config.steps} loss {loss:.4f} ({seconds:.1f} s)"
                ),
                max_seconds=max_seconds,
            )
            held_out = held_out_loss(result.model, config, streams.held_out_ids, device=device)
            log(f"{label}: held-out CE {held_out:.5f} nats, {result.seconds:.1f} s")
            runs.append({"label": label, "options": options, "held_out_ce": held_out, "seconds": result.seconds,
                         "losses": result.losses})  # fmt: skip
            del result
    return {"config": config.model_dump(), "eps": eps, "rescue": rescue, "runs": runs, **compare_arms(runs)}


def compare_arms(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The two arms' held-out losses: mean and sample standard deviation of each, the filter's effect (the
    difference of the means) and whether it is within noise: at most twice the standard error of that
    difference (from the two arms' spreads)."""
    arms = {}
    for name, filtered in (("off", False), ("on", True)):
        losses = [r["held_out_ce"] for r in runs if bool(r["options"]) is filtered]
        mean = statistics.fmean(losses)
        arms[name] = {"mean": mean, "std": statistics.stdev(losses), "runs": len(losses)}
    effect = arms["on"]["mean"] - arms["off"]["mean"]
    standard_error = math.sqrt(sum(arm["std"] ** 2 / arm["runs"] for arm in arms.values()))
    return {
        "arms": arms,
        "noise": arms["off"]["std"],  # one run's spread without the filter
        "filter_effect": effect,
        "standard_error": standard_error,
        "within_noise": abs(effect) <= 2 * standard_error,
    }


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in result["runs"]:
        label = f"{run['label']} (held-out {run['held_out_ce']:.4f})"
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], linewidth=0.8, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    arms = result["arms"]
    rescue = result.get("rescue")
    rescued = "" if rescue is None else f", rescue {rescue}"
    ax.set_title(
        f"grad_weight_filter={result['eps']:g}{rescued}: "
        f"held-out {arms['on']['mean']:.4f} +- {arms['on']['std']:.4f} nats, "
        f"without {arms['off']['mean']:.4f} +- {arms['off']['std']:.4f} ({arms['on']['runs']} runs each)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flce_policy.benchmarks.convergence", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", required=True, metavar="DIR")
    parser.add_argument("--steps", type=int, default=None, help=f"steps per run (default {TrainedConfig().steps})")
    parser.add_argument(
        "--filter", type=filter_eps_arg("--filter", positive=True), default=2.0**-12, metavar="EPS",
        help="the filter's eps, a number or a power of two such as 2**-16 (default 2**-12)",
    )  # fmt: skip
    parser.add_argument(
        "--rescue", type=filter_rescue_arg("--rescue"), default=None, metavar="N",
        help="the filtered arm's grad_weight_filter_rescue (a power of two; default none)",
    )  # fmt: skip
    parser.add_argument(
        "--runs-per-arm", type=int, default=RUNS_PER_ARM, metavar="R",
        help=f"trainings with the filter and as many without, alternating (default {RUNS_PER_ARM}, at least 2)",
    )  # fmt: skip
    parser.add_argument("--max-train-seconds", type=float, default=None, help="stop a run that takes longer")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.runs_per_arm < 2:
        parser.error(f"--runs-per-arm must be at least 2, got {args.runs_per_arm}")
    if default_device().type != "cuda":
        print("error: the convergence runs need a CUDA GPU", file=sys.stderr)
        return 2
    config = TrainedConfig(**({"steps": args.steps} if args.steps else {}))
    result = run_all(
        config, args.filter, rescue=args.rescue, runs_per_arm=args.runs_per_arm, max_seconds=args.max_train_seconds
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, out / "convergence.png")
    summary = ("eps", "rescue", "arms", "filter_effect", "standard_error", "within_noise")
    print(json.dumps({k: result[k] for k in summary}))
    print(json.dumps([{k: r[k] for k in ("label", "held_out_ce", "seconds")} for r in result["runs"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
