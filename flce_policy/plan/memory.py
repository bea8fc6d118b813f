"""Predicted peak transient memory of one loss call: what the chunk driver allocates for a geometry.

The terms mirror the driver's allocations (kernels/driver.py); keep the two in step. Bytes are
counted over the inputs, as ``torch.cuda.max_memory_allocated()`` minus the allocation before the
call, so the gradients the call returns (grad_input, grad_weight) are included.
"""

from __future__ import annotations

from typing import NamedTuple

from flce_policy.plan.accumulator import accumulator_layout, narrow_step_rows
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import DTYPE_ITEMSIZE, Problem, checked_dtype
from flce_policy.plan.scaled_exp import is_scaled_exp, row_scaled, scaled_exp_scratch_bytes, slot_tile
from flce_policy.plan.units import format_bytes
from flce_policy.plan.weight_filter import filter_scratch_bytes

__all__ = ["MemoryEstimate", "predict_peak", "held_beside_slab", "gathered_head_bytes"]

_FP32 = DTYPE_ITEMSIZE["float32"]
_INT64 = 8


class MemoryEstimate(NamedTuple):
    """Peak bytes of one fwd+bwd, and the terms it is made of."""

    total_bytes: int
    terms: dict[str, int]

    def describe(self) -> str:
        parts = ", ".join(f"{name} {format_bytes(size)}" for name, size in self.terms.items() if size)
        return f"{format_bytes(self.total_bytes)} ({parts})"


def predict_peak(
    geometry: Geometry,
    *,
    input_grad: bool = True,
    weight_grad: bool = True,
    bias: bool = False,
    accum_dtype: str | None = None,
    master_dtype: str | None = None,
    input_dtype: str | None = None,
) -> MemoryEstimate:
    """Peak transient bytes when the driver runs ``geometry`` (mean/sum reduction, training).

    ``accum_dtype`` is the grad_weight accumulator ("float32", ...; None = the geometry's planned one,
    :meth:`Geometry.accum_itemsize`). ``master_dtype`` / ``input_dtype`` are the weight's and the
    hidden states' own dtypes under autocast when they differ from the problem's (compute) dtype:
    the call then holds their compute-dtype copies, and returns gradients in their dtypes (an fp32
    master's accumulated in fp32 directly).
    Two phases: the chunk loop holds the slab; after it, an accumulator of another dtype is cast
    to the weight dtype, so both copies live at once, but the slab is already freed. The peak
    is the larger phase, and ``terms`` are that phase's. Kernel scratch (row partials, a few
    bytes per row and tile) is left out: well under 1% of any slab; the scaled-exp slab's partials, a slot
    per 256 columns, are counted. ``geometry.overlap_weight_grad`` changes no term: the side stream reads the
    same slab and writes the same gradients (its cuBLAS workspace, once per stream, is scratch as above).
    """
    p = geometry.problem
    master_dtype = None if master_dtype is None else checked_dtype(master_dtype, "master_dtype")
    input_dtype = None if input_dtype is None else checked_dtype(input_dtype, "input_dtype")
    accum_itemsize = geometry.accum_itemsize(accum_dtype, master_dtype)
    held = _held(p, input_grad=input_grad, weight_grad=weight_grad, bias=bias, accum_itemsize=accum_itemsize)
    weight_elems = p.vocab * p.hidden
    copies = {
        "weight_copy": weight_elems * p.itemsize if _differs(master_dtype, p) else 0,
        "input_copy": p.tokens * p.hidden * p.itemsize if _differs(input_dtype, p) else 0,
    }
    loop = {"slab": geometry.slab_bytes, **held, **copies}
    if is_scaled_exp(geometry.slab_form):
        # its row partials are a slot per column tile, not a few per row: 5% of a bf16 slab
        rows = row_scaled(geometry.slab_form, bias=bias, label_smoothing=0.0, dtype=p.dtype)
        tile = slot_tile(geometry.slab_form, row_scaled_chunks=rows and (input_grad or weight_grad))
        loop["scaled_exp_partials"] = scaled_exp_scratch_bytes(geometry.chunk_size, geometry.vocab_chunk, tile)
        if weight_grad and rows:
            # the row-scaled form's x_c times each row's scale (not allocated with label smoothing)
            loop["scaled_input"] = geometry.chunk_size * p.hidden * p.itemsize
    if geometry.grad_weight_filter and (weight_grad or bias):
        # the filter's flags, tile states and lists (eps 0 runs the dense path: none)
        loop["grad_weight_filter"] = filter_scratch_bytes(geometry.chunk_size, geometry.vocab_chunk)
    layout = accumulator_layout(geometry, input_grad=input_grad, weight_grad=weight_grad)
    if layout.separate:
        # vocab tiles add into grad_input across the tiles; the rows of the fp32 accumulator
        # that do not fit in borrowed bytes (flce_policy.plan.accumulator)
        loop["grad_input_accumulator"] = layout.separate_bytes(p.hidden)
    if layout.in_grad_input:
        step_rows = min(narrow_step_rows(p.hidden, p.itemsize), layout.in_grad_input)
        loop["narrowing_step"] = step_rows * p.hidden * p.itemsize
    master_itemsize = DTYPE_ITEMSIZE[master_dtype] if master_dtype else p.itemsize
    input_itemsize = DTYPE_ITEMSIZE[input_dtype] if input_dtype else p.itemsize
    cast = {
        **held,
        **copies,
        "grad_weight_cast": weight_elems * master_itemsize if weight_grad and accum_itemsize != master_itemsize else 0,
        "grad_input_cast": p.tokens * p.hidden * input_itemsize if input_grad and _differs(input_dtype, p) else 0,
    }
    peak = max((loop, cast), key=lambda terms: sum(terms.values()))
    return MemoryEstimate(sum(peak.values()), peak)


