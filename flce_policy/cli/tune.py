"""``flce-policy tune``: measure chunk sizes on this GPU and write the fastest that fits as a policy file.

For each shape the benchmark's ``ours_chunk*`` rows run: our loss at FixedChunkSize over powers
of two from 256 rows up to one chunk of all BT rows, fwd+bwd, timed and with the peak measured
over the inputs by :mod:`flce_policy.benchmarks.suite`. A row *fits* when its measured peak is within ``--max-peak``
and its slab within ``--max-slab``.

On a GPU that runs the scaled-exp slab (Hopper or later; :mod:`flce_policy.plan.scaled_exp`) the same
chunk sizes are measured on its two forms too (per tile, and row-scaled), and a max_slab chosen for each the
same way. The rule is then ``scaled_exp`` around the slab_budget (``rows: true`` for the row-scaled form) of
the form whose picks run within :data:`TOLERANCE` of the logits slab's at every shape, the faster of the two
when both do (the row-scaled one on a tie): within the noise it costs nothing, and its gradients are 2-4x
closer to fp32 (docs/results.md, "H200: gradient error").

One ``max_slab`` serves every shape (a ``slab_budget`` rule picks per shape from it): of the
slabs of fitting rows, the smallest at which every shape runs a measured, fitting chunk within
:data:`TOLERANCE` (2%) of that shape's fastest fitting time; when no slab manages that, the one
whose worst shape is closest. The smallest, because memory a slab does not take is memory the
rest of the training step keeps.

The same measurements (and the three-GEMM floor) calibrate the cost model: the GEMM rate and
HBM bandwidth that best explain them (:func:`flce_policy.plan.cost_model.fit_rates`), and where
chunk sizes ran on both the logits slab and a scaled-exp slab, the scaled-exp GEMM's terms that best
predict how much faster one is than the other (:func:`flce_policy.plan.cost_model.fit_form_terms`). With
``--strategy fastest`` the rule is instead a ``fastest`` strategy carrying those rates, under the
same limits (``max_slab``, and ``max_peak`` on the predicted peak).

The file holds that rule for this GPU's family, then the packaged rules for every other GPU (the
packaged rules it makes unreachable, this family's, left out), the packaged default strategy as
``default`` (unknown GPUs), the OOM settings, and the measurements as comments: shared across a
mixed cluster, it changes only this family's decision. ``--no-packaged-rules`` writes the tuned
rule alone, and says which families then fall to the default. The file is loaded back before it
is written, so it always passes ``FLCEPolicy.from_yaml`` and ``flce-policy validate``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from flce_policy.benchmarks.cli import (
    Parser,
    UsageError,
    add_measurement_options,
    filter_eps_arg,
    filter_rescue_arg,
    positive_float,
    run_command,
    shape_arg,
)
from flce_policy.benchmarks.methods import FIXED_FAMILIES
from flce_policy.benchmarks.suite import Record, format_shape
from flce_policy.engine.policy import DeviceRule, FLCEPolicy
from flce_policy.plan.cost_model import (
    DeviceRates,
    FormPair,
    fit_form_terms,
    fit_rates,
    form_ratio_error,
    predict_seconds,
    rate_coefficients,
    rates_for,
)
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.measuring import (
    FORM_ORDER,
    SMALLEST_CHUNK,
    TOLERANCE,
    bucket_problem,
    candidate_rows,
    measured_forms,
    pick,
)
from flce_policy.plan.problem import Problem
from flce_policy.plan.scaled_exp import is_scaled_exp, runnable_slab_form
from flce_policy.plan.units import exact_size, format_bytes, parse_bytes
from flce_policy.strategies import ChunkStrategy, Fastest, Measured, SlabBudget, StrategyError
from flce_policy.strategies.scaled_exp import on_slab_form

__all__ = [
    "TOLERANCE",
    "SMALLEST_CHUNK",
    "Limits",
    "Choice",
    "chunk_sizes_for",
    "choose",
    "choose_slab_form",
    "slab_forms_for",
    "rule_match",
    "tuned_policy",
    "calibrate",
    "form_pairs",
    "render",
    "main",
]

Shape = tuple[int, int, int]

#: The slab form of each family of fixed-chunk rows (the benchmark's FIXED_FAMILIES, reversed).
_FORM_OF_FAMILY = {family: form for form, family in FIXED_FAMILIES.items()}
#: The scaled-exp forms tune measures, in the order that breaks a tie: the row-scaled one (no CE pass) first, then
#: its warp-specialised GEMM (Hopper only; a partial slot per 128 columns: a little more memory).
_SCALED_FORMS = ("scaled_exp_rows", "scaled_exp_ws", "scaled_exp")


class Limits(NamedTuple):
    """What a measured row may use: its peak over the inputs and its slab, in bytes (None: no limit)."""

    max_peak: int | None = None
    max_slab: int | None = None

    def describe(self) -> str:
        parts = []
        if self.max_peak is not None:
            parts.append(f"measured peak <= {format_bytes(self.max_peak)}")
        if self.max_slab is not None:
            parts.append(f"slab <= {format_bytes(self.max_slab)}")
        return " and ".join(parts) or "none"


@dataclass(frozen=True)
class Choice:
    """The chosen ``max_slab``, the row it runs at each shape, and each shape's fastest fitting row, on one
    slab form (one of :data:`flce_policy.plan.scaled_exp.SLAB_FORMS`)."""

    max_slab: int
    picks: dict[Shape, Record]
    fastest: dict[Shape, Record]
    within_tolerance: bool  # False when no slab came within TOLERANCE at every shape
    slab_form: str = "logits"

    def ratio(self, shape: Shape) -> float:
        """The pick's time over the fastest fitting time at ``shape``."""
        return self.picks[shape].median_ms / self.fastest[shape].median_ms  # type: ignore[operator]


