"""``flce-policy bench``: measure the methods on this GPU, or re-render a saved run without one.

Writes ``bench.json`` (metadata, records, targets), ``bench.csv`` and ``bench.png`` to ``--out``
and prints the table and the targets summary (or, with ``--json``, the JSON document on stdout).
User errors print one ``error:`` line on stderr and exit 2, as the rest of the CLI does.
Heavy imports (torch, the kernels, matplotlib) happen inside the commands, not at import.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .trained_config import RANDOM_INPUTS, TRAINED_INPUTS

__all__ = [
    "main", "build_parser", "Parser", "UsageError", "shape_arg", "positive_float", "int_at_least", "filter_eps_arg",
]  # fmt: skip

JSON_NAME, CSV_NAME, PNG_NAME = "bench.json", "bench.csv", "bench.png"
DEFAULT_LOGIT_STD = 4.0
DEFAULT_REPEATS = 5
DEFAULT_WARMUP = 2
MIN_REPEATS = 5  # a median of fewer is too noisy to hold a 1.08x target to
_GPU_ONLY = ("shapes", "methods", "logit_std", "repeats", "warmup", "inputs", "busy_start", "interleave", "sustained")


class UsageError(Exception):
    """A bad command line or input file; main prints it on one line and exits 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def main(argv: Sequence[str] | None = None, *, prog: str = "flce-policy bench") -> int:
    """Run ``bench``; returns the exit status (0 ok, 2 user error)."""
    return run_command(build_parser(prog), run, argv)


def run_command(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int], argv) -> int:
    """Parse ``argv`` and run; a user error prints ``error: ...`` lines on stderr and returns 2."""
    from flce_policy.engine.config import ConfigError
    from flce_policy.strategies import StrategyError

    try:
        args = parser.parse_args(argv)
        return run(args)
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except (UsageError, ConfigError, StrategyError, OSError) as err:
        # user errors only: the command line, a policy file or strategy, a file to read or write (the
        # library's ValueErrors about user input become UsageErrors where that input is used); any
        # other exception is a bug and keeps its traceback
        for line in str(err).splitlines() or [""]:
            print(f"error: {line}", file=sys.stderr)
        return 2


def build_parser(prog: str) -> Parser:
    from .suite import DEFAULT_SHAPES, SHAPE_SETS, format_shape

    parser = Parser(
        prog=prog,
        description="fwd+bwd time and peak memory of FLCE methods against the three-GEMM floor, on this GPU.",
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=shape_arg,
        metavar="BTxHxV",
        help=f"shapes to run, BTxHxV or a set ({', '.join(SHAPE_SETS)}); default: "
        f"{' '.join(format_shape(s) for s in DEFAULT_SHAPES)}",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        metavar="PATTERN",
        help="fnmatch patterns on method names, e.g. 'ours_*' liger_c1_bf16 (default: all; gemm_floor always runs)",
    )
    parser.add_argument(
        "--inputs",
        metavar="KIND",
        help="random (default: x @ W.T of std --logit-std at each shape), trained (the held-out head inputs of a "
        "small Llama trained through apply_flce, built into the cache on first use; see python -m "
        "flce_policy.benchmarks.trained_inputs), or the path of a trained-inputs cache file (.pt)",
    )
    # No defaults here: --from-json refuses these when given, and the metadata fills them in.
    add_measurement_options(parser, with_defaults=False)
    parser.add_argument(
        "--busy-start",
        action="store_true",
        default=None,
        help="start each timed call behind a sleep kernel, as the loss runs inside a training step (default: on an "
        "idle GPU, which adds the host's time before the first kernel and a clock ramp to every row)",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        default=None,
        help="time a shape's rows in rounds, one call of each per round (default: each row's calls back to back), "
        "so a drift of the GPU's clocks over the shape reaches every row alike; holds all of a shape's rows at once",
    )
    parser.add_argument(
        "--sustained",
        type=positive_float,
        metavar="SECONDS",
        help="each timed sample is the mean call over SECONDS of calls back to back, the GPU never idle, as in a "
        "training loop (at the card's sustained clock, which a power limit may hold below its boost clock); "
        "--repeats samples per row (default: each sample is one call)",
    )
    parser.add_argument("--out", metavar="DIR", help="output folder (default results/<date>-<gpu>)")
    parser.add_argument("--json", action="store_true", help="print the JSON document on stdout instead of the table")
    parser.add_argument(
        "--from-json",
        metavar="FILE",
        help="re-render table, CSV and plot from a saved bench.json (no GPU needed; --out defaults to its folder)",
    )
    return parser