def _differs(dtype: str | None, problem: Problem) -> bool:
    return dtype is not None and dtype != problem.dtype


def held_beside_slab(
    problem: Problem,
    *,
    input_grad: bool = True,
    weight_grad: bool = True,
    bias: bool = False,
    accum_dtype: str | None = None,
) -> int:
    """Bytes the chunk loop holds beside the slab: :func:`predict_peak`'s loop phase, less the slab.

    What a strategy sizing the slab from free memory must leave to the rest of the call.
    """
    accum_itemsize = DTYPE_ITEMSIZE[checked_dtype(accum_dtype, "accum_dtype")] if accum_dtype else problem.itemsize
    held = _held(problem, input_grad=input_grad, weight_grad=weight_grad, bias=bias, accum_itemsize=accum_itemsize)
    return sum(held.values())


def _held(problem: Problem, *, input_grad: bool, weight_grad: bool, bias: bool, accum_itemsize: int) -> dict[str, int]:
    """The buffers live through the whole call: the gradients it returns and the per-row outputs."""
    p = problem
    return {
        "grad_input": p.tokens * p.hidden * p.itemsize if input_grad else 0,
        "grad_weight": p.vocab * p.hidden * accum_itemsize if weight_grad else 0,
        "grad_bias": p.vocab * (_FP32 + p.itemsize) if bias else 0,
        # per-row loss/z-loss/accuracy (fp32) and the int64 target view
        "rows": p.tokens * (3 * _FP32 + _INT64),
    }


def gathered_head_bytes(problem: Problem) -> int:
    """The whole ``[V, H]`` head in the logits dtype: what FSDP2 / ZeRO-3 hold gathered on a rank during the call.

    Not part of :func:`predict_peak` (which counts the call's own allocations, the head's gradient
    among them): a sharded head is gathered by the wrapper before the call and freed after it, so on
    top of the predicted peak the rank holds this too (its gradient is the peak's ``grad_weight``).
    """
    return problem.vocab * problem.hidden * problem.itemsize
