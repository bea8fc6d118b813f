"""The scaled-exp slab: which problems and calls it can run, and its scratch, in one place.

A geometry with ``slab_form="scaled_exp"`` or ``"scaled_exp_rows"`` runs its logits GEMM as a Triton GEMM
whose epilogue stores exponentials of the logits and the CE partials, not the logits
(:mod:`flce_policy.kernels.scaled_exp`): ``exp(z - m_tile)`` per row and :data:`SCALED_EXP_TILE` columns
(one CE pass instead of three), or with ``"scaled_exp_rows"`` where the call allows (:func:`row_scaled`)
``exp(z - z_y)`` per row (no CE pass over the slab); gradients that do not carry the logits' bf16 rounding.
It runs row-only geometries of 16-bit logits on one rank, through TMA (rows of 16 bytes); a call asking for
what the epilogue does not compute (a softcap) runs the logits slab, which :func:`call_routing` says.
"""

from __future__ import annotations

from typing import Any

from .device import TMA_COMPUTE_CAPABILITY, DeviceInfo
from .problem import Problem
from .units import cdiv

__all__ = [
    "SCALED_EXP_FORMS",
    "SCALED_EXP_TILE",
    "SLAB_FORMS",
    "call_routing",
    "is_scaled_exp",
    "runnable_slab_form",
    "scaled_exp_scratch_bytes",
    "scaled_exp_slots",
    "scaled_exp_unsupported",
    "row_scaled",
]

#: Columns per partial slot: the GEMM's column tile (its fastest on the H200 with this epilogue,
#: results/2026-12-01-small-heads/h200-persistent-tma.log).
SCALED_EXP_TILE = 256
#: What a slab can hold: the logits (cuBLAS GEMM, a partial pass), the scaled exponentials per column tile, or
#: (where the call allows, :func:`row_scaled`) per row, the backward GEMMs scaling the rows.
SLAB_FORMS = ("logits", "scaled_exp", "scaled_exp_rows")
#: The forms whose logits GEMM is the scaled-exp Triton GEMM.
SCALED_EXP_FORMS = ("scaled_exp", "scaled_exp_rows")
#: fp32 partial planes per slot (m, d, the smoothing sums, the argmax value, z_y) and the argmax index (int32).
_PLANES, _INDEX_BYTES = 6, 4
#: fp32 values per row beside them: the target's coefficient, the row-scaled form's shift and scale.
_ROW_VALUES = 3


def scaled_exp_unsupported(problem: Problem, vocab_chunk: int) -> str | None:
    """None where a geometry of ``problem`` in vocab tiles of ``vocab_chunk`` can run the scaled-exp slab,
    else why not."""
    if vocab_chunk != problem.vocab:
        return f"vocab tiles of {vocab_chunk} (the scaled-exp slab is row-only)"
    if problem.tp_size > 1:
        return "a vocab-parallel shard (its partials merge across ranks from the partial pass)"
    if problem.dtype not in ("bfloat16", "float16"):
        return f"{problem.dtype} logits (the scaled-exp slab is 16-bit)"
    if problem.hidden % 8 or problem.vocab % 8:
        return f"H={problem.hidden}, V={problem.vocab} (TMA loads rows of a multiple of 16 bytes: 8 elements)"
    return None


def runnable_slab_form(slab_form: str, problem: Problem, vocab_chunk: int, device: DeviceInfo) -> str:
    """``slab_form`` where ``device`` (TMA: Hopper or later; a device of unknown capability is taken as able) and
    a geometry of ``problem`` in vocab tiles of ``vocab_chunk`` can run it, else ``"logits"``."""
    if not is_scaled_exp(slab_form):
        return slab_form
    capable = device.compute_capability is None or device.compute_capability >= TMA_COMPUTE_CAPABILITY
    return slab_form if capable and scaled_exp_unsupported(problem, vocab_chunk) is None else "logits"


def call_routing(softcap: Any) -> str | None:
    """None where a call's options run on the scaled-exp slab, else why the call runs the logits slab."""
    if softcap is not None:
        return "softcap (its gradient needs tanh of each logit, which the scaled-exp slab does not keep)"
    return None


def is_scaled_exp(slab_form: str) -> bool:
    """Whether a geometry of ``slab_form`` runs the scaled-exp GEMM (either form)."""
    return slab_form in SCALED_EXP_FORMS


def row_scaled(slab_form: str, *, bias: bool, label_smoothing: float, dtype: str = "bfloat16") -> bool:
    """Whether a call with gradients on ``slab_form`` runs the row-scaled form (``"scaled_exp_rows"`` asks for it):
    the slab holds ``exp(z - z_y)`` per row,
    and the backward GEMMs take it as the gradient times ``1 / f`` per row (``grad_input`` scaled by ``f`` after its
    GEMM, ``x`` by ``f`` before grad_weight's), so no pass rewrites the slab (a grad_weight filter's flags take a
    read of it). Not with a bias (its gradient is a sum over the slab) or label smoothing (a term on every
    column): those take the per-tile form and the CE finish pass (:mod:`flce_policy.kernels.scaled_exp`). Nor
    with float16 logits: ``exp(z - z_y)`` up to ``exp(64)`` and the scaled ``x`` need bfloat16's exponent range."""
    return slab_form == "scaled_exp_rows" and not bias and not label_smoothing and dtype == "bfloat16"


def scaled_exp_slots(vocab: int) -> int:
    """Partial slots per row: one per column tile, padded to a power of two (the finish kernel loads them at once)."""
    return 1 << (cdiv(vocab, SCALED_EXP_TILE) - 1).bit_length()


def scaled_exp_scratch_bytes(chunk_size: int, vocab: int) -> int:
    """Bytes of the row partials a scaled-exp chunk keeps beside its slab (5.5% of a bf16 slab at
    V = 131072), with three fp32 values per row (the target's coefficient, the row-scaled form's shift and
    scale) and the redo flag. The entropy's plane adds 4 bytes per slot more."""
    return chunk_size * (scaled_exp_slots(vocab) * (_PLANES * 4 + _INDEX_BYTES) + _ROW_VALUES * 4) + 4
