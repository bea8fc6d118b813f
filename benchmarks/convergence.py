"""Does a loss option change training? The trained-inputs model trained several times from one seed.

``python -m flce_policy.benchmarks.convergence --out DIR [--steps N] [--filter EPS]`` prepares the
corpus and tokenizer once (:func:`.trained_inputs.prepare_streams`), then trains the same model from
the same seed on the same batches three times: the filter off, off again (the run-to-run noise of
the GPU's non-deterministic reductions), and ``grad_weight_filter=EPS`` on. It writes each run's
loss curve and held-out loss to ``convergence.json`` and the curves to ``convergence.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .trained_config import TrainedConfig
from .trained_inputs import default_device, log_stderr, prepare_streams

__all__ = ["main", "RUNS"]

#: (label, whether the run filters): the eps comes from --filter.
RUNS: tuple[tuple[str, bool], ...] = (("filter off", False), ("filter off, again", False), ("filter on", True))


def run_all(
    config: TrainedConfig,
    eps: float,
    *,
    max_seconds: float | None = None,
    sources: Callable[[], list] | None = None,
    log: Callable[[str], None] = log_stderr,
) -> dict[str, Any]:
    """The three trainings of :data:`RUNS` and their held-out losses; ``sources()`` lists the corpus files."""
    from .trained_model import held_out_loss, train

    device = default_device()
    streams = prepare_streams(config, sources=sources, log=log)
    runs = []
    for label, filtered in RUNS:
        options = {"grad_weight_filter": eps} if filtered else {}
        log(f"training: {label} {options}")
        result = train(
            config,
            streams.train_ids,
            device=device,
            loss_options=options,
            log_every=max(1, config.steps // 10),
            on_log=lambda step, loss, seconds: log(f"step {step + 1}/{config.steps} loss {loss:.4f} ({seconds:.1f} s)"),
            max_seconds=max_seconds,
        )
        held_out = held_out_loss(result.model, config, streams.held_out_ids, device=device)
        log(f"{label}: held-out CE {held_out:.5f} nats, {result.seconds:.1f} s")
        runs.append({"label": label, "options": options, "held_out_ce": held_out, "seconds": result.seconds,
                     "losses": result.losses})  # fmt: skip
        del result
    off, again, on = (run["held_out_ce"] for run in runs)
    return {
        "config": config.model_dump(),
        "eps": eps,
        "runs": runs,
        "noise": abs(again - off),  # same seed, same batches, filter off twice
        "filter_effect": on - off,
        "within_noise": abs(on - off) <= abs(again - off),
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
    ax.set_title(f"grad_weight_filter={result['eps']:g} against two runs without it", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flce_policy.benchmarks.convergence", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", required=True, metavar="DIR")
    parser.add_argument("--steps", type=int, default=None, help=f"steps per run (default {TrainedConfig().steps})")
    parser.add_argument(
        "--filter", type=float, default=2.0**-12, metavar="EPS", help="the filter's eps (default 2^-12)"
    )
    parser.add_argument("--max-train-seconds", type=float, default=None, help="stop a run that takes longer")
    args = parser.parse_args(argv)
    if default_device().type != "cuda":
        print("error: the convergence runs need a CUDA GPU", file=sys.stderr)
        return 2
    config = TrainedConfig(**({"steps": args.steps} if args.steps else {}))
    result = run_all(config, args.filter, max_seconds=args.max_train_seconds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, out / "convergence.png")
    print(json.dumps({k: result[k] for k in ("eps", "noise", "filter_effect", "within_noise")}))
    print(json.dumps([{k: r[k] for k in ("label", "held_out_ce", "seconds")} for r in result["runs"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
