"""Run a geometry, and when its slab does not fit, the same call at half the rows until one does.

The driver's ``run_geometry`` allocates every output afresh and keeps them in its own frame, so
an attempt that raises ``torch.cuda.OutOfMemoryError`` leaves nothing behind once the exception
is dropped, and the retry starts from nothing: its result is bit for bit an uninterrupted run at
the smaller geometry. No partial sum of a failed attempt can reach the result.
"""

from __future__ import annotations

import warnings

import torch

from flce_policy.plan.geometry import Geometry
from flce_policy.plan.oom import OOMFallback, OOMFallbackWarning
from flce_policy.plan.units import format_bytes

from .driver import CEParams, DeferredTargets, DriverOutputs, GradRequest, run_geometry

__all__ = ["run_with_oom_fallback"]


def run_with_oom_fallback(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    geometry: Geometry,
    params: CEParams,
    grads: GradRequest,
    fallback: OOMFallback | None,
    *,
    class_weight: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    scale_per_row: bool = False,
    deferred_targets: DeferredTargets | None = None,
) -> tuple[DriverOutputs, Geometry]:
    """``run_geometry`` with the same arguments, and the geometry that completed.

    On ``torch.cuda.OutOfMemoryError`` the call is repeated at half the chunk size (never below
    ``fallback.min_chunk_size``); when one completes, one :class:`OOMFallbackWarning` names the
    geometry that failed and the one that completed, and ``fallback.remember`` records the latter.
    At the floor the error is raised again, naming every chunk size tried. With ``fallback=None``
    (switched off in the policy) an OOM propagates untouched.
    """
    options = {
        "class_weight": class_weight,
        "grad_scale": grad_scale,
        "scale_per_row": scale_per_row,
        "deferred_targets": deferred_targets,  # queued by the first attempt that gets there, once
    }
    if fallback is None:
        return run_geometry(x, weight, bias, target, geometry, params, grads, **options), geometry
    failed: list[Geometry] = []
    current = geometry
    while True:
        try:
            out = run_geometry(x, weight, bias, target, current, params, grads, **options)
            break
        except torch.cuda.OutOfMemoryError as err:
            failed.append(current)
            smaller = _halved(geometry, current, fallback.min_chunk_size)
            if smaller is None:
                raise torch.cuda.OutOfMemoryError(_give_up_message(failed, fallback.min_chunk_size, err)) from err
        # Leaving the except block dropped the exception, and with it the frames that held the
        # failed attempt's buffers; hand the freed blocks back before asking for a smaller slab.
        _release_cached_memory(x.device)
        current = smaller
    if failed:
        warnings.warn(_fallback_message(failed, current, x.device, fallback), OOMFallbackWarning, stacklevel=2)
        if fallback.remember is not None:
            fallback.remember(current)
    return out, current


def _halved(original: Geometry, current: Geometry, floor: int) -> Geometry | None:
    """``current`` at half its rows (at least ``floor``), or None when it is at the floor already."""
    if current.chunk_size <= floor:
        return None
    return Geometry.for_problem(
        current.problem,
        max(current.chunk_size // 2, floor),
        vocab_chunk=current.vocab_chunk,  # halve the rows only: a vocab tile stays as the strategy chose it
        accum_dtype=current.accum_dtype,
        grad_weight_filter=current.grad_weight_filter,  # remembered by the policy: keep the rule's filter
        grad_weight_filter_rescue=current.grad_weight_filter_rescue,
        slab_form=current.slab_form,
        overlap_weight_grad=current.overlap_weight_grad,
        strategy=f"oom fallback from {original.chunk_size} rows ({original.strategy})",
        rule=original.rule,
    )


def _release_cached_memory(device: torch.device) -> None:
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.empty_cache()


def _rows(geometry: Geometry) -> str:
    return f"{geometry.chunk_size} rows (slab {format_bytes(geometry.slab_bytes)})"


def _fallback_message(failed: list[Geometry], succeeded: Geometry, device: torch.device, fallback: OOMFallback) -> str:
    also = f", then at {', '.join(str(g.chunk_size) for g in failed[1:])} rows" if len(failed) > 1 else ""
    later = (
        "later calls of this problem on this device start from it"
        if fallback.remember is not None
        else "it is not remembered (the loss was given a Geometry or a strategy; an FLCEPolicy remembers it)"
    )
    return (
        f"flce_policy: out of memory on {device} at {_rows(failed[0])}{also} for {succeeded.problem.describe()}; "
        f"completed at {_rows(succeeded)}, with the same result as a run at that size; {later}"
    )


def _give_up_message(failed: list[Geometry], floor: int, err: torch.cuda.OutOfMemoryError) -> str:
    tried = ", ".join(str(g.chunk_size) for g in failed)
    return (
        f"flce_policy: out of memory for {failed[-1].problem.describe()} at every chunk size tried "
        f"({tried} rows); the smallest, {_rows(failed[-1])}, is at the OOM fallback floor "
        f"min_chunk_size={floor}, so the slab is not what is short. Last error: {err}"
    )