def chunk_sizes_for(tokens: int) -> tuple[int, ...]:
    """The measuring core's rows below ``tokens`` (powers of two from :data:`SMALLEST_CHUNK`), fewest first; the
    one-chunk row adds ``tokens`` itself."""
    return tuple(sorted(rows for rows in candidate_rows(tokens) if rows < tokens))


def measured_strategy(
    records: Iterable[Record], limits: Limits, device: DeviceInfo, dtype: str = "bfloat16"
) -> Measured:
    """``--strategy measured``: the ``measured`` strategy within ``--max-slab`` (else the largest slab that fit),
    its ``picks`` at each shape what it would keep there (:func:`flce_policy.plan.measuring.pick` over the rows
    that fit the limits, in the forms it would measure: :func:`flce_policy.plan.measuring.measured_forms`), so a
    cluster given the file measures only other problems."""
    times: dict[Shape, dict[Geometry, float]] = {}
    for record in records:
        form = _FORM_OF_FAMILY.get(record.family)
        if form not in FORM_ORDER or why_not(record, limits, dtype) is not None:  # the forms measured picks from
            continue
        problem = Problem(*record.shape, dtype=dtype)
        geometry = Geometry.for_problem(problem, record.chunk_size, slab_form=form)  # type: ignore[arg-type]
        times.setdefault(record.shape, {})[geometry] = record.median_ms  # type: ignore[assignment]
    if not times:
        raise ValueError(f"no measured row fits the limits ({limits.describe()}): nothing to pick")
    slab = limits.max_slab or max(g.slab_bytes for shape in times.values() for g in shape)
    strategy = Measured(max_slab=exact_size(slab))
    picks = []
    for (tokens, hidden, vocab), measured in sorted(times.items()):
        limit = strategy.limit(bucket_problem(Problem(tokens, hidden, vocab, dtype=dtype)), device)
        forms = measured_forms(limit, device, strategy.planned_rates(device), form_margin=strategy.form_margin)
        kept = pick({g: t for g, t in measured.items() if g.slab_form in forms} or measured, strategy.tolerance)
        picks.append(
            {
                "tokens": tokens,
                "hidden": hidden,
                "vocab": vocab,
                "chunk_size": kept.chunk_size,
                "slab_form": kept.slab_form,
            }
        )
    strategy.picks = picks
    return strategy


def slab_forms_for(shape: Shape, device: DeviceInfo, dtype: str = "bfloat16") -> tuple[str, ...]:
    """The slab forms to measure at ``shape``: the logits slab, and the scaled-exp slab's forms where the GPU and
    the problem run them."""
    # a GPU of unknown capability is not measured on it (runnable_slab_form takes one as able, for planning)
    problem = Problem(*shape, dtype=dtype)
    if device.compute_capability is None:
        return ("logits",)
    forms = [form for form in _SCALED_FORMS if runnable_slab_form(form, problem, shape[2], device) == form]
    return ("logits", *forms)


def slab_bytes(record: Record, dtype: str = "bfloat16") -> int:
    """The slab of the row's chunk at its shape."""
    return Geometry.for_problem(Problem(*record.shape, dtype=dtype), record.chunk_size).slab_bytes  # type: ignore[arg-type]


def why_not(record: Record, limits: Limits, dtype: str = "bfloat16") -> str | None:
    """Why a measured row does not fit the limits (its failure, its peak, its slab), or None when it does."""
    if record.status != "ok" or record.median_ms is None or record.chunk_size is None:
        return record.status if record.status != "ok" else "not measured"
    if limits.max_peak is not None and (record.peak_bytes is None or record.peak_bytes > limits.max_peak):
        return "peak over the limit"
    if limits.max_slab is not None and slab_bytes(record, dtype) > limits.max_slab:
        return "slab over the limit"
    return None


