"""The geometry the cost model predicts fastest under a slab limit, row-only or vocab-tiled."""

from __future__ import annotations

import math
from typing import Any

from flce_policy.plan.cost_model import DeviceRates, predict_seconds, rates_for
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.form_choice import slab_form_candidates
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.memory import predict_peak
from flce_policy.plan.problem import Problem
from flce_policy.plan.scaled_exp import SLAB_FORMS, runnable_slab_form
from flce_policy.plan.units import format_bytes, parse_bytes

from .base import ChunkStrategy, StrategyError, builtin_strategy, checked_geometry
from .nested import nested_config, nested_strategy, validate_nested

__all__ = ["Fastest"]

_MIN_VOCAB_CHUNK = 1024  # narrower tiles give the GEMMs too little N to run at rate
_ACCUMS = {"bf16": None, "fp32": "float32"}


@builtin_strategy
class Fastest(ChunkStrategy):
    """Lowest predicted time (:mod:`flce_policy.plan.cost_model`) among geometries within the memory limits.

    Limits: ``max_slab`` on the slab, and optionally ``max_peak`` on the predicted peak over inputs
    (:func:`flce_policy.plan.memory.predict_peak`, which counts an fp32 grad_weight accumulator).
    ``max_peak`` is bytes ("3GiB"), or another strategy (an object, or its YAML mapping): then the
    limit is the peak that strategy's geometry is predicted to take for the same problem, e.g.
    ``Fastest(max_peak=HeuristicC(16))`` is the fastest geometry within Liger-Kernel C=16's memory.

    Candidates: power-of-two row chunks (and all BT rows) over the whole vocabulary, and the same
    row chunks over power-of-two vocab tiles (>= 1024 columns); with ``chunk_multiple=N`` also the largest
    multiple of N rows over the whole vocabulary within the limits (a peak limit rarely falls on a power of
    two). Each whole-vocabulary candidate comes in every slab form the problem and the GPU run
    (:func:`flce_policy.plan.form_choice.slab_form_candidates`), or in ``slab_form`` alone where given (where it
    runs: :func:`flce_policy.plan.scaled_exp.runnable_slab_form`); vocab tiles run the logits slab. The
    scaled-exp forms' partials and the row-scaled form's scaled x_c count in the peak, and their fewer passes
    over the slab in the time. ``accum`` is the grad_weight
    accumulation planned, and the geometry carries it to the loss: "bf16" (the weight dtype) or
    "fp32" (fp32-accurate weight gradients; an fp32 buffer, except that one row chunk writes each
    slice once and needs none, which the model accounts for). ``rates`` overrides the
    family table (flce_policy.plan.cost_model.RATES; ``flce-policy tune --strategy fastest`` fits them):
    ``{matmul_flops: 7.0e14, hbm_bytes_per_s: 4.6e12}``. Ties go to the smaller slab.
    """

    name = "fastest"

    def __init__(
        self,
        max_slab: int | str = "1GiB",
        accum: str = "bf16",
        max_peak: int | str | ChunkStrategy | dict[str, Any] | None = None,
        rates: dict[str, float] | None = None,
        slab_form: str | None = None,
        chunk_multiple: int | None = None,
    ) -> None:
        self.max_slab = max_slab
        self.accum = accum
        self.max_peak = max_peak
        self.rates = rates
        self.slab_form = slab_form
        self.chunk_multiple = chunk_multiple

    def validate_params(self) -> None:
        try:
            if parse_bytes(self.max_slab) == 0:
                raise ValueError("must be positive, got 0")
        except ValueError as err:
            raise StrategyError(f"fastest: max_slab: {err}", param="max_slab") from None
        if isinstance(self.max_peak, (ChunkStrategy, dict)):
            validate_nested(self, "max_peak")
        elif self.max_peak is not None:
            try:
                parse_bytes(self.max_peak)
            except ValueError as err:
                raise StrategyError(f"fastest: max_peak: {err}", param="max_peak") from None
        if self.accum not in _ACCUMS:
            raise StrategyError(f"fastest: accum must be 'bf16' or 'fp32', got {self.accum!r}", param="accum")
        if self.rates is not None:
            _checked_rates(self.rates)
        if self.slab_form is not None and self.slab_form not in SLAB_FORMS:
            raise StrategyError(
                f"fastest: slab_form must be one of {', '.join(SLAB_FORMS)}, got {self.slab_form!r}", param="slab_form"
            )
        multiple = self.chunk_multiple
        if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1):
            raise StrategyError(
                f"fastest: chunk_multiple must be a positive number of rows (or null), got {multiple!r}",
                param="chunk_multiple",
            )

    def peak_limit(self, problem: Problem, device: DeviceInfo | None = None) -> int | None:
        """``max_peak`` in bytes for ``problem`` (a strategy's predicted peak needs the ``device`` it plans for)."""
        if not isinstance(self.max_peak, (ChunkStrategy, dict)):
            return None if self.max_peak is None else parse_bytes(self.max_peak)
        if device is None:
            raise StrategyError(
                "fastest: max_peak given as a strategy needs the device to plan it for", param="max_peak"
            )
        other = nested_strategy(self, "max_peak")
        geometry = checked_geometry(other, problem, device)  # type: ignore[arg-type]
        return predict_peak(geometry).total_bytes

    def candidates(self, problem: Problem, device: DeviceInfo | None = None) -> list[Geometry]:
        """Every geometry considered, slab within ``max_slab`` (and predicted peak within ``max_peak``)."""
        limit = parse_bytes(self.max_slab)
        peak_limit = self.peak_limit(problem, device)
        accum_dtype, label = self.planned_accum_dtype(), repr(self)
        rows = sorted({*_powers_of_two(problem.tokens), problem.tokens})
        columns = [c for c in _powers_of_two(problem.vocab) if c >= _MIN_VOCAB_CHUNK and c < problem.vocab]
        device = device or DeviceInfo.cpu()
        forms = {vocab_chunk: self._forms(problem, vocab_chunk, device) for vocab_chunk in (problem.vocab, *columns)}

        def fitting(chunk: int, vocab_chunk: int, form: str) -> Geometry | None:
            if chunk * vocab_chunk * problem.itemsize > limit:
                return None
            geometry = Geometry.for_problem(
                problem, chunk, vocab_chunk=vocab_chunk, accum_dtype=accum_dtype, strategy=label, slab_form=form
            )
            return geometry if peak_limit is None or predict_peak(geometry).total_bytes <= peak_limit else None

        out = [
            g
            for chunk in rows
            for vocab_chunk, chunk_forms in forms.items()
            for form in chunk_forms
            if (g := fitting(chunk, vocab_chunk, form)) is not None
        ]
        if self.chunk_multiple is not None:
            for form in forms[problem.vocab]:
                # the peak and the slab grow with the rows: bisect the largest multiple that fits
                low, high = 0, problem.tokens // self.chunk_multiple
                while low < high:
                    middle = (low + high + 1) // 2
                    if fitting(middle * self.chunk_multiple, problem.vocab, form) is not None:
                        low = middle
                    else:
                        high = middle - 1
                largest = fitting(low * self.chunk_multiple, problem.vocab, form) if low else None
                if largest is not None and largest not in out:
                    out.append(largest)
        if not out:
            raise StrategyError(
                f"fastest: no geometry of {problem.describe()} fits max_slab={self.max_slab!r}"
                + ("" if peak_limit is None else f" and max_peak={self.max_peak!r} ({format_bytes(peak_limit)})")
                + f" (the smallest slab is one row of {min(problem.vocab, _MIN_VOCAB_CHUNK)} columns)",
                param="max_slab" if self.max_peak is None else "max_peak",
            )
        return out

    def _forms(self, problem: Problem, vocab_chunk: int, device: DeviceInfo) -> list[str]:
        """The slab forms a candidate in vocab tiles of ``vocab_chunk`` is priced on."""
        if self.slab_form is not None:
            return [runnable_slab_form(self.slab_form, problem, vocab_chunk, device)]
        probe = Geometry.for_problem(problem, 1, vocab_chunk=vocab_chunk)
        return [form for form, why_not in slab_form_candidates(probe, device).items() if why_not is None]

    def decides_slab_form(self) -> bool:
        return True  # its candidates are priced per form

    def planned_accum_dtype(self) -> str | None:
        return _ACCUMS[self.accum]

    def planned_rates(self, device: DeviceInfo) -> DeviceRates:
        return _checked_rates(self.rates) if self.rates else rates_for(device)

    def rank(self, problem: Problem, device: DeviceInfo) -> list[tuple[float, Geometry]]:
        """(predicted seconds, geometry), fastest first."""
        rates = self.planned_rates(device)
        scored = [(predict_seconds(g, rates).seconds, g) for g in self.candidates(problem, device)]
        if not math.isfinite(min(seconds for seconds, _ in scored)):
            # rates so small that every prediction overflows: no ranking is left to make
            raise StrategyError(
                f"fastest: rates: the predicted time of {problem.describe()} overflows at {self.rates!r}; "
                "give rates in FLOP/s and bytes/s, e.g. {matmul_flops: 7.0e+14, hbm_bytes_per_s: 4.6e+12}",
                param="rates",
            )
        return sorted(scored, key=lambda item: (item[0], item[1].slab_bytes))

    def geometry(self, problem: Problem, device: DeviceInfo, *, rule: str | None = None) -> Geometry:
        self.validate_params()
        best = self.rank(problem, device)[0][1]
        return best.with_origin(rule=rule) if rule else best

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return self.geometry(problem, device).chunk_size

    def get_params(self) -> dict[str, Any]:
        return {
            "max_slab": self.max_slab,
            "accum": self.accum,
            "max_peak": self.max_peak,
            "rates": self.rates,
            "slab_form": self.slab_form,
            "chunk_multiple": self.chunk_multiple,
        }

    def to_config(self) -> dict[str, Any]:
        config = super().to_config()
        nested_config(self, "max_peak", config)
        return config


