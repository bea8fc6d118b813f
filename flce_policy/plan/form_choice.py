"""Which slab form a geometry runs: the fastest the GPU and the problem can run, priced by the cost model.

The strategy decides the rows; the form (:data:`flce_policy.plan.scaled_exp.SLAB_FORMS`) follows the GPU. The
candidates, each where it can run:

- ``"logits"``: everywhere (cuBLAS GEMMs and the CE passes over the logits);
- ``"scaled_exp_rows"``: the scaled-exp slab (the logits GEMM's epilogue writes ``exp(z - z_y)`` per row) on a
  GPU with TMA (Hopper or later), 16-bit logits, row-only, one rank, H and V multiples of 8; a call with a bias
  or label smoothing runs its per-tile form (``row_scaled``);
- ``"scaled_exp_ws"``: that with the warp-specialised Gluon GEMM, on sm_90 only, for heads up to
  :func:`ws_max_hidden` of the GPU (above it the Triton GEMM's wider tiles win).

:func:`choose_slab_form` prices each at the geometry's rows (:func:`flce_policy.plan.cost_model.predict_seconds`)
and keeps the fastest; :func:`pinned_slab_form` runs a form a rule or a call names, or the next one down where it
cannot run. Both say why.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from .cost_model import DeviceRates, predict_seconds
from .device import TMA_COMPUTE_CAPABILITY, DeviceInfo
from .geometry import Geometry
from .scaled_exp import SLAB_FORMS, WS_COMPUTE_CAPABILITY, runnable_slab_form, scaled_exp_unsupported

__all__ = [
    "checked_slab_form",
    "FormChoice",
    "WS_MAX_HIDDEN",
    "choose_slab_form",
    "pinned_slab_form",
    "slab_form_candidates",
    "ws_max_hidden",
]

#: The largest hidden size at which the warp-specialised GEMM beats the Triton GEMM, per GPU family (sm_90).
#: H200: MEASURED, 0.990x -> 0.992x the floor at H=3072, slower from H=4096. H100: MEASURED, 1.3-2.1% faster in the
#: loss at H = 896-1152 (busy start), even at 2048, 2% slower at 3072 (docs/results.md, "H100: the packaged rule");
#: the H800, its chip, DERIVED from it. Every other Hopper: the H200's.
_H100_WS_MAX_HIDDEN = 1152
WS_MAX_HIDDEN: dict[str, int] = {"H200": 3072, "H100": _H100_WS_MAX_HIDDEN, "H800": _H100_WS_MAX_HIDDEN}
_WS_MAX_HIDDEN_DERIVED = WS_MAX_HIDDEN["H200"]
#: Ties (within a nanosecond) go to the form listed first.
_PREFERENCE = ("scaled_exp_ws", "scaled_exp_rows", "logits")


class FormChoice(NamedTuple):
    """The slab form a geometry runs, and why (one line, for ``explain``)."""

    slab_form: str
    reason: str


def ws_max_hidden(device: DeviceInfo) -> int:
    """The largest hidden size that runs the warp-specialised GEMM on ``device``'s family."""
    return WS_MAX_HIDDEN.get(device.family, _WS_MAX_HIDDEN_DERIVED)


def _why_not_scaled_exp(geometry: Geometry, device: DeviceInfo) -> str | None:
    capability = device.compute_capability
    if capability is not None and capability < TMA_COMPUTE_CAPABILITY:
        return f"sm_{capability[0]}{capability[1]} has no TMA (the scaled-exp GEMM needs Hopper or later)"
    return scaled_exp_unsupported(geometry.problem, geometry.vocab_chunk)


def _why_not_ws(geometry: Geometry, device: DeviceInfo) -> str | None:
    capability = device.compute_capability
    if capability is not None and capability != WS_COMPUTE_CAPABILITY:
        return f"the warp-specialised GEMM is Hopper's (sm_90), not sm_{capability[0]}{capability[1]}"
    limit = ws_max_hidden(device)
    if geometry.problem.hidden > limit:
        return f"H={geometry.problem.hidden} is above {limit}, where the warp-specialised GEMM stops winning"
    return None


def slab_form_candidates(geometry: Geometry, device: DeviceInfo) -> dict[str, str | None]:
    """Each form, and None where ``geometry`` can run it on ``device``, else why not. A device of unknown
    capability (planning on the CPU) is taken as able."""
    scaled_exp = _why_not_scaled_exp(geometry, device)
    return {
        "scaled_exp_ws": scaled_exp or _why_not_ws(geometry, device),
        "scaled_exp_rows": scaled_exp,
        "logits": None,
    }


@functools.lru_cache(maxsize=1024)
def choose_slab_form(geometry: Geometry, device: DeviceInfo, rates: DeviceRates) -> FormChoice:
    """The fastest form ``geometry``'s rows can run on ``device`` at ``rates``, and why (once per distinct
    arguments: a dynamic strategy's geometry is planned on every call)."""
    if device.family == "cpu":
        # no GPU: the kernels run in Triton's interpreter, for tests; a pin (or a strategy's form) runs another
        return FormChoice("logits", "no GPU: the logits slab (a pinned form runs under the interpreter)")
    candidates = slab_form_candidates(geometry, device)
    runnable = [form for form in _PREFERENCE if candidates[form] is None]
    if runnable == ["logits"]:
        return FormChoice("logits", f"the only form that runs here: {candidates['scaled_exp_rows']}")
    seconds = {form: predict_seconds(geometry.with_slab_form(form), rates).seconds for form in runnable}
    best = min(runnable, key=lambda form: (round(seconds[form], 9), _PREFERENCE.index(form)))
    priced = ", ".join(f"{form} {seconds[form] * 1e3:.3g} ms" for form in runnable)
    return FormChoice(best, f"fastest predicted at {geometry.chunk_size} rows ({priced})")


def pinned_slab_form(slab_form: str, geometry: Geometry, device: DeviceInfo) -> FormChoice:
    """``slab_form`` where ``geometry`` can run it on ``device``, else the next form down that can, and why."""
    checked_slab_form(slab_form, "slab_form")
    # a pin keeps the warp-specialised GEMM at any hidden size; only a GPU without it moves down
    runs = runnable_slab_form(slab_form, geometry.problem, geometry.vocab_chunk, device)
    if runs == slab_form:
        return FormChoice(slab_form, "pinned")
    why_not = _why_not_scaled_exp(geometry, device) if runs == "logits" else _why_not_ws(geometry, device)
    return FormChoice(runs, f"pinned {slab_form}, runs {runs}: {why_not}")


def checked_slab_form(slab_form: Any, what: str) -> str | None:
    """``slab_form`` if None or one of :data:`~flce_policy.plan.scaled_exp.SLAB_FORMS`; else ValueError, naming
    ``what``."""
    if slab_form is not None and slab_form not in SLAB_FORMS:
        raise ValueError(f"{what} must be one of {', '.join(SLAB_FORMS)} (or None), got {slab_form!r}")
    return slab_form