def choose(
    records: Iterable[Record],
    limits: Limits,
    *,
    device: DeviceInfo,
    dtype: str = "bfloat16",
    tolerance: float = TOLERANCE,
    slab_form: str = "logits",
) -> Choice:
    """The ``max_slab`` to write for ``slab_form``'s rows (see the module docstring); ValueError when no slab
    can be chosen."""
    rows = _ours_by_shape(records, slab_form)
    if not rows:
        raise ValueError(
            f"no FixedChunkSize rows of ours on the {slab_form} slab among the records: nothing to choose from"
        )
    fitting = {
        shape: {r.chunk_size: r for r in shape_rows if why_not(r, limits, dtype) is None}
        for shape, shape_rows in rows.items()
    }
    for shape, fit in fitting.items():
        if not fit:
            raise ValueError(_nothing_fits(shape, rows[shape], limits))
    fastest = {shape: min(fit.values(), key=lambda r: (r.median_ms, r.chunk_size)) for shape, fit in fitting.items()}
    options: list[tuple[float, int, dict[Shape, Record]]] = []  # (worst ratio, slab, picks)
    for slab in sorted({slab_bytes(r, dtype) for fit in fitting.values() for r in fit.values()}):
        picks = _picks(slab, fitting, device, dtype)
        if picks is not None:
            worst = max(picks[s].median_ms / fastest[s].median_ms for s in picks)  # type: ignore[operator]
            options.append((worst, slab, picks))
    if not options:
        raise ValueError(
            "no single max_slab runs every shape at a chunk size that was measured and fits the limits; "
            "tune the shapes one at a time"
        )
    within = [o for o in options if o[0] <= 1 + tolerance]
    _, slab, picks = within[0] if within else min(options, key=lambda o: (o[0], o[1]))
    return Choice(slab, picks, fastest, bool(within), slab_form)


def choose_slab_form(logits: Choice, *scaled_exp: Choice | None, tolerance: float = TOLERANCE) -> Choice:
    """Of the scaled-exp choices measured, those whose pick runs within ``tolerance`` of the logits slab's at every
    shape (the same time within the noise, and more accurate gradients), the one with the smallest worst ratio to
    it (the first given on a tie); else ``logits``."""
    candidates = []
    for order, choice in enumerate(scaled_exp):
        if choice is None or set(choice.picks) != set(logits.picks):
            continue
        worst = max(choice.picks[s].median_ms / logits.picks[s].median_ms for s in logits.picks)  # type: ignore[operator]
        if worst <= 1 + tolerance:
            candidates.append((worst, order, choice))
    return min(candidates, key=lambda c: c[:2])[2] if candidates else logits


def _ours_by_shape(records: Iterable[Record], slab_form: str = "logits") -> dict[Shape, list[Record]]:
    rows: dict[Shape, list[Record]] = {}
    for record in records:
        if record.family == FIXED_FAMILIES[slab_form]:
            rows.setdefault(record.shape, []).append(record)
    return {shape: sorted(rs, key=lambda r: r.chunk_size or 0) for shape, rs in rows.items()}


def _picks(
    slab: int, fitting: dict[Shape, dict[int | None, Record]], device: DeviceInfo, dtype: str
) -> dict[Shape, Record] | None:
    """The fitting row SlabBudget(slab) runs at each shape, or None when at some shape it runs none."""
    picks = {}
    for shape, fit in fitting.items():
        try:
            chunk = SlabBudget(slab).geometry(Problem(*shape, dtype=dtype), device).chunk_size
        except StrategyError:  # less than one row at this shape's vocabulary
            return None
        if chunk not in fit:
            return None
        picks[shape] = fit[chunk]
    return picks


def _nothing_fits(shape: Shape, rows: list[Record], limits: Limits) -> str:
    measured = [r for r in rows if r.status == "ok" and r.peak_bytes is not None]
    if not measured:
        return f"at {format_shape(shape)} no chunk size could be measured ({rows[0].status if rows else 'no rows'})"
    smallest = min(measured, key=lambda r: r.peak_bytes)  # type: ignore[arg-type, return-value]
    return (
        f"at {format_shape(shape)} no chunk size fits the limits ({limits.describe()}): the smallest measured "
        f"peak is {format_bytes(smallest.peak_bytes)} at {smallest.chunk_size} rows"  # type: ignore[arg-type]
    )


# --- the file ------------------------------------------------------------------------------------


def rule_match(device: DeviceInfo) -> str:
    """What the written rule matches: the family, or the exact device name when the family is unknown."""
    return device.family if device.family not in ("unknown", "cpu") else device.name


def calibrate(records: Iterable[Record], device: DeviceInfo, *, dtype: str = "bfloat16"):
    """The device's cost-model rates fitted to the measured fixed-chunk rows of ours (each at its
    own accumulation) and the floor, and the worst ``|predicted / measured - 1|`` with them;
    ValueError when they cannot be fitted. Where chunk sizes were measured on the logits slab and a scaled-exp slab
    of the Triton GEMM, the scaled-exp terms are fitted to them too (:func:`form_pairs`); else the family's kept."""
    records = list(records)
    timed = _timed_rows(records, dtype)
    floors = _floor_samples(records)
    rates = fit_rates(floors + _rate_samples(timed, rates_for(device)), rates_for(device))
    pairs = _form_pairs(timed)
    for _ in range(_FORM_FIT_ROUNDS if pairs else 0):
        # the terms around the two rates, then the two rates around the terms, until the terms settle
        fitted, _ = fit_form_terms(pairs, rates)
        settled = fitted == rates
        rates = fit_rates(floors + _rate_samples(timed, fitted), fitted)
        if settled:
            break
    errors = (abs(predict_seconds(g, rates, accum_dtype=a).seconds / t - 1) for g, a, t in timed)
    worst = max(errors, default=0.0)
    return rates, worst