def _checked_rates(rates: Any) -> DeviceRates:
    """``rates`` as :class:`DeviceRates`, each a finite positive number (efficiencies at most 1).

    A number written ``7.0e14`` is read from YAML as a string (YAML 1.1 wants ``7.0e+14``), so a
    string that reads as a number is taken as that number.
    """
    if not isinstance(rates, dict):
        raise StrategyError(
            f"fastest: rates must be a mapping such as {{matmul_flops: 7.0e+14, hbm_bytes_per_s: 4.6e+12}}, "
            f"got {rates!r}",
            param="rates",
        )
    known = DeviceRates._fields
    required = [name for name in known if name not in DeviceRates._field_defaults]
    unknown = [key for key in rates if key not in known]
    missing = [name for name in required if name not in rates]
    if unknown or missing:
        what = f"unknown key(s) {', '.join(map(repr, unknown))}" if unknown else ""
        what += ("; " if what else "") + (f"missing {', '.join(missing)}" if missing else "")
        raise StrategyError(f"fastest: rates: {what}; the keys are {', '.join(known)}", param="rates")
    return DeviceRates(**{key: _rate(key, value) for key, value in rates.items()})


def _rate(key: str, value: Any) -> float:
    """One rate as a float; StrategyError naming ``rates.<key>`` when it is not a number in its range."""
    number = None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:  # a string that is not a number
            pass
        except OverflowError:  # an int beyond any float
            number = math.inf
    if number is None:
        raise StrategyError(f"fastest: rates.{key}: must be a number, got {value!r}", param=f"rates.{key}")
    # a latency, an overhead or an epilogue may be 0 (nothing divides by it); every other rate divides a count of
    # FLOPs or bytes
    if key in ("collective_latency_s", "scaled_exp_chunk_overhead", "scaled_exp_epilogue_flops"):
        wanted, ok = "finite and >= 0", number >= 0
    elif key.endswith("_efficiency"):
        wanted, ok = "a fraction in (0, 1]", 0 < number <= 1
    else:
        wanted, ok = "finite and positive", number > 0
    if not (ok and math.isfinite(number)):
        raise StrategyError(f"fastest: rates.{key}: must be {wanted}, got {value!r}", param=f"rates.{key}")
    return number


def _powers_of_two(limit: int) -> list[int]:
    out, value = [], 1
    while value <= limit:
        out.append(value)
        value *= 2
    return out
