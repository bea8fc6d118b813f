"""The chunk driver: runs one validated Geometry over the BT rows, exactly as given.

Per chunk: logits = x_c @ W.T (+ b) into the reused slab (or, with ``geometry.slab_form == "scaled_exp"``,
exp(z - m) per column tile and the CE partials from a Triton GEMM: :mod:`flce_policy.kernels.scaled_exp`);
the CE kernel turns the slab into dL/dlogits in place; then grad_input_c = G @ W,
grad_weight += G.T @ x_c (cuBLAS, or :mod:`flce_policy.kernels.weight_grad_gemm`), grad_bias += sum(G) (with
``params.grad_weight_filter`` the last two over G's flagged tiles only: :mod:`flce_policy.kernels.weight_grad_filter`;
with ``geometry.overlap_weight_grad`` on a second CUDA stream beside grad_input's GEMM:
:mod:`flce_policy.kernels.side_stream`). The driver decides nothing about the geometry: it is handed one and runs it.
"""

from __future__ import annotations

import torch

from flce_policy.plan.geometry import Geometry
from flce_policy.plan.scaled_exp import is_scaled_exp, slot_tile
from flce_policy.plan.scaled_exp import row_scaled as row_scaled_form

from .ce_kernel import ce_rows, ce_workspace
from .driver_call import (
    CEParams,
    ChunkEvent,
    DeferredTargets,
    DriverCall,
    DriverOutputs,
    GradRequest,
    _fault_hooks,
    _observers,
    before_chunk,
    inject_oom,
    notify,
    observe_chunks,
)
from .scaled_exp import scaled_exp_logits
from .side_stream import weight_grad_stream
from .target_grad import TargetTerms
from .vocab_tiled import run_vocab_tiled
from .weight_grad_filter import (
    count_unfiltered,
    filter_scratch_for,
    filtered_weight_grad,
    filters,
    flag_tiles,
    rest_after_dense,
)
from .weight_grad_gemm import accumulate_weight_grad

# The call and event types and the test hooks live below both drivers (driver_call); re-exported as the driver's API.
__all__ = [
    "CEParams",
    "GradRequest",
    "DriverOutputs",
    "DriverCall",
    "DeferredTargets",
    "ChunkEvent",
    "run_geometry",
    "observe_chunks",
    "inject_oom",
]


def run_geometry(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    geometry: Geometry,
    params: CEParams,
    grads: GradRequest,
    *,
    class_weight: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    scale_per_row: bool = False,
    deferred_targets: DeferredTargets | None = None,
) -> DriverOutputs:
    """Walk ``x [BT, H]`` in ``geometry.num_chunks`` chunks of ``geometry.chunk_size`` rows.

    Row-only geometry runs here; vocab-tiled geometry (``vocab_chunk < V``) in
    :mod:`flce_policy.kernels.vocab_tiled`. ``grad_scale`` multiplies dL/dlogits (``[scale_ce,
    scale_z]``, or per row with ``scale_per_row``); it is required when ``grads.any``. The
    returned gradients are of the scaled loss. No host synchronisation happens here. With ``deferred_targets``,
    ``target`` (and ``grad_scale``) are written by a kernel not queued yet: the driver queues it once the first
    chunk's logits GEMM is (its kernels that read them come after).
    """
    geometry.check_tensors(x, weight)
    tokens, vocab = x.shape[0], weight.shape[0]
    device, f32 = x.device, torch.float32
    weight_dtype = grads.weight_dtype or weight.dtype
    accum_dtype = getattr(torch, geometry.accumulator_dtype(grads.accum_dtype, grads.weight_dtype))
    outputs = DriverOutputs(
        loss_rows=torch.empty(tokens, dtype=f32, device=device),
        z_loss_rows=torch.empty(tokens, dtype=f32, device=device) if params.z_loss_scale else None,
        argmax_rows=torch.empty(tokens, dtype=torch.int64, device=device) if params.track_argmax else None,
        grad_input=torch.empty_like(x) if grads.input else None,
        grad_weight=torch.empty(weight.shape, dtype=accum_dtype, device=device) if grads.weight else None,
        grad_bias=torch.zeros(vocab, dtype=f32, device=device) if grads.bias else None,
        entropy_rows=torch.empty(tokens, dtype=f32, device=device) if params.entropy else None,
    )
    call = DriverCall(
        x, weight, bias, target, geometry, params, grads, class_weight, grad_scale, scale_per_row, deferred_targets
    )  # fmt: skip
    (_run_rows if geometry.is_row_only else run_vocab_tiled)(call, outputs)
    # run() has returned, so its slab is freed before a cast allocates a second grad_weight.
    grad_weight, grad_bias = outputs.grad_weight, outputs.grad_bias
    if grad_weight is not None and grad_weight.dtype != weight_dtype:
        grad_weight = grad_weight.to(weight_dtype)
    if grad_bias is not None and bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return outputs._replace(grad_weight=grad_weight, grad_bias=grad_bias)