#: At most this many rounds of fitting the scaled-exp terms and the two rates in turn.
_FORM_FIT_ROUNDS = 5

#: A fixed-chunk row of ours as measured: its geometry, accumulation dtype (None: the gradients') and seconds.
_TimedRow = tuple[Geometry, str | None, float]


def _timed_rows(records: Iterable[Record], dtype: str) -> list[_TimedRow]:
    """Every fixed-chunk row of ours measured, with its geometry."""
    rows = []
    for record in records:
        if record.median_ms is not None and record.family in _FORM_OF_FAMILY and record.chunk_size:
            form = _FORM_OF_FAMILY[record.family]
            geometry = Geometry.for_problem(Problem(*record.shape, dtype=dtype), record.chunk_size, slab_form=form)
            rows.append((geometry, "float32" if record.accum == "fp32" else None, record.median_ms / 1e3))
    return rows


def _floor_samples(records: Iterable[Record]) -> list[tuple[float, float, float]]:
    """:func:`fit_rates`'s samples of the three-GEMM floors: their FLOPs and seconds."""
    samples = []
    for record in records:
        if record.family == "floor" and record.median_ms:
            tokens, hidden, vocab = record.shape
            samples.append((6.0 * tokens * hidden * vocab, 0.0, record.median_ms / 1e3))
    return samples


def _rate_samples(timed: Iterable[_TimedRow], base: DeviceRates) -> list[tuple[float, float, float]]:
    """:func:`fit_rates`'s samples of the rows, priced at ``base``'s other terms (the family's slab-form
    efficiencies and seconds a chunk, taken off the measured times)."""
    samples = []
    for geometry, accum_dtype, seconds in timed:
        flop, byte, fixed = rate_coefficients(geometry, accum_dtype=accum_dtype, base=base)
        samples.append((flop, byte, seconds - fixed))
    return samples


def form_pairs(records: Iterable[Record], dtype: str = "bfloat16") -> list[FormPair]:
    """Each chunk size (shape, rows, accumulation) measured on the logits slab and on a Triton-GEMM scaled-exp form
    (the row-scaled one or per tile; the warp-specialised GEMM has its own rate, not fitted here)."""
    return _form_pairs(_timed_rows(records, dtype))


def _form_pairs(timed: Iterable[_TimedRow]) -> list[FormPair]:
    by_key = {(g.problem, g.chunk_size, g.slab_form, a): (g, t) for g, a, t in timed}
    pairs = []
    for (problem, rows, form, accum), (geometry, seconds) in by_key.items():
        if form in ("scaled_exp_rows", "scaled_exp") and (problem, rows, "logits", accum) in by_key:
            logits, logits_seconds = by_key[problem, rows, "logits", accum]
            pairs.append(FormPair(logits, geometry, logits_seconds, seconds))
    return pairs


def tuned_policy(
    choice: Choice,
    device: DeviceInfo,
    strategy: ChunkStrategy | None = None,
    *,
    packaged_rules: bool = True,
    grad_weight_filter: float | None = None,
    grad_weight_filter_rescue: int | None = None,
) -> FLCEPolicy:
    """One rule for ``device`` (``strategy``, or by default a slab_budget at the chosen slab, around which
    ``scaled_exp`` when the choice is on that slab; with ``grad_weight_filter``, that eps as the rule's filter, and
    ``grad_weight_filter_rescue`` its rescue),
    then with ``packaged_rules`` the packaged rules it leaves reachable, and the packaged default strategy and
    OOM settings."""
    packaged = FLCEPolicy.packaged()
    rule = DeviceRule(
        rule_match(device),
        strategy or on_slab_form(SlabBudget(exact_size(choice.max_slab)), choice.slab_form),
        # what was measured fastest: the logits slab stays pinned (the engine would otherwise choose the form);
        # measured picks its forms itself
        slab_form="logits" if choice.slab_form == "logits" and not (strategy and strategy.measures) else None,
        grad_weight_filter=grad_weight_filter,
        grad_weight_filter_rescue=grad_weight_filter_rescue,
    )
    others = [r for r in packaged.rules if not _superseded(r, rule.match)] if packaged_rules else []
    return FLCEPolicy(
        default=packaged.default_strategy,
        rules=[rule, *others],
        oom_fallback=packaged.oom_fallback,
        min_chunk_size=packaged.min_chunk_size,
        source="flce-policy tune",
    )