def add_measurement_options(parser: argparse.ArgumentParser, *, with_defaults: bool) -> None:
    """--logit-std, --repeats and --warmup, shared by bench and tune (``None`` unless ``with_defaults``)."""
    defaults = (DEFAULT_LOGIT_STD, DEFAULT_REPEATS, DEFAULT_WARMUP) if with_defaults else (None, None, None)
    parser.add_argument(
        "--logit-std",
        type=positive_float,
        default=defaults[0],
        metavar="STD",
        help=f"std of x @ W.T in the inputs (default {DEFAULT_LOGIT_STD}, a realistic spread; 0.5 is near uniform)",
    )
    parser.add_argument(
        "--repeats",
        type=int_at_least(MIN_REPEATS),
        default=defaults[1],
        help=f"timed calls per row, median taken (at least {MIN_REPEATS}; default {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--warmup", type=int_at_least(0), default=defaults[2], help=f"untimed calls first (default {DEFAULT_WARMUP})"
    )


def shape_arg(text: str) -> tuple[tuple[int, int, int], ...]:
    """One ``--shapes`` value: a BTxHxV shape or a named set, as a tuple of shapes (flatten the list)."""
    from .suite import parse_shapes

    try:
        return parse_shapes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def filter_eps_arg(option: str, *, positive: bool = False):
    """An argparse type for a grad_weight_filter eps given as ``option`` (a number or ``2**-k``; 0 only when not
    ``positive``), the library's own check (:func:`flce_policy.plan.weight_filter.checked_filter_eps`)."""
    from flce_policy.plan.weight_filter import checked_filter_eps

    def parse(text: str) -> float:
        try:
            eps = checked_filter_eps(text, option, text=True)
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if positive and eps == 0:
            raise argparse.ArgumentTypeError(f"{option} must be above 0 (0 skips nothing), got {text!r}")
        return eps

    return parse


def filter_rescue_arg(option: str):
    """An argparse type for a grad_weight_filter_rescue N given as ``option``: the library's own check
    (:func:`flce_policy.plan.weight_filter.checked_filter_rescue`)."""
    from flce_policy.plan.weight_filter import checked_filter_rescue

    def parse(text: str) -> int:
        try:
            return checked_filter_rescue(text, option, text=True)
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


# --- commands -------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        given = [f"--{name.replace('_', '-')}" for name in _GPU_ONLY if getattr(args, name) is not None]
        if given:
            raise UsageError(f"--from-json re-renders a saved run; {', '.join(given)} only apply to a new run")
        return _rerender(Path(args.from_json), args)
    if args.sustained is not None and args.busy_start:
        raise UsageError("--sustained keeps the GPU busy itself: give --busy-start or --sustained, not both")
    if args.inputs not in (None, RANDOM_INPUTS):
        if args.inputs != TRAINED_INPUTS and not Path(args.inputs).is_file():
            raise UsageError(
                f"--inputs is {RANDOM_INPUTS}, {TRAINED_INPUTS} or a trained-inputs cache file; got {args.inputs!r}"
            )
        given = [f"--{name.replace('_', '-')}" for name in ("shapes", "logit_std") if getattr(args, name) is not None]
        if given:
            raise UsageError(
                f"--inputs {args.inputs} comes with its own shape and logits (the trained model's cache); "
                f"{', '.join(given)} only apply to --inputs random"
            )
    return _measure(args)


