"""The scaled-exp slab: which problems and calls it can run, and its scratch, in one place.

A geometry with ``slab_form="scaled_exp"``, ``"scaled_exp_rows"`` or ``"scaled_exp_ws"`` runs its logits GEMM as a GEMM
whose epilogue stores exponentials of the logits and the CE partials, not the logits
(:mod:`flce_policy.kernels.scaled_exp`): ``exp(z - m_tile)`` per row and :data:`SCALED_EXP_TILE` columns
(one CE pass instead of three), or with ``"scaled_exp_rows"`` where the call allows (:func:`row_scaled`)
``exp(z - z_y)`` per row (no CE pass over the slab); gradients that do not carry the logits' bf16 rounding.
``"scaled_exp_ws"`` is the row-scaled form whose GEMM is warp-specialised (a Gluon kernel on Hopper,
:mod:`flce_policy.kernels.gluon_exp_gemm`) in tiles of :data:`WS_TILE` columns.
It runs row-only geometries of 16-bit logits on one rank, through TMA (rows of 16 bytes); a call asking for
what the epilogue does not compute (a softcap outside the row-scaled form) runs the logits slab, which
:func:`call_routing` says.
"""

from __future__ import annotations

import math
from typing import Any

from .device import TMA_COMPUTE_CAPABILITY, WGMMA_COMPUTE_CAPABILITY, DeviceInfo
from .problem import Problem
from .units import cdiv

__all__ = [
    "SCALED_EXP_FORMS",
    "SCALED_EXP_TILE",
    "SHIFT_LIMIT",
    "SHIFT_LIMIT_EXP",
    "SLAB_FORMS",
    "SOFTCAP_LIMIT",
    "WS_TILE",
    "WS_COMPUTE_CAPABILITY",
    "call_form",
    "call_routing",
    "is_scaled_exp",
    "runnable_slab_form",
    "scaled_exp_scratch_bytes",
    "scaled_exp_slots",
    "scaled_exp_unsupported",
    "row_scaled",
    "slot_tile",
]