def _superseded(packaged: DeviceRule, tuned_match: str) -> bool:
    """True when the tuned rule (``tuned_match``, no memory bounds, first) matches every device ``packaged`` does."""
    return packaged.match.lower() == tuned_match.lower()


def _rules_note(device: DeviceInfo, packaged_rules: bool) -> list[str]:
    """The comment lines that say what ``devices`` holds beside the tuned rule."""
    match = rule_match(device)
    if not packaged_rules:
        default = FLCEPolicy.packaged().default_strategy
        return [
            f"devices: only the tuned rule (--no-packaged-rules); every other GPU gets the default, "
            f"{default!r}, not its packaged rule"
        ]
    replaced = [r for r in FLCEPolicy.packaged().rules if _superseded(r, match)]
    lines = [
        "devices: the tuned rule, then the packaged rules of this flce-policy for every other GPU, so a file",
        "shared across a mixed cluster changes only this family (later releases' packaged rules do not reach it)",
    ]
    for rule in replaced:
        lines.append(f"the tuned rule replaces the packaged rule {rule.describe()} -> {rule.strategy!r}")
    return lines


def render(
    choice: Choice,
    records: Sequence[Record],
    limits: Limits,
    *,
    device: DeviceInfo,
    about: Sequence[str] = (),
    dtype: str = "bfloat16",
    strategy: ChunkStrategy | None = None,
    packaged_rules: bool = True,
    grad_weight_filter: float | None = None,
    grad_weight_filter_rescue: int | None = None,
    choices: dict[str, Choice] | None = None,
) -> str:
    """The policy file: ``about`` and the measurements as comments, then :func:`tuned_policy` as YAML.
    ``choices``: each slab form's choice, when several were measured and chosen from."""
    floors = {r.shape: r.median_ms for r in records if r.family == "floor" and r.median_ms}
    forms = [form for form in FIXED_FAMILIES if _ours_by_shape(records, form)]
    lines = [f"flce-policy tune on {device.describe()}", *about, f"limits: {limits.describe()}", ""]
    for form in forms:
        on_form = choice if choice.slab_form == form else (choices or {}).get(form)
        if len(forms) > 1:
            lines += [f"on the {form} slab:", ""]
        for shape, rows in _ours_by_shape(records, form).items():
            problem = Problem(*shape, dtype=dtype)
            row_bytes = problem.vocab * problem.itemsize
            floor = f"; three-GEMM floor {floors[shape]:.3f} ms" if shape in floors else ""
            lines.append(f"{format_shape(shape)} (a row of logits is {format_bytes(row_bytes)}{floor}):")
            lines.append(f"  {'chunk':>6} {'ms':>10} {'x floor':>8} {'peak':>11} {'slab':>11}")
            for r in rows:
                lines.append(_row_line(r, on_form, limits, dtype))
            if on_form is not None:
                pick = on_form.picks[shape]
                lines.append(
                    f"  max_slab {exact_size(on_form.max_slab)} runs {pick.chunk_size} rows here: "
                    f"{on_form.ratio(shape):.3f}x the fastest that fits"
                )
            lines.append("")
    lines += _chosen_lines(choice, choices or {})
    if strategy is not None:
        lines.append(f"written: {strategy!r} (the measured choice above is for comparison)")
    if grad_weight_filter is not None:
        lines.append(
            f"grad_weight_filter: {grad_weight_filter!r} written into the rule as given; the times above are the "
            "dense path's (tune does not measure the filter: its gain depends on the model's logits)"
        )
    if grad_weight_filter_rescue is not None:
        lines.append(f"grad_weight_filter_rescue: {grad_weight_filter_rescue} written into the rule as given")
    lines += ["", *_rules_note(device, packaged_rules)]
    comments = "".join(f"# {line}".rstrip() + "\n" for line in lines)
    rules = tuned_policy(
        choice, device, strategy, packaged_rules=packaged_rules, grad_weight_filter=grad_weight_filter,
        grad_weight_filter_rescue=grad_weight_filter_rescue,
    )  # fmt: skip
    return comments + rules.to_yaml()


def _chosen_lines(choice: Choice, choices: dict[str, Choice]) -> list[str]:
    """What was chosen, and each scaled-exp form's choice against the logits slab's when several were made."""
    slab_text = exact_size(choice.max_slab)
    if choice.within_tolerance:
        lines = [
            f"chosen: max_slab {slab_text}, the smallest slab within {TOLERANCE:.0%} of every shape's fastest time"
        ]
    else:
        worst = max(choice.ratio(s) for s in choice.picks)
        lines = [
            f"chosen: max_slab {slab_text}; none is within {TOLERANCE:.0%} at every shape, it is closest ({worst:.3f}x)"
        ]
    logits = choices.get("logits")
    if logits is None or len(choices) < 2:
        return lines
    lines[0] += f", on the {choice.slab_form} slab"
    for form, scaled in choices.items():
        if form == "logits":
            continue
        for shape in logits.picks:
            if shape in scaled.picks:
                ratio = scaled.picks[shape].median_ms / logits.picks[shape].median_ms  # type: ignore[operator]
                lines.append(
                    f"  {format_shape(shape)}: {form} pick (max_slab {exact_size(scaled.max_slab)}) {ratio:.3f}x the "
                    f"logits pick's time (max_slab {exact_size(logits.max_slab)})"
                )
    lines.append(
        f"a scaled-exp form is written when its picks are within {TOLERANCE:.0%} of the logits slab's at every shape "
        "(its gradients are 2-4x closer to fp32), the faster of the two when both are"
    )
    return lines