def _measure(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise UsageError(
            "bench needs a CUDA GPU (torch.cuda.is_available() is False); "
            "re-render a saved run without one with --from-json FILE"
        )
    from flce_policy import FLCEPolicy
    from flce_policy.engine.probe import probe_device

    from .methods import default_methods, planned_vocab_chunk, predicted_peak, predicted_time, select_methods
    from .progress import SuiteProgress
    from .report import write_csv, write_json
    from .suite import Record, expand_shapes, run_suite, with_floor_ratios

    policy = FLCEPolicy.default()
    try:
        methods = select_methods(default_methods(policy=policy), args.methods)
    except ValueError as err:  # --methods matching nothing
        raise UsageError(str(err)) from None
    trained, inputs_label = _trained_inputs(args.inputs)
    shapes = [trained.shape] if trained is not None else expand_shapes(args.shapes)
    device = probe_device()
    metadata = _metadata(device, policy, shapes, methods, args)
    metadata["inputs"] = inputs_label
    if trained is not None:
        metadata["logit_std"] = None  # the trained model's logits, not a chosen spread
    # only given for trained inputs, so run_suite's default (random inputs per shape) stays as it was
    inputs_option = {} if trained is None else {"inputs_for": lambda _shape: trained}
    out = Path(args.out) if args.out else Path("results", _run_name(device))
    out.mkdir(parents=True, exist_ok=True)

    done: list[Record] = []
    with SuiteProgress(len(shapes) * len(methods)) as progress:

        def on_record(record: Record) -> None:
            # The JSON is rewritten after every row, so a run cut short (a time limit, a fatal CUDA
            # error) keeps what it measured.
            done.append(record)
            write_json(out / JSON_NAME, with_floor_ratios(done), {**metadata, "complete": False})
            progress.finished(record)

        records = run_suite(
            shapes,
            methods,
            logit_std=metadata["logit_std"],
            warmup=metadata["warmup"],
            repeats=metadata["repeats"],
            busy_start=metadata["busy_start"],
            interleave=metadata["interleave"],
            sustained_s=metadata["sustained"],
            predict_peak=lambda method, shape: predicted_peak(method, shape, device),
            predict_time=lambda method, shape: predicted_time(method, shape, device),
            vocab_chunk=lambda method, shape: planned_vocab_chunk(method, shape, device),
            on_start=progress.started,
            on_record=on_record,
            **inputs_option,
        )
    metadata["complete"] = True
    write_json(out / JSON_NAME, records, metadata)
    write_csv(out / CSV_NAME, records)
    written = [out / JSON_NAME, out / CSV_NAME]
    try:
        _plot(records, metadata, out / PNG_NAME)
        written.append(out / PNG_NAME)
    except ImportError:
        # The measurements are the expensive part: keep them, and say how to draw the plot later.
        later = f"flce-policy bench --from-json {out / JSON_NAME}"
        print(f"note: no plot (matplotlib is not installed); draw it later with {later}", file=sys.stderr)
    _show(records, metadata, as_json=args.json)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def _trained_inputs(spec: str | None) -> tuple[Any, str]:
    """(Inputs, label) of --inputs (:func:`.trained_inputs.inputs_from_spec`); a build that fails is a UsageError."""
    from .trained_inputs import inputs_from_spec

    try:
        return inputs_from_spec(spec)
    except ValueError as err:
        raise UsageError(f"--inputs {spec}: {err}") from None


def _rerender(path: Path, args: argparse.Namespace) -> int:
    from .report import read_json, write_csv
    from .suite import with_floor_ratios

    if not path.is_file():
        raise UsageError(f"--from-json {path}: no such file")
    try:
        records, metadata = read_json(path)
    except (
        ValueError
    ) as err:  # not a bench results file (read_json's messages start with the path; a decode error's not)
        message = str(err) if str(err).startswith(str(path)) else f"{path}: {err}"
        raise UsageError(f"--from-json {message}") from None
    records = with_floor_ratios(_with_time_model(records, metadata))
    if metadata.get("complete") is False:
        note = "is from a run that did not finish; it holds the rows measured before it stopped"
        print(f"note: {path} {note}", file=sys.stderr)
    out = Path(args.out) if args.out else path.parent
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / CSV_NAME, records)
    _show(records, metadata, as_json=args.json)
    try:
        _plot(records, metadata, out / PNG_NAME)
    except ImportError:
        raise UsageError("the plot needs matplotlib: pip install 'flce-policy[bench]'") from None
    print(f"wrote {out / CSV_NAME}, {out / PNG_NAME}", file=sys.stderr)
    return 0


