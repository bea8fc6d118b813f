"""The autograd Function: reductions and gradient scaling around the chunk driver.

For ``mean``/``sum`` the gradients are computed during forward (the slab is already there)
and only rescaled by ``grad_output`` in backward. For ``none`` the per-token ``grad_output``
must be folded into dL/dlogits before it is summed into grad_weight, so backward runs the
chunks again with a per-row scale.

Both passes go through the OOM fallback: a slab that does not fit is retried at half the rows
(``fallback``, from the policy; without one, the default floor and nothing remembered), and
``none``'s backward recomputes at the geometry the forward completed at.

Under autocast (``compute_dtype``) the operands are cast here, inside the Function, so that
autograd sees the caller's tensors: the gradients come back in their dtypes, and an fp32 master
weight's gradient is accumulated in fp32 by the driver, with no low-precision gradient and cast.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from flce_policy.call.options import LossOptions
from flce_policy.call.resolve import geometry_for_call
from flce_policy.call.targets import TargetCheck
from flce_policy.kernels.driver import CEParams, DeferredTargets, DriverOutputs, GradRequest
from flce_policy.kernels.loss_total import loss_totals
from flce_policy.kernels.resilient import run_with_oom_fallback
from flce_policy.kernels.scale import scale_all_unless_one_
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.oom import DEFAULT_OOM_FALLBACK, OOMFallback
from flce_policy.plan.weight_filter import FilterRest, check_rescue_has_filter

if TYPE_CHECKING:
    from flce_policy.engine.measured_entry import Trial

__all__ = [
    "FLCEFunction", "ForwardResult", "SECOND_ORDER_MESSAGE", "autocast_off", "forward_pass", "grad_request",
    "recompute_grads", "refuse_second_order", "rescale",
]  # fmt: skip


def _ce_params(options: LossOptions, filter_rest: FilterRest | None = None) -> CEParams:
    check_rescue_has_filter(options.grad_weight_filter, options.grad_weight_filter_rescue, "the loss call's ")
    return CEParams(
        ignore_index=options.ignore_index,
        label_smoothing=float(options.label_smoothing),
        softcap=None if options.softcap is None else float(options.softcap),
        round_softcap=options.softcap_rounding == "eager",
        z_loss_scale=float(options.z_loss_scale),
        track_argmax=options.return_token_accuracy or options.return_predicted_tokens,
        token_scaling=options.use_token_scaling,
        shard=options.vocab_shard,
        entropy=options.return_entropy,
        # 0 skips nothing: the dense GEMMs, not a kernel that would take every tile
        grad_weight_filter=options.grad_weight_filter or None,
        grad_weight_filter_rescue=options.grad_weight_filter_rescue if options.grad_weight_filter else None,
        grad_weight_filter_rest=filter_rest if options.grad_weight_filter else None,
    )


def _operands(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The tensors the kernels run on: the caller's, or their ``compute_dtype`` copies under autocast."""
    if compute_dtype is None:
        return x, weight, bias
    return x.to(compute_dtype), weight.to(compute_dtype), None if bias is None else bias.to(compute_dtype)


class FLCEFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        class_weight: torch.Tensor | None,
        geometry: Geometry | None,
        options: LossOptions,
        grad_enabled: bool,
        fallback: OOMFallback | None = DEFAULT_OOM_FALLBACK,
        compute_dtype: torch.dtype | None = None,
        targets: TargetCheck | None = None,
        filter_rest: FilterRest | None = None,
        trial: Trial | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        # needs_input_grad ignores torch.no_grad(): the caller's grad mode is passed in.
        needs = ctx.needs_input_grad
        wants = (grad_enabled and needs[0], grad_enabled and needs[1], grad_enabled and needs[2])
        want = grad_request(wants, weight, bias, options, compute_dtype)
        ctx.compute_dtype, ctx.filter_rest = compute_dtype, filter_rest
        with autocast_off(x.device.type):
            return _forward(
                ctx, x, weight, bias, target, class_weight, geometry, options, want, fallback, targets, trial
            )

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        options: LossOptions = ctx.options
        # Grad mode is on here only under create_graph=True; the kernels build no graph either way.
        second_order_possible = torch.is_grad_enabled()
        with torch.no_grad():
            if options.reduction == "none":
                with autocast_off(grad_loss.device.type):
                    grads = _recompute_grads(ctx, grad_loss)
            else:
                grads, ctx.grads = ctx.grads, None
                if grads is None:
                    # After a create_graph backward, autograd's order decides (CPU and CUDA differ) whether a
                    # gradient penalty's backward reaches this call or _NoSecondOrder first: one message either way.
                    raise RuntimeError(
                        f"{SECOND_ORDER_MESSAGE}; nor does a second backward through the same call run"
                        if getattr(ctx, "gave_graph", False)
                        else "fused_linear_cross_entropy: backward ran twice through the same call"
                    )
                grads = rescale(grads, grad_loss)
        if second_order_possible:
            ctx.gave_graph = True
            grads = refuse_second_order(grads)
        grad_input, grad_weight, grad_bias = grads
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None, None, None, None


SECOND_ORDER_MESSAGE = (
    "fused_linear_cross_entropy has no second derivative: a gradient it returned under create_graph=True "
    "(a gradient penalty, a Hessian-vector product) was differentiated again. Compute that term on explicit "
    "logits with torch.nn.functional.cross_entropy instead"
)


class _NoSecondOrder(torch.autograd.Function):
    """Identity on the gradients the loss returns under ``create_graph=True``, whose own backward raises.

    Without it those gradients would not require grad, and a term built on them would silently
    contribute nothing to the next backward.
    """

    @staticmethod
    def forward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx: Any, *_: Any) -> Any:  # type: ignore[override]
        raise RuntimeError(SECOND_ORDER_MESSAGE)