def _row_line(r: Record, choice: Choice | None, limits: Limits, dtype: str) -> str:
    ms = "-" if r.median_ms is None else f"{r.median_ms:.3f}"
    x_floor = "-" if r.x_floor is None else f"{r.x_floor:.3f}x"
    peak = "-" if r.peak_bytes is None else format_bytes(r.peak_bytes)
    slab = "-" if r.chunk_size is None else format_bytes(slab_bytes(r, dtype))
    notes = []
    if choice is not None and choice.fastest.get(r.shape) is r:
        notes.append("fastest that fits")
    if choice is not None and choice.picks.get(r.shape) is r:
        notes.append("chosen")
    reason = why_not(r, limits, dtype)
    if reason is not None:
        notes.append(reason)
    chunk = "-" if r.chunk_size is None else str(r.chunk_size)
    return f"  {chunk:>6} {ms:>10} {x_floor:>8} {peak:>11} {slab:>11}  {', '.join(notes)}"


# --- the command ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, *, prog: str = "flce-policy tune") -> int:
    """Run ``tune``; returns the exit status (0 ok, 2 user error)."""
    return run_command(build_parser(prog), run, argv)


def build_parser(prog: str) -> Parser:
    from flce_policy.benchmarks.suite import DEFAULT_SHAPES, SHAPE_SETS

    parser = Parser(
        prog=prog,
        description="Measure chunk sizes of our loss on this GPU and write the fastest that fits the "
        "memory you give (--max-peak and/or --max-slab; there is no default) as a policy YAML for this GPU family.",
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=shape_arg,
        metavar="BTxHxV",
        help=f"shapes to tune for, BTxHxV or a set ({', '.join(SHAPE_SETS)}); default: "
        f"{' '.join(format_shape(s) for s in DEFAULT_SHAPES)}",
    )
    # No defaults: how much memory the loss may take is the user's to say, so at least one is required.
    parser.add_argument(
        "--max-peak",
        type=_size,
        metavar="SIZE",
        help="limit on the measured peak over the inputs, e.g. 40GiB (give this, --max-slab, or both)",
    )
    parser.add_argument(
        "--max-slab",
        type=_size,
        metavar="SIZE",
        help="limit on the logits slab, e.g. 2GiB (give this, --max-peak, or both)",
    )
    parser.add_argument(
        "--accum", choices=("bf16", "fp32"), default="bf16", help="grad_weight accumulation to measure (default bf16)"
    )
    add_measurement_options(parser, with_defaults=True)
    parser.add_argument(
        "--sustained",
        type=positive_float,
        metavar="SECONDS",
        help="each timed sample the mean call over SECONDS of calls back to back, as in a training loop (the card at "
        "its sustained clock, which a power limit may hold below its boost clock; default: one call per sample)",
    )
    parser.add_argument(
        "--strategy",
        choices=("slab_budget", "fastest", "measured"),
        default="slab_budget",
        help="the rule to write: slab_budget at the measured best slab (default), fastest with the "
        "cost model calibrated on these measurements, or measured with the pick it would keep at each shape "
        "(the same measuring core: other problems are measured at run time)",
    )
    parser.add_argument(
        "--grad-weight-filter",
        type=filter_eps_arg("--grad-weight-filter"),
        metavar="EPS",
        help="also write this grad_weight_filter eps into the tuned rule (a number or a power of two: 2**-12); "
        "not measured: the times are the dense path's",
    )
    parser.add_argument(
        "--grad-weight-filter-rescue",
        type=filter_rescue_arg("--grad-weight-filter-rescue"),
        metavar="N",
        help="with --grad-weight-filter: also write this rescue (a power of two: a skipped tile L octaves below eps "
        "kept one in 2^L, L at most log2(N), counted 2^L times) into the tuned rule",
    )
    parser.add_argument("--out", required=True, metavar="FILE.yaml", help="the policy file to write")
    parser.add_argument(
        "--no-packaged-rules",
        dest="packaged_rules",
        action="store_false",
        help="write the tuned rule alone: every other GPU then gets the default strategy instead of its "
        "packaged rule (by default the file keeps the packaged rules after the tuned one)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print what was written and measured as JSON on stdout (the messages stay on stderr)",
    )
    return parser


def _size(text: str) -> int:
    try:
        size = parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if size == 0:
        raise argparse.ArgumentTypeError("a memory limit must be positive")
    return size