# --- pieces ---------------------------------------------------------------------------------------


def _with_time_model(records: list, metadata: dict[str, Any]) -> list:
    """Fill the cost model's prediction into rows saved without it, for the GPU the run names."""
    from flce_policy.plan.device import DeviceInfo, family_from_name

    from .methods import default_methods, predicted_time

    family = family_from_name(str(metadata.get("gpu", "")))
    device = DeviceInfo.synthetic(family) if family != "unknown" else DeviceInfo.cpu()
    methods = {m.name: m for m in default_methods()}
    for record in records:
        if record.predicted_ms is None and record.method in methods and record.status == "ok":
            record.predicted_ms = predicted_time(methods[record.method], record.shape, device)
    return records


def _plot(records: Any, metadata: dict[str, Any], path: Path) -> None:
    from .plot import plot_results

    plot_results(records, metadata, path)


def _show(records: Any, metadata: dict[str, Any], *, as_json: bool) -> None:
    from rich.console import Console

    from .report import render_checks, render_table, target_checks

    checks = target_checks(records)
    if as_json:
        document = {
            "metadata": metadata,
            "records": [r.to_dict() for r in records],
            "targets": [c.to_dict() for c in checks],
        }
        print(json.dumps(document, indent=2))
        return
    # Wide when piped or captured, so rows stay on one line; no markup, statuses may hold brackets.
    console = Console(width=None if sys.stdout.isatty() else 200, markup=False)
    title = " | ".join(str(metadata[k]) for k in ("gpu", "date") if metadata.get(k))
    if metadata.get("logit_std") is not None:
        title += f" | logit std {metadata['logit_std']}"
    if metadata.get("busy_start"):
        title += " | busy start"
    if metadata.get("interleave"):
        title += " | interleaved"
    if metadata.get("sustained"):
        title += f" | sustained {metadata['sustained']:g} s"
    render_table(records, console, title=title)
    render_checks(checks, console)


def _metadata(device: Any, policy: Any, shapes: list, methods: list, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import triton

    import flce_policy

    from .suite import format_shape

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "device": device.describe(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "flce_policy": flce_policy.__version__,
        "liger_kernel": _version("liger-kernel"),
        "cut_cross_entropy": _version("cut-cross-entropy"),
        "quack_kernels": _version("quack-kernels"),
        "policy": policy.source,
        "logit_std": args.logit_std if args.logit_std is not None else DEFAULT_LOGIT_STD,
        "warmup": args.warmup if args.warmup is not None else DEFAULT_WARMUP,
        "repeats": args.repeats if args.repeats is not None else DEFAULT_REPEATS,
        "busy_start": bool(args.busy_start),
        "interleave": bool(args.interleave),
        "sustained": args.sustained,
        "shapes": [format_shape(s) for s in shapes],
        "methods": [m.name for m in methods],
        "complete": False,
    }


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _run_name(device: Any) -> str:
    """'2026-11-29-h200': today's date and the GPU family (or its name, slugged)."""
    gpu = device.family if device.family not in ("unknown", "cpu") else device.name
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"
    return f"{datetime.date.today().isoformat()}-{slug}"


if __name__ == "__main__":
    sys.exit(main())
