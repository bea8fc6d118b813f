"""Loss and gradient error of each method against the fp32 reference, on the bench's inputs.

``python -m flce_policy.benchmarks.accuracy [--shapes 4096x1024x32768 | --inputs trained|FILE] [--methods PATTERN ...]
[--out FILE]`` prints one row per method: |loss - reference|, and the relative L2 error of grad_input and
grad_weight (:func:`~.reference.rel_l2`). The issue's accuracy shape is the default. A row with a
``grad_weight_filter`` also gets the share of its ``FILTER_ROWS x FILTER_COLS`` tiles that the
rule skips, counted on the inputs in plain torch (:func:`.logit_stats.logit_distribution`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

from .methods import Inputs, Method, Unavailable, default_methods, make_inputs, select_methods
from .reference import chunked_fp32_reference, rel_l2
from .suite import expand_shapes, format_shape, parse_shapes
from .trained_inputs import inputs_from_spec

__all__ = ["AccuracyRecord", "method_errors", "run_accuracy", "skipped_share", "main"]

ACCURACY_SHAPE = (4096, 1024, 32768)
#: The rows worth an accuracy figure by default: ours at its default, the peers at theirs.
DEFAULT_METHODS = (
    "ours_default_bf16",
    "ours_default_fp32",
    "ours_scaled_exp_bf16",
    "ours_scaled_exp_fp32",
    "ours_scaled_exp_rows_bf16",
    "ours_scaled_exp_rows_fp32",
    "ours_scaled_exp_ws_bf16",
    "liger_c16_bf16",
    "liger_c1_bf16",
    "quack",
    "cce",
    "eager",
)


@dataclass
class AccuracyRecord:
    shape: tuple[int, int, int]
    method: str
    loss_error: float | None = None  # |loss - fp32 reference loss|, nats
    grad_input_error: float | None = None  # relative L2
    grad_weight_error: float | None = None  # relative L2
    skipped_tiles: float | None = None  # share of the filter's tiles skippable at its eps (filtered rows)
    status: str = "ok"


def method_errors(method: Method, inputs: Inputs, reference: tuple[torch.Tensor, ...]) -> AccuracyRecord:
    """One method's loss and gradients at ``inputs``, against ``reference`` (loss, grad_x, grad_w)."""
    record = AccuracyRecord(inputs.shape, method.name)
    if method.loss is None:
        record.status = "not a loss"
        return record
    try:
        x = inputs.x.detach().requires_grad_()
        weight = inputs.weight.detach().requires_grad_()
        loss = method.loss(inputs)(x, weight)
        loss.backward()
        ref_loss, ref_gx, ref_gw = reference
        record.loss_error = abs(float(loss.detach().float()) - float(ref_loss))
        record.grad_input_error = rel_l2(x.grad, ref_gx)
        record.grad_weight_error = rel_l2(weight.grad, ref_gw)
    except Unavailable as why:
        record.status = str(why)
    except Exception as err:  # one broken peer must not cost the other rows
        record.status = f"error: {type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    return record


def skipped_share(inputs: Inputs, eps: float) -> float:
    """Share of the filter's tiles in which every per-token |softmax - onehot| is below ``eps``."""
    from flce_policy.plan.weight_filter import FILTER_COLS, FILTER_ROWS

    from .logit_stats import logit_distribution

    tile = (FILTER_ROWS, FILTER_COLS)
    report = logit_distribution(inputs.x, inputs.weight, inputs.target, eps=[eps], tiles=[tile], gradient_shares=False)
    return report["tiles"][0]["skippable"]


def run_accuracy(inputs_list: Iterable[Inputs], methods: Sequence[Method]) -> list[AccuracyRecord]:
    records = []
    for inputs in inputs_list:
        references: dict[float | None, tuple[torch.Tensor, ...]] = {}  # by the method's softcap
        for method in methods:
            if method.loss is None:
                continue
            softcap = method.options.get("softcap")
            if softcap not in references:
                references[softcap] = chunked_fp32_reference(inputs.x, inputs.weight, inputs.target, softcap=softcap)
            record = method_errors(method, inputs, references[softcap])
            eps = method.options.get("grad_weight_filter")
            if eps is not None and record.status == "ok":
                record.skipped_tiles = skipped_share(inputs, eps)
            records.append(record)
            print(_format(record), flush=True)
        del references
        gc.collect()
        torch.cuda.empty_cache()
    return records


def _format(r: AccuracyRecord) -> str:
    if r.status != "ok":
        return f"{format_shape(r.shape):>20} {r.method:34} {r.status}"
    return (
        f"{format_shape(r.shape):>20} {r.method:34} loss {r.loss_error:.2e}  "
        f"grad_input {r.grad_input_error:.5f}  grad_weight {r.grad_weight_error:.5f}"
        + ("" if r.skipped_tiles is None else f"  tiles skipped {r.skipped_tiles:.1%}")
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flce_policy.benchmarks.accuracy", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--shapes", nargs="+", type=parse_shapes, metavar="BTxHxV", help="default: 4096x1024x32768")
    parser.add_argument("--methods", nargs="+", metavar="PATTERN", help=f"default: {' '.join(DEFAULT_METHODS)}")
    parser.add_argument("--logit-std", type=float, default=4.0)
    parser.add_argument("--inputs", metavar="SPEC", help="trained, or a trained-inputs cache file, instead of --shapes")
    parser.add_argument("--out", metavar="FILE", help="write the records as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the accuracy benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    methods = [m for m in select_methods(default_methods(), args.methods or DEFAULT_METHODS) if m.loss is not None]
    if args.inputs and args.shapes:
        print("error: --inputs comes with its own shape; give --shapes or --inputs", file=sys.stderr)
        return 2
    if args.inputs:
        inputs, _label = inputs_from_spec(args.inputs)
        inputs_list = [inputs]
    else:
        shapes = expand_shapes(args.shapes, (ACCURACY_SHAPE,))
        inputs_list = (make_inputs(*shape, logit_std=args.logit_std) for shape in shapes)
    records = run_accuracy(inputs_list, methods)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump([asdict(r) for r in records], handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