def run(args: argparse.Namespace) -> int:
    if args.max_peak is None and args.max_slab is None:
        raise UsageError(
            "give --max-peak and/or --max-slab: tune picks the fastest chunk size within the memory you can spare"
        )
    if args.grad_weight_filter_rescue is not None and not args.grad_weight_filter:
        raise UsageError(
            "--grad-weight-filter-rescue needs --grad-weight-filter (an eps above 0): it rescues tiles the filter skips"
        )
    out = Path(args.out)
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder; give the policy file to write, e.g. {out / 'policy.yaml'}")
    import torch

    if not torch.cuda.is_available():
        raise UsageError("tune needs a CUDA GPU (torch.cuda.is_available() is False): it measures the GPU it runs on")
    from flce_policy.benchmarks.suite import expand_shapes
    from flce_policy.engine.probe import probe_device

    device = probe_device()
    limits = Limits(args.max_peak, args.max_slab)
    records = _measure(expand_shapes(args.shapes), device, args)
    try:
        logits = choose(records, limits, device=device)
    except ValueError as err:  # nothing measured fits the limits given
        raise UsageError(str(err)) from None
    about = _about(args)
    choices = {"logits": logits}
    for form in _SCALED_FORMS:
        if _ours_by_shape(records, form):
            try:
                choices[form] = choose(records, limits, device=device, slab_form=form)
            except ValueError as err:
                about.append(f"the {form} slab: nothing chosen ({err})")
    choice = choose_slab_form(logits, *(choices.get(form) for form in _SCALED_FORMS))
    strategy, calibrated = None, None
    try:
        rates, worst = calibrate(records, device)
        about.append(
            f"cost model calibrated here: GEMM {rates.matmul_flops / 1e12:.0f} TFLOP/s, HBM "
            f"{rates.hbm_bytes_per_s / 1e12:.2f} TB/s (table: {_rates_text(rates_for(device))}); "
            f"worst |model/measured - 1| {worst:.1%}"
        )
        pairs = form_pairs(records)
        calibrated = _calibrated(rates, pairs)
        if pairs:
            about.append(
                f"scaled-exp slab fitted here: {_form_terms_text(rates)} "
                f"(table: {_form_terms_text(rates_for(device))}); its time over the logits slab's within "
                f"{calibrated['scaled_exp_ratio_error']:.1%} on average at {len(pairs)} chunk sizes"
            )
        if args.strategy == "fastest":
            strategy = on_slab_form(_fastest(rates, limits, args.accum), choice.slab_form)
    except ValueError as err:
        if args.strategy == "fastest":
            raise UsageError(f"cannot calibrate the cost model for --strategy fastest: {err}") from None
        about.append(f"cost model not calibrated: {err}")
    if args.strategy == "measured":
        strategy = measured_strategy(records, limits, device)  # its picks: every form, the same core's pick
    text = render(
        choice, records, limits, device=device, about=about, strategy=strategy, packaged_rules=args.packaged_rules,
        grad_weight_filter=args.grad_weight_filter, grad_weight_filter_rescue=args.grad_weight_filter_rescue,
        choices=choices,
    )  # fmt: skip
    policy = FLCEPolicy.from_yaml_text(text, source=str(out))  # what is written must load; a failure is a bug
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    written = f"{strategy!r}" if strategy is not None else f"slab_budget max_slab {exact_size(choice.max_slab)}"
    if strategy is None and is_scaled_exp(choice.slab_form):
        form = {"scaled_exp_rows": " (rows)", "scaled_exp_ws": " (rows, warp-specialised)"}.get(choice.slab_form, "")
        written = f"scaled_exp{form} around {written}"
    print(
        f"wrote {out}: match {rule_match(device)} -> {written}; "
        f"check it with `flce-policy validate {out}`, use it with FLCE_POLICY_CONFIG={out}",
        file=sys.stderr,
    )
    print(_changed_families(policy, device, out), file=sys.stderr)
    if args.json:
        summary = _summary(out, device, policy, choice, limits, calibrated, records)
        print(json.dumps(summary, indent=2, allow_nan=False))
    return 0


def _summary(
    out: Path,
    device: DeviceInfo,
    policy: FLCEPolicy,
    choice: Choice,
    limits: Limits,
    calibrated: dict[str, float] | None,
    records: Sequence[Record],
) -> dict:
    """``--json``: the file written, its tuned rule, the limits, the choice, the calibration (:func:`_calibrated`)
    and the measurements."""
    packaged = FLCEPolicy.packaged()
    return {
        "out": str(out),
        "device": device.model_dump(mode="json"),
        "rule": policy.rules[0].to_config(),
        "limits": limits._asdict(),
        "chosen_max_slab": choice.max_slab,
        "chosen_slab_form": choice.slab_form,
        "within_tolerance": choice.within_tolerance,
        "calibrated_rates": calibrated,
        "changed_families": [d.family for d in DeviceInfo.known() if not policy.same_strategy_as(packaged, d)],
        "records": [r.to_dict() for r in records],
    }