def _run_rows(call: DriverCall, outputs: DriverOutputs) -> None:
    """The row-only loop: one [chunk_size, V] slab, three GEMMs per chunk."""
    x, weight, bias, target, geometry, params, grads, class_weight, grad_scale, scale_per_row, deferred_targets = call
    loss_rows, z_loss_rows, argmax_rows, grad_input, grad_weight, grad_bias, entropy_rows = outputs
    tokens, chunk_size = x.shape[0], geometry.chunk_size
    slab = torch.empty((chunk_size, geometry.vocab_chunk), dtype=x.dtype, device=x.device)
    scaled_exp = is_scaled_exp(geometry.slab_form)  # the logits GEMM's epilogue fills the partials
    # the scaled-exp slab's row-scaled form: no pass rewrites the slab, the backward GEMMs scale its rows
    row_scaled = (
        scaled_exp
        and grads.any
        and row_scaled_form(
            geometry.slab_form,
            bias=bias is not None,
            label_smoothing=params.label_smoothing,
            dtype=geometry.problem.dtype,
        )
    )
    workspace = ce_workspace(
        chunk_size,
        geometry.vocab_chunk,
        x.device,
        entropy=entropy_rows is not None,
        scaled_exp=scaled_exp,
        slot_cols=slot_tile(geometry.slab_form, row_scaled_chunks=row_scaled),
    )
    x_scaled = torch.empty_like(x[:chunk_size]) if row_scaled and grad_weight is not None else None
    weight_t = weight.t()
    scratch = filter_scratch_for(call, chunk_size, geometry.vocab_chunk)  # None: the dense GEMMs
    filtered = filters(call)  # with a filter even where this call rests (the observers count it unfiltered)
    flagging = scratch is not None
    # with geometry.overlap_weight_grad on CUDA, the grad_weight work beside the grad_input GEMM (side_stream)
    weight_grads = weight_grad_stream(geometry, x.device, filtered)
    for index in range(geometry.num_chunks):
        # once a chunk's flags kept so many tiles that its grad_weight ran the dense GEMM (little or nothing to skip:
        # random logits), the call's later chunks go dense without flags, which cost 2-3% of a chunk (the GEMM's row
        # maxima, the finish's flag bytes; H200, results/2026-12-02-h200-filter-random-logits/overhead_probe.log) that
        # a chunk like it would not win back
        chunk_scratch = scratch if flagging else None
        if _fault_hooks:
            before_chunk(geometry, index)
        start = index * chunk_size
        stop = min(start + chunk_size, tokens)
        x_chunk, logits = x[start:stop], slab[: stop - start]
        chunk_rows = dict(
            target=target[start:stop],
            loss_rows=loss_rows[start:stop],
            z_loss_rows=None if z_loss_rows is None else z_loss_rows[start:stop],
            argmax_rows=None if argmax_rows is None else argmax_rows[start:stop],
            grad_scale=None if not grads.any else grad_scale[start:stop] if scale_per_row else grad_scale,
            entropy_rows=None if entropy_rows is None else entropy_rows[start:stop],
        )
        # a row-scaled chunk, then the same chunk per tile where a row was out of its range (no tiles otherwise)
        for redo in (False, True) if row_scaled else (False,):
            if scaled_exp:
                scaled_exp_logits(
                    x_chunk,
                    weight,
                    bias,
                    logits,
                    # the target logit's kernel checks the range itself: the caller's targets while unchecked
                    chunk_rows["target"] if deferred_targets is None else deferred_targets.given[start:stop],
                    workspace,
                    class_weight=class_weight,
                    label_smoothing=params.label_smoothing,
                    track_argmax=argmax_rows is not None,
                    entropy=entropy_rows is not None,
                    ignore_index=params.ignore_index,
                    row_scaled=row_scaled and not redo,
                    redo=redo,
                    flag_maxima=chunk_scratch is not None,
                    softcap=params.softcap,
                )
            elif bias is None:
                torch.mm(x_chunk, weight_t, out=logits)
            else:
                torch.addmm(bias, x_chunk, weight_t, out=logits)
            if deferred_targets is not None:  # the first GEMM is queued: the check now (once; no-op after)
                deferred_targets.queue()
            ce_rows(
                logits,
                workspace=workspace,
                ignore_index=params.ignore_index,
                label_smoothing=params.label_smoothing,
                # a softcapped scaled-exp chunk is row-scaled (call_routing), its redo pass never flagged
                softcap=None if scaled_exp and redo else params.softcap,
                round_softcap=params.round_softcap,
                z_loss_scale=params.z_loss_scale,
                class_weight=class_weight,
                token_scaling=params.token_scaling,
                scale_per_row=scale_per_row,
                shard=params.shard,
                filter_flags=None if chunk_scratch is None else chunk_scratch.flags,
                filter_eps=params.grad_weight_filter or 0.0,
                row_scaled=row_scaled and not redo,
                redo=redo,
                **chunk_rows,
            )
        # the filter's tile count, queued now: the host reads it while the GPU runs the grad_input GEMM
        flagged = (
            None
            if chunk_scratch is None
            else flag_tiles(chunk_scratch, stop - start, logits.shape[1], rescue=params.grad_weight_filter_rescue)
        )
        # a scaled-exp slab's gradient lacks the target's one-hot term: added beside the GEMMs (target_grad)
        target_terms = (
            TargetTerms(target[start:stop], workspace, params.ignore_index) if scaled_exp and grads.any else None
        )
        weight_grads.fork()  # G is queued: the side stream may start on it while grad_input's GEMM runs
        if grad_input is not None:
            torch.mm(logits, weight, out=grad_input[start:stop])  # dense whatever the filter
        if target_terms is not None:
            target_terms.into_chunk(
                None if grad_input is None else grad_input[start:stop],
                weight,
                None if target_terms.exact_for(grad_weight) else logits,
                row_scale=workspace.row_scale[: stop - start] if row_scaled else None,
                x_chunk=x_chunk,
                x_scaled=None if x_scaled is None else x_scaled[: stop - start],
            )
        # the row-scaled slab is the gradient over each row's scale: grad_weight's GEMM takes x_c times it
        x_operand = x_chunk if x_scaled is None else x_scaled[: stop - start]
        # on the side stream with overlap_weight_grad (a logits slab, no filter); the main stream waits for it
        # after the block, before the next chunk's logits GEMM overwrites the slab
        with weight_grads.beside():
            if chunk_scratch is not None:
                went_dense = filtered_weight_grad(
                    grad_weight,
                    logits,
                    x_operand,
                    chunk_scratch,
                    first=index == 0,
                    grad_bias=grad_bias,
                    rescue=params.grad_weight_filter_rescue,
                    flagged=flagged,
                )
                flagging = not went_dense
            else:
                if grad_weight is not None:
                    # The first chunk overwrites (beta=0): no zero-fill of a parameter-sized buffer.
                    accumulate_weight_grad(grad_weight, logits, x_operand, first=index == 0)
                if filtered:
                    count_unfiltered(stop - start, logits.shape[1], logits.device)
            if grad_bias is not None and chunk_scratch is None:
                grad_bias += logits.sum(dim=0, dtype=torch.float32)
            if target_terms is not None and target_terms.exact_for(grad_weight):
                target_terms.into_weight_grads(grad_weight, grad_bias, x_chunk)
        if _observers:
            notify(ChunkEvent(index, start, stop - start, tuple(slab.shape), slab.numel() * slab.element_size()))
    if scratch is not None and not flagging:  # a chunk's flags bought nothing: the policy rests a few calls
        rest_after_dense(call)