#: Columns per partial slot: the GEMM's column tile (its fastest on the H200 with this epilogue,
#: results/2026-12-01-small-heads/h200-persistent-tma.log).
SCALED_EXP_TILE = 256
#: The row-scaled form's limit on ``max(z) - z_y`` (nats): ``exp`` of it times V times a weight stays far inside
#: bf16 and fp32 in the GEMMs that read the slab; a row past it (a loss of > 64 nats on a token) makes the chunk
#: run per tile, which rewrites its slab and partials (what the row-scaled pass left there, up to ``inf``, is
#: never read).
SHIFT_LIMIT = 64.0
#: ``exp(SHIFT_LIMIT)``: a tile's row sum of exponentials above it flags the chunk. A row with one exponential
#: over it has such a sum, so none over the limit is missed; a row whose maximum lies up to ``log(tile)``
#: under the limit may be flagged too (redone per tile: the same result, later).
SHIFT_LIMIT_EXP = math.exp(SHIFT_LIMIT)
#: The largest softcap the scaled-exp slab runs: capped logits lie within ``2 * softcap`` of the target's, inside
#: SHIFT_LIMIT, so the row-scaled form never redoes a chunk per tile (which would need ``tanh`` of each logit again).
SOFTCAP_LIMIT = SHIFT_LIMIT / 2
#: Columns per slot of ``"scaled_exp_ws"``'s row-scaled chunks: its Gluon GEMM's tile (a warpgroup's 128x128
#: accumulator; results/2026-12-02-h200-gluon-gemm/gluon_rowsum_probe.log).
WS_TILE = 128
#: The GPUs that run ``"scaled_exp_ws"``'s Gluon GEMM: Hopper's warpgroup MMA (sm_90 only).
WS_COMPUTE_CAPABILITY = WGMMA_COMPUTE_CAPABILITY
#: What a slab can hold: the logits (cuBLAS GEMM, a partial pass), the scaled exponentials per column tile, or
#: (where the call allows, :func:`row_scaled`) per row, the backward GEMMs scaling the rows; that last with its
#: GEMM warp-specialised.
SLAB_FORMS = ("logits", "scaled_exp", "scaled_exp_rows", "scaled_exp_ws")
#: The forms whose logits GEMM writes the scaled exponentials.
SCALED_EXP_FORMS = ("scaled_exp", "scaled_exp_rows", "scaled_exp_ws")
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
    a geometry of ``problem`` in vocab tiles of ``vocab_chunk`` can run it, else ``"logits"``; ``"scaled_exp_ws"``
    on a later GPU than Hopper is ``"scaled_exp_rows"``."""
    if not is_scaled_exp(slab_form):
        return slab_form
    capability = device.compute_capability
    capable = capability is None or capability >= TMA_COMPUTE_CAPABILITY
    if not capable or scaled_exp_unsupported(problem, vocab_chunk) is not None:
        return "logits"
    if slab_form == "scaled_exp_ws" and capability is not None and capability != WS_COMPUTE_CAPABILITY:
        return "scaled_exp_rows"
    return slab_form


def call_routing(
    softcap: Any, *, eager_rounding: bool = False, row_scaled: bool = False, argmax_or_entropy: bool = False
) -> str | None:
    """None where a call's options run on the scaled-exp slab, else why the call runs the logits slab.

    A softcap runs in the row-scaled form alone (``row_scaled``: :func:`row_scaled` of a call with gradients in its
    forward), whose slab holds the capped exponentials times the cap's derivative: computed in fp32
    (``eager_rounding``: the call's ``softcap_rounding="eager"``), up to :data:`SOFTCAP_LIMIT`, without the argmax or
    the entropy, which that GEMM does not compute on capped logits."""
    if softcap is None:
        return None
    if eager_rounding:
        return "a softcap rounded op by op as eager PyTorch rounds it (the scaled-exp slab caps in fp32)"
    if softcap > SOFTCAP_LIMIT:
        return (
            f"a softcap over {SOFTCAP_LIMIT:g} (capped logits {2 * softcap:g} apart pass the row-scaled form's range)"
        )
    if not row_scaled:
        return (
            "a softcap outside the row-scaled form (a bias, label smoothing, float16 logits or no gradient in the "
            "forward: the per-tile form's finish would need tanh of each logit)"
        )
    if argmax_or_entropy:
        return "a softcap with the argmax or the entropy (the capped GEMM does not compute them)"
    return None


def call_form(
    slab_form: str,
    dtype: str,
    softcap: Any,
    *,
    eager_rounding: bool,
    bias: bool = False,
    label_smoothing: float = 0.0,
    grads: bool = True,
    argmax_or_entropy: bool = False,
) -> tuple[str, str | None]:
    """The slab form a call on the scaled-exp ``slab_form`` runs, and why where it is not ``slab_form``: the logits
    slab where :func:`call_routing` says so (the row-scaled form decided by :func:`row_scaled` from the call's
    ``bias``, ``label_smoothing``, ``dtype`` and whether its forward has ``grads``); ``"scaled_exp_rows"`` for a
    ``"scaled_exp_ws"`` call with a softcap, the argmax or the entropy, which the warp-specialised GEMM does not
    compute (the row-scaled form's Triton GEMM does, in its own tiles)."""
    rows = grads and row_scaled(slab_form, bias=bias, label_smoothing=label_smoothing, dtype=dtype)
    routing = call_routing(softcap, eager_rounding=eager_rounding, row_scaled=rows, argmax_or_entropy=argmax_or_entropy)
    if routing is not None:
        return "logits", routing
    if slab_form == "scaled_exp_ws" and (softcap is not None or argmax_or_entropy):
        return "scaled_exp_rows", "the warp-specialised GEMM does not compute a softcap, the argmax or the entropy"
    return slab_form, None


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
    rows = slab_form in ("scaled_exp_rows", "scaled_exp_ws")
    return rows and not bias and not label_smoothing and dtype == "bfloat16"


def slot_tile(slab_form: str, *, row_scaled_chunks: bool) -> int:
    """Columns per partial slot of a scaled-exp chunk: :data:`WS_TILE` for ``"scaled_exp_ws"``'s row-scaled
    chunks (``row_scaled_chunks``: :func:`row_scaled` of the call), else :data:`SCALED_EXP_TILE`."""
    return WS_TILE if slab_form == "scaled_exp_ws" and row_scaled_chunks else SCALED_EXP_TILE


def scaled_exp_slots(vocab: int, tile: int = SCALED_EXP_TILE) -> int:
    """Partial slots per row: one per column tile, padded to a power of two (the finish kernel loads them at once)."""
    return 1 << (cdiv(vocab, tile) - 1).bit_length()


def scaled_exp_scratch_bytes(chunk_size: int, vocab: int, tile: int = SCALED_EXP_TILE) -> int:
    """Bytes of the row partials a scaled-exp chunk keeps beside its slab (5.5% of a bf16 slab at
    V = 131072 in slots of 256 columns), with three fp32 values per row (the target's coefficient, the row-scaled
    form's shift and scale) and the redo flag. The entropy's plane adds 4 bytes per slot more."""
    return chunk_size * (scaled_exp_slots(vocab, tile) * (_PLANES * 4 + _INDEX_BYTES) + _ROW_VALUES * 4) + 4