def refuse_second_order(grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """``grads`` as tensors that require grad, through :class:`_NoSecondOrder`: differentiating one raises
    :data:`SECOND_ORDER_MESSAGE`. Each is a detached alias marked as requiring grad, as autograd's
    ``once_differentiable`` does, so that the identity is recorded."""
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    outputs = iter(_NoSecondOrder.apply(*(g.detach().requires_grad_() for g in present)))
    return tuple(None if g is None else next(outputs) for g in grads)


def grad_request(
    wants: tuple[bool, bool, bool],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    options: LossOptions,
    compute_dtype: torch.dtype | None,
) -> GradRequest:
    """The gradients a call produces: those wanted (input, weight, bias; bias only when given), accumulated
    as ``options`` say, grad_weight returned in the weight's own dtype when ``compute_dtype`` casts it."""
    want_input, want_weight, want_bias = wants
    return GradRequest(
        input=want_input,
        weight=want_weight,
        bias=want_bias and bias is not None,
        accum_dtype=options.accum_dtype,
        weight_dtype=None if compute_dtype is None else weight.dtype,
    )


_NOTHING_TO_SWITCH_OFF = contextlib.nullcontext()


def autocast_off(device_type: str) -> Any:
    """A context with autocast off on ``device_type`` (nothing to enter when it is off already).

    The operands are already in the compute dtype; autocast must not recast the fp32 accumulators.
    """
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NOTHING_TO_SWITCH_OFF


class ForwardResult(NamedTuple):
    """What one forward pass produced, with no autograd state: shared by FLCEFunction and the custom op."""

    loss: torch.Tensor
    z_loss: torch.Tensor
    accuracy: torch.Tensor
    predicted: torch.Tensor | None
    #: (grad_input, grad_weight, grad_bias) in the caller's dtypes, computed in forward for mean/sum
    #: (None where not wanted, and all None for ``none``, whose backward recomputes).
    grads: tuple[torch.Tensor | None, ...]
    geometry: Geometry | None  # the geometry that completed (the OOM fallback may have halved it)
    entropy: torch.Tensor | None = None  # [BT] fp32 entropy of softmax(z) per row (0 where ignored), when asked


def _forward(
    ctx: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    geometry: Geometry | None,
    options: LossOptions,
    want: GradRequest,
    fallback: OOMFallback | None,
    targets: TargetCheck | None,
    trial: Trial | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if targets is None:  # a caller that started none: the check (and the safe targets) made here
        targets = TargetCheck(target, weight.shape[0], options.ignore_index, class_weight, options.reduction == "mean")
        target = targets.safe_target()
    if options.reduction == "none":
        # the caller's tensors: backward casts again rather than holding a copy between the passes
        ctx.save_for_backward(x, weight, bias, target, class_weight)
    result = forward_pass(
        x, weight, bias, targets, class_weight, geometry, options, want, fallback, ctx.compute_dtype, ctx.filter_rest,
        trial,
    )  # fmt: skip
    extras = (result.z_loss, result.accuracy, result.predicted, result.entropy)
    ctx.mark_non_differentiable(*(t for t in extras if t is not None))
    # The geometry that completed: reduction none's backward starts from it, not from the one asked for.
    ctx.options, ctx.geometry, ctx.want, ctx.fallback = options, result.geometry, want, fallback
    if options.reduction != "none":
        # Kept off save_for_backward and dropped in backward, so autograd can adopt the
        # buffers as .grad without copying a parameter-sized tensor.
        ctx.grads = result.grads
    return result.loss, result.z_loss, result.accuracy, result.predicted, result.entropy


def forward_pass(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: TargetCheck,
    class_weight: torch.Tensor | None,
    geometry: Geometry | None,
    options: LossOptions,
    want: GradRequest,
    fallback: OOMFallback | None,
    compute_dtype: torch.dtype | None,
    filter_rest: FilterRest | None = None,
    trial: Trial | None = None,
) -> ForwardResult:
    """The loss (and for mean/sum the gradients) of one call, on the caller's tensors.

    ``targets`` (started by the caller with this call's class weights and reduction) gives the safe
    targets the kernels run on, the denominators and the gradient scales; it is finished once the
    chunks are queued: a bad target raises ValueError then, with no GPU idle time before it. Where no
    host sync is allowed (CUDA-graph capture) a bad target makes its gradient scales NaN and its
    ``poison`` NaN, which the loss adds (``loss_totals`` reads it from the same meta). ``filter_rest``: the
    policy's memory of the problem's flagged calls, for a filtered call (None: it flags). ``trial``: a measured
    strategy's timing of this call (its lap spans the chunks' work; reduction none's backward is not in it).
    """
    caller_dtypes = (x.dtype, None if bias is None else bias.dtype)
    x, weight, bias = _operands(x, weight, bias, compute_dtype)
    params = _ce_params(options, filter_rest)
    target, poison = targets.safe_target(), targets.poison
    in_forward = want if options.reduction != "none" else GradRequest()
    grad_scale = targets.grad_scale if in_forward.any else None

    if geometry is None:  # empty input: no rows, nothing to run
        out = _empty_outputs(x, weight, bias, in_forward, params)
    else:
        geometry = geometry_for_call(geometry, options, x.device, bias=bias is not None, grads=in_forward.any)
        lap = None if trial is None else trial.start(x.device)
        out, geometry = run_with_oom_fallback(
            x,
            weight,
            bias,
            target,
            geometry,
            params,
            in_forward,
            fallback,
            class_weight=class_weight,
            grad_scale=grad_scale,
            deferred_targets=None if targets.queued else DeferredTargets(targets.given_target(), targets.queue),
        )
        if lap is not None:
            trial.stop(lap, geometry)  # type: ignore[union-attr]
    targets.finish()

    argmax_rows = out.argmax_rows if options.return_token_accuracy else None
    if options.reduction == "none":
        z_loss = out.z_loss_rows if out.z_loss_rows is not None else torch.zeros_like(out.loss_rows)
        loss = out.loss_rows if out.z_loss_rows is None else out.loss_rows + z_loss
        # the accuracy (a scalar) from the same kernel as mean/sum's, its loss discarded
        accuracy = loss_totals(loss, None, argmax_rows, target, targets.meta, options.ignore_index, False)[2]
    else:
        loss, z_loss, accuracy = loss_totals(
            out.loss_rows, out.z_loss_rows, argmax_rows, target, targets.meta, options.ignore_index,
            options.reduction == "mean",
        )  # fmt: skip
    if poison is not None and options.reduction == "none":
        loss = loss + poison  # mean/sum: loss_totals added it
    predicted = out.argmax_rows if options.return_predicted_tokens else None
    grads = _in_caller_dtypes(caller_dtypes, out) if options.reduction != "none" else (None, None, None)
    return ForwardResult(loss, z_loss, accuracy, predicted, grads, geometry, out.entropy_rows)


def _in_caller_dtypes(
    caller_dtypes: tuple[torch.dtype, torch.dtype | None], out: DriverOutputs
) -> tuple[torch.Tensor | None, ...]:
    """The gradients in the dtypes of the tensors the caller passed (they differ under autocast only)."""
    input_dtype, bias_dtype = caller_dtypes
    grad_input, grad_bias = out.grad_input, out.grad_bias
    if grad_input is not None and grad_input.dtype != input_dtype:
        grad_input = grad_input.to(input_dtype)
    if grad_bias is not None and grad_bias.dtype != bias_dtype:
        grad_bias = grad_bias.to(bias_dtype)
    return grad_input, out.grad_weight, grad_bias


def rescale(saved: tuple[torch.Tensor | None, ...], grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Mean/sum's backward: the gradients computed in forward times ``grad_loss``, in place.

    In place, on the device: no host sync, no pass when grad_output == 1 (the usual
    loss.backward()), and no second parameter-sized grad_weight when it is not.
    """
    scale_all_unless_one_([g for g in saved if g is not None], grad_loss)  # one launch for all of them
    return saved


def _recompute_grads(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight, bias, target, class_weight = ctx.saved_tensors
    grads, ctx.geometry = recompute_grads(
        x,
        weight,
        bias,
        target,
        class_weight,
        ctx.geometry,
        ctx.options,
        ctx.want,
        ctx.fallback,
        ctx.compute_dtype,
        grad_loss,
        ctx.filter_rest,
    )
    return grads


def recompute_grads(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    geometry: Geometry | None,
    options: LossOptions,
    want: GradRequest,
    fallback: OOMFallback | None,
    compute_dtype: torch.dtype | None,
    grad_loss: torch.Tensor,
    filter_rest: FilterRest | None = None,
) -> tuple[tuple[torch.Tensor | None, ...], Geometry | None]:
    """Reduction none's backward: the chunks again, each row's dL/dlogits times its ``grad_loss``.

    Returns the gradients in the caller's dtypes and the geometry that completed.
    """
    if geometry is None:
        return _empty_outputs(x, weight, bias, want, CEParams())[3:6], None
    caller_dtypes = (x.dtype, None if bias is None else bias.dtype)
    x, weight, bias = _operands(x, weight, bias, compute_dtype)
    row_scale = grad_loss.reshape(-1).to(torch.float32).contiguous()
    out, geometry = run_with_oom_fallback(
        x,
        weight,
        bias,
        target,
        geometry,
        dataclasses.replace(_ce_params(options, filter_rest), entropy=False),  # the forward returned it already
        want,
        fallback,
        class_weight=class_weight,
        grad_scale=row_scale,
        scale_per_row=True,
    )
    return _in_caller_dtypes(caller_dtypes, out), geometry


def _empty_outputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, want: GradRequest, params: CEParams
) -> DriverOutputs:
    def empty() -> torch.Tensor:  # one per output: a shared one would make the loss an alias of an extra
        return torch.zeros(0, dtype=torch.float32, device=x.device)

    return DriverOutputs(
        empty(),
        None,
        torch.zeros(0, dtype=torch.int64, device=x.device) if params.track_argmax else None,
        torch.zeros_like(x) if want.input else None,
        torch.zeros_like(weight, dtype=want.weight_dtype) if want.weight else None,
        torch.zeros_like(bias) if want.bias and bias is not None else None,
        empty() if params.entropy else None,
    )