def _calibrated(rates: DeviceRates, pairs: list[FormPair]) -> dict[str, float]:
    """``--json``'s calibration: the two rates, and the scaled-exp terms where they were fitted (with the mean error
    of the scaled-exp slab's predicted time over the logits slab's)."""
    calibrated = {"matmul_flops": rates.matmul_flops, "hbm_bytes_per_s": rates.hbm_bytes_per_s}
    if pairs:
        calibrated.update(
            scaled_exp_gemm_efficiency=rates.scaled_exp_gemm_efficiency,
            scaled_exp_epilogue_flops=rates.scaled_exp_epilogue_flops,
            scaled_exp_chunk_overhead=rates.scaled_exp_chunk_overhead,
            scaled_exp_ratio_error=form_ratio_error(pairs, rates),
        )
    return calibrated


def _changed_families(policy: FLCEPolicy, device: DeviceInfo, out: Path) -> str:
    """Which known GPU families the written file gives another strategy than the packaged policy does."""
    packaged = FLCEPolicy.packaged()
    changed = [d.family for d in DeviceInfo.known() if not policy.same_strategy_as(packaged, d)]
    others = [family for family in changed if family != device.family]
    if not others:
        where = f"only on {device.family}" if changed else "on none of them"
        return f"of the known GPU families, it gives another strategy than the packaged policy {where}"
    return (
        f"WARNING: {out} moves {len(others)} other known GPU families from their packaged rules to the default "
        f"{policy.default_strategy!r}: {', '.join(others)}; without --no-packaged-rules tune keeps their rules"
    )


def _form_terms_text(rates: DeviceRates) -> str:
    return (
        f"main loop {rates.scaled_exp_gemm_efficiency:.2f} of cuBLAS's, epilogue {rates.scaled_exp_epilogue_flops:.0f} "
        f"GEMM FLOPs a logit, {rates.scaled_exp_chunk_overhead:.0e} s a chunk per [V, H] element"
    )


def _rates_text(rates: DeviceRates) -> str:
    return f"{rates.matmul_flops / 1e12:.0f} TFLOP/s, {rates.hbm_bytes_per_s / 1e12:.2f} TB/s"


def _fastest(rates: DeviceRates, limits: Limits, accum: str) -> Fastest:
    """Fastest under the tune limits (the slab defaults to the peak limit), with calibrated rates and the family's
    other terms where they are not the defaults (the H100's slab-form terms: a rates mapping starts from those)."""
    max_slab = limits.max_slab if limits.max_slab is not None else limits.max_peak
    defaults = DeviceRates._field_defaults
    written = {
        key: float(f"{value:.4g}")
        for key, value in rates._asdict().items()
        if key not in defaults or value != defaults[key]
    }
    return Fastest(
        max_slab=exact_size(max_slab),
        accum=accum,
        max_peak=None if limits.max_peak is None else exact_size(limits.max_peak),
        rates=written,
    )


def _measure(shapes: list[Shape], device: DeviceInfo, args: argparse.Namespace) -> list[Record]:
    from flce_policy.benchmarks import suite
    from flce_policy.benchmarks.methods import FLOOR, default_methods, fixed_chunk_methods, predicted_peak
    from flce_policy.benchmarks.progress import SuiteProgress

    plans = []
    for shape in shapes:
        floor = next(m for m in default_methods(policy=FLCEPolicy()) if m.name == FLOOR)  # no policy file read
        methods = [floor]
        for form in slab_forms_for(shape, device):
            methods += fixed_chunk_methods(chunk_sizes_for(shape[0]), args.accum, form)
        plans.append((shape, methods))
    records: list[Record] = []
    with SuiteProgress(sum(len(methods) for _, methods in plans)) as progress:
        for shape, methods in plans:
            records += suite.run_suite(
                [shape],
                methods,
                logit_std=args.logit_std,
                warmup=args.warmup,
                repeats=args.repeats,
                sustained_s=args.sustained,
                predict_peak=lambda method, shape: predicted_peak(method, shape, device),
                on_start=progress.started,
                on_record=progress.finished,
            )
    return records


def _about(args: argparse.Namespace) -> list[str]:
    import torch
    import triton

    import flce_policy

    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    accum = "fp32" if args.accum == "fp32" else "the weight dtype (bf16)"
    return [
        f"{date}; torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, "
        f"flce-policy {flce_policy.__version__}",
        f"fwd+bwd in bfloat16, x and W needing grad, grad_weight accumulated in {accum};",
        f"median of {args.repeats} calls after {args.warmup} warm-up; x floor = time / the three-GEMM floor;"
        if args.sustained is None
        else f"median of {args.repeats} samples after {args.warmup} warm-up calls, each the mean call over "
        f"{args.sustained:g} s of calls back to back; x floor = time / the three-GEMM floor;",
        "peak over the inputs (max_memory_allocated minus the allocation before the call); fits = within the limits",
    ]


if __name__ == "__main__":
    sys.exit(main())
