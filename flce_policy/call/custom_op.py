"""The loss as a registered op, for ``torch.compile``: one opaque node, no graph break.

``fused_linear_cross_entropy`` calls :func:`compiled_loss` instead of ``FLCEFunction`` while
Dynamo traces it. The compiler then sees ``flce_policy::fused_linear_cross_entropy``: its fake
implementation gives the output shapes and dtypes, and at run time the real one runs the same
code as eager (``flce_policy.call.autograd.forward_pass``: the Python chunk loop, the OOM fallback).

The op is defined with ``torch.library.Library`` and one ``CompositeExplicitAutograd`` kernel, and
its derivative is an ``autograd.Function`` around the call that Dynamo traces (AOTAutograd turns it
into the compiled backward). ``torch.library.custom_op`` + ``register_autograd`` would do the same
with three more Python layers on every call of the compiled forward (its autograd kernel, a
redispatch, its backend wrapper with an aliasing check): about 0.1 ms per call on the H200's host,
which at small shapes sets the pace of the step. Called eagerly outside that Function the op has no
derivative; nothing in flce_policy does that.

What crosses the op boundary is tensors and one string, ``config``: every scalar of the call
(policy key, options, compute dtype, gradients wanted) in a fixed text form, a constant of the
graph, decoded once per distinct text. The policy is a key: 0 for the default policy, else the
``id`` of a live ``FLCEPolicy`` (which registers itself when built), or a Geometry's
``chunk_size``/``vocab_chunk``/planned accumulator. The geometry is resolved **inside the op, at
run time, from the actual shapes**: a marked-dynamic token count gets the geometry of each size it
meets, and the device probe (NVML, ``.item()``) never runs under the tracer. An ``FLCEPolicy``
keeps remembering the size an OOM fallback completed at, and the grad_weight filter's rest, because the op
resolves through that same policy object.

Gradients. For mean/sum the op returns the gradients it computed in forward as outputs (empty
where not wanted); the Function saves them and its backward scales them in place by
``grad_output`` with plain ``Tensor.mul_`` (on the device, no host sync). No parameter-sized buffer
is added: the outputs *are* the driver's buffers. Under compile the backward graph holds them as
saved activations, and functionalization turns the in-place scale into a clone plus an op on the
clone: inductor reinplaces it onto the saved buffer (``tests/test_compile.py`` checks the
``data_ptr`` of ``.grad`` against the driver's buffer with inductor), while ``aot_eager``, which
never reinplaces, pays that clone. The scale is an aten op rather than eager's skip-when-1 kernel
(``flce_policy.kernels.scale``) because inductor copies a buffer onto itself before any in-place
custom op on it: one read and write of the gradients either way, and aten's is launched by the
compiled code itself. For ``none`` backward is a second op that recomputes, as in eager.

Targets. Outside CUDA-graph capture the op checks the target range on the host, as eager does
(a ValueError, even under ``torch.compile``). While a CUDA graph is being captured a host sync is
not allowed: there the check is done on the device, out-of-range targets are run as ignored
rows, and the loss becomes NaN (for mean/sum also every gradient): never a silent wrong loss.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from typing import Any

import torch

from flce_policy.call.autograd import autocast_off, forward_pass, grad_request, recompute_grads
from flce_policy.call.options import LossOptions
from flce_policy.call.resolve import call_problem, geometry_for
from flce_policy.call.targets import TargetCheck, poisoned_targets
from flce_policy.engine.policy_keys import DEFAULT_POLICY_KEY, live_policy, policy_key
from flce_policy.kernels.driver import GradRequest
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.oom import DEFAULT_OOM_FALLBACK
from flce_policy.plan.problem import Problem
from flce_policy.plan.weight_filter import FilterRest

__all__ = ["compiled_loss"]

_OUTPUTS = "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
_LIB = torch.library.Library("flce_policy", "FRAGMENT")
_LIB.define(
    "fused_linear_cross_entropy(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, "
    f"str config) -> {_OUTPUTS}"
)
_LIB.define(
    "fused_linear_cross_entropy_backward(Tensor x, Tensor weight, Tensor? bias, Tensor target, "
    "Tensor? class_weight, Tensor grad_loss, str config) -> (Tensor, Tensor, Tensor)"
)

# ----------------------------------------------------------------------------------- the config text

#: The call's scalars in ``config``'s order: the policy (a key, or a Geometry's rows, vocab chunk, accumulator, slab
#: form and side stream), the loss options, the compute dtype, the gradients wanted.
_FIELDS = (
    "policy_key", "rows", "vocab_chunk", "accum", "slab_form", "overlap_weight_grad",
    "reduction", "ignore_index", "label_smoothing", "softcap", "softcap_rounding", "z_loss_scale",
    "token_accuracy", "predicted_tokens", "token_scaling", "accum_dtype", "entropy", "grad_weight_filter",
    "grad_weight_filter_rescue", "slab_form_pin", "compute_dtype", "want_input", "want_weight", "want_bias",
)  # fmt: skip
_DTYPE_FIELDS = ("accum_dtype", "compute_dtype")


@torch.compiler.assume_constant_result
def _config_text(*values: Any) -> str:
    """``config`` for ``values`` in ``_FIELDS`` order: ``name=repr;...`` (dtypes by name). Run by Dynamo
    at trace time, so the graph holds the text as a constant."""
    parts = []
    for name, value in zip(_FIELDS, values, strict=True):
        if name in _DTYPE_FIELDS and value is not None:
            value = str(value).removeprefix("torch.")
        parts.append(f"{name}={value!r}")
    return ";".join(parts)


@dataclasses.dataclass(frozen=True)
class _Config:
    """A decoded ``config``: what every call with that text shares."""

    policy: tuple[int, int, int, str, str, bool]  # policy_key, rows, vocab_chunk, accum, slab_form, overlap_weight_grad
    options: LossOptions
    compute_dtype: torch.dtype | None
    wants: tuple[bool, bool, bool]  # input, weight, bias
    #: The options following a geometry's planned accumulator, and the gradient requests, per
    #: (accumulator, bias given, weight dtype): built once, not on every call.
    _followed: dict[Any, tuple[LossOptions, GradRequest]] = dataclasses.field(default_factory=dict, compare=False)

    def plan(
        self, geometry: Geometry | None, bias: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[LossOptions, GradRequest]:
        planned = (
            (None, None, None)
            if geometry is None
            else (geometry.accum_dtype, geometry.grad_weight_filter, geometry.grad_weight_filter_rescue)
        )
        key = (planned, bias is not None, weight.dtype)
        found = self._followed.get(key)
        if found is None:
            options = self.options if geometry is None else self.options.following(geometry)
            found = self._followed[key] = (options, grad_request(self.wants, weight, bias, options, self.compute_dtype))
        return found


@functools.lru_cache(maxsize=256)
def _decode(config: str) -> _Config:
    """The :class:`_Config` of a ``config`` text (once per distinct text); a malformed one raises ValueError."""
    try:
        values = dict(part.split("=", 1) for part in config.split(";"))
        values = {name: ast.literal_eval(values[name]) for name in _FIELDS}
    except (KeyError, ValueError, SyntaxError) as err:
        raise ValueError(f"flce_policy: malformed op config {config!r}: {err}") from None
    for name in _DTYPE_FIELDS:
        if values[name] is not None:
            values[name] = getattr(torch, values[name])
    options = LossOptions(
        ignore_index=values["ignore_index"],
        reduction=values["reduction"],
        label_smoothing=values["label_smoothing"],
        softcap=values["softcap"],
        softcap_rounding=values["softcap_rounding"],
        z_loss_scale=values["z_loss_scale"],
        return_token_accuracy=values["token_accuracy"],
        return_predicted_tokens=values["predicted_tokens"],
        use_token_scaling=values["token_scaling"],
        accum_dtype=values["accum_dtype"],
        return_entropy=values["entropy"],
        grad_weight_filter=values["grad_weight_filter"],
        grad_weight_filter_rescue=values["grad_weight_filter_rescue"],
        slab_form=values["slab_form_pin"],
    )
    return _Config(
        policy=(
            values["policy_key"],
            values["rows"],
            values["vocab_chunk"],
            values["accum"],
            values["slab_form"],
            values["overlap_weight_grad"],
        ),
        options=options,
        compute_dtype=values["compute_dtype"],
        wants=(values["want_input"], values["want_weight"], values["want_bias"]),
    )


# ----------------------------------------------------------------------------------- run time


def _geometry_now(
    x: torch.Tensor,
    weight: torch.Tensor,
    logits_dtype: torch.dtype,
    key: int,
    rows: int,
    vocab_chunk: int,
    accum: str,
    slab_form: str,
    overlap_weight_grad: bool,
) -> tuple[Geometry | None, Any, FilterRest | None]:
    """The geometry for these tensors, resolved at run time, its OOM fallback and a policy's filter rest."""
    if x.shape[0] == 0:
        return None, None, None
    if rows:  # a Geometry was given: rebuilt for the actual problem (the wrapper checked it matches)
        problem = call_problem(x.shape[0], x.shape[1], weight.shape[0], logits_dtype, 1)
        given = _given_geometry(problem, rows, vocab_chunk, accum, slab_form, overlap_weight_grad)
        return given, DEFAULT_OOM_FALLBACK, None
    return geometry_for(live_policy(key), x, weight, logits_dtype)[:3]  # no measuring: forward and backward agree


@functools.lru_cache(maxsize=256)
def _given_geometry(
    problem: Problem, rows: int, vocab_chunk: int, accum: str, slab_form: str, overlap_weight_grad: bool
) -> Geometry:
    """A given Geometry's chunks for ``problem``, validated once per problem rather than on every call."""
    return Geometry.for_problem(
        problem, rows, vocab_chunk=vocab_chunk, accum_dtype=accum or None, slab_form=slab_form,
        overlap_weight_grad=overlap_weight_grad,
    )  # fmt: skip


def _plan(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: _Config
) -> tuple[Geometry | None, Any, LossOptions, GradRequest, FilterRest | None]:
    """The geometry resolved now, its OOM fallback, the options following its plan, the gradients wanted and a
    policy's filter rest."""
    geometry, fallback, filter_rest = _geometry_now(x, weight, config.compute_dtype or x.dtype, *config.policy)
    options, want = config.plan(geometry, bias, weight)
    return geometry, fallback, options, want, filter_rest


def _host_sync_allowed(device: torch.device) -> bool:
    """False while a CUDA graph is being captured on the current stream (a sync would break it)."""
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _checked_targets(
    target: torch.Tensor, vocab: int, ignore_index: int, class_weight: torch.Tensor | None, mean: bool
) -> TargetCheck:
    """The call's targets (flce_policy/call/targets.py).

    Outside CUDA-graph capture: the eager path's check, a ValueError once the call's work is queued.
    While capturing (no host read allowed): bad rows run as ignored and the poison makes the loss NaN.
    """
    return TargetCheck(
        target, vocab, ignore_index, class_weight, mean, host_check=_host_sync_allowed(target.device), deferred=True
    )  # fmt: skip


def _empty(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def _refuse_to_record(*tensors: torch.Tensor | None) -> None:
    """The ops have no autograd kernel: their derivative is :class:`_CompiledLoss`. Called directly
    where autograd would record them, they say so instead of returning gradient-less results."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            "flce_policy's ops have no derivative of their own: call flce_policy.fused_linear_cross_entropy "
            "(compiled or not), not torch.ops.flce_policy.* directly, on tensors that require grad"
        )


def _loss_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    config: str,
) -> tuple[torch.Tensor, ...]:
    """``(loss, z_loss, accuracy, predicted, grad_input, grad_weight, grad_bias, entropy)``; unwanted ones are empty."""
    _refuse_to_record(x, weight, bias)
    decoded = _decode(config)
    options = decoded.options
    targets = _checked_targets(target, weight.shape[0], options.ignore_index, class_weight, options.reduction == "mean")
    geometry, fallback, options, want, filter_rest = _plan(x, weight, bias, decoded)
    with autocast_off(x.device.type):
        result = forward_pass(
            x, weight, bias, targets, class_weight, geometry, options, want, fallback, decoded.compute_dtype,
            filter_rest,
        )  # fmt: skip
    device = x.device
    grads = tuple(
        g if g is not None else _empty(device, t.dtype) for g, t in zip(result.grads, (x, weight, x), strict=True)
    )
    predicted = result.predicted if result.predicted is not None else _empty(device, torch.int64)
    entropy_rows = result.entropy if result.entropy is not None else _empty(device)
    return (result.loss, result.z_loss, result.accuracy, predicted, *grads, entropy_rows)


def _loss_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    config: str,
) -> tuple[torch.Tensor, ...]:
    decoded = _decode(config)
    options, (want_input, want_weight, want_bias) = decoded.options, decoded.wants
    f32, device = torch.float32, x.device
    loss_shape = (x.shape[0],) if options.reduction == "none" else ()
    in_forward = options.reduction != "none"
    return (
        x.new_empty(loss_shape, dtype=f32),
        x.new_empty(loss_shape, dtype=f32),
        x.new_empty((), dtype=f32),
        x.new_empty((x.shape[0],) if options.return_predicted_tokens else (0,), dtype=torch.int64),
        torch.empty_like(x) if in_forward and want_input else _empty(device, x.dtype),
        torch.empty_like(weight) if in_forward and want_weight else _empty(device, weight.dtype),
        torch.empty_like(bias) if in_forward and want_bias and bias is not None else _empty(device, x.dtype),
        x.new_empty((x.shape[0],) if options.return_entropy else (0,), dtype=f32),
    )


def _recompute_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    grad_loss: torch.Tensor,
    config: str,
) -> tuple[torch.Tensor, ...]:
    """Reduction none's backward: ``(grad_input, grad_weight, grad_bias)``, recomputed; unwanted ones are empty."""
    _refuse_to_record(x, weight, bias, grad_loss)
    decoded = _decode(config)
    if not _host_sync_allowed(target.device):
        target, _ = poisoned_targets(target, weight.shape[0], decoded.options.ignore_index)  # the loss is NaN already
    geometry, fallback, options, want, filter_rest = _plan(x, weight, bias, decoded)
    with autocast_off(x.device.type):
        grads, _ = recompute_grads(
            x, weight, bias, target, class_weight, geometry, options, want, fallback, decoded.compute_dtype, grad_loss,
            filter_rest,
        )  # fmt: skip
    dtypes = (x.dtype, weight.dtype, x.dtype if bias is None else bias.dtype)
    return tuple(g if g is not None else _empty(x.device, t) for g, t in zip(grads, dtypes, strict=True))


def _recompute_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    grad_loss: torch.Tensor,
    config: str,
) -> tuple[torch.Tensor, ...]:
    want_input, want_weight, want_bias = _decode(config).wants
    return (
        torch.empty_like(x) if want_input else _empty(x.device, x.dtype),
        torch.empty_like(weight) if want_weight else _empty(x.device, weight.dtype),
        torch.empty_like(bias) if want_bias and bias is not None else _empty(x.device, x.dtype),
    )


_LIB.impl("fused_linear_cross_entropy", _loss_impl, "CompositeExplicitAutograd")
_LIB.impl("fused_linear_cross_entropy_backward", _recompute_impl, "CompositeExplicitAutograd")
torch.library.register_fake("flce_policy::fused_linear_cross_entropy", _loss_fake, lib=_LIB)
torch.library.register_fake("flce_policy::fused_linear_cross_entropy_backward", _recompute_fake, lib=_LIB)
_LOSS_OP = torch.ops.flce_policy.fused_linear_cross_entropy.default
_RECOMPUTE_OP = torch.ops.flce_policy.fused_linear_cross_entropy_backward.default


# ----------------------------------------------------------------------------------- the derivative


class _CompiledLoss(torch.autograd.Function):
    """The op and its derivative, traced by Dynamo into the graph's forward and backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        class_weight: torch.Tensor | None,
        config: str,
        recompute: bool,
        wants: tuple[bool, bool, bool],
    ) -> tuple[torch.Tensor, ...]:
        out = _LOSS_OP(x, weight, bias, target, class_weight, config)
        ctx.mark_non_differentiable(*out[1:])
        ctx.config, ctx.recompute, ctx.wants = config, recompute, wants
        if recompute:  # reduction none: backward runs the chunks again
            ctx.save_for_backward(x, weight, bias, target, class_weight)
        else:  # mean/sum: the gradients computed in forward
            ctx.save_for_backward(*out[4:7])
        return out

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.recompute:
            x, weight, bias, target, class_weight = ctx.saved_tensors
            grads = _RECOMPUTE_OP(x, weight, bias, target, class_weight, grad_loss.contiguous(), ctx.config)
        else:
            grads = ctx.saved_tensors
            for g, wanted in zip(grads, ctx.wants, strict=True):
                if wanted:
                    g.mul_(grad_loss)  # fp32 product rounded once to g's dtype; g unchanged when grad_loss is 1
        grad_input, grad_weight, grad_bias = (g if wanted else None for g, wanted in zip(grads, ctx.wants, strict=True))
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


@torch.compiler.assume_constant_result
def _refuse_policy(kind: str) -> int:
    """Raise the TypeError naming the fix for a policy the op cannot take.

    Run by Dynamo at trace time (as ``_config_text`` is), so the caller's error starts with this message:
    raised in traced code it would come back as Dynamo's "Observed exception", the fix buried below it.
    """
    raise TypeError(
        f"policy={kind} under torch.compile: pass policy=FLCEPolicy(default=strategy), built outside the compiled "
        f"function (a bare strategy works in eager mode only); under torch.compile policy must be an FLCEPolicy, "
        f"a Geometry or None"
    )


def compiled_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    policy: Any,
    options: LossOptions,
    compute_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``FLCEFunction.apply``'s results through the op: ``(loss, z_loss, accuracy, predicted, entropy)``."""
    from flce_policy.engine.policy import FLCEPolicy

    rows, vocab_chunk, accum, slab_form, overlap_weight_grad = 0, 0, "", "logits", False
    grad_weight_filter, rescue = options.grad_weight_filter, options.grad_weight_filter_rescue
    if isinstance(policy, Geometry):
        policy.check_tensors(x, weight, compute_dtype)
        rows, vocab_chunk, accum = policy.chunk_size, policy.vocab_chunk, policy.accum_dtype or ""
        slab_form, overlap_weight_grad = policy.slab_form, policy.overlap_weight_grad
        key = DEFAULT_POLICY_KEY
        if grad_weight_filter is None:  # the given Geometry's filter; an FLCEPolicy's is followed inside the op
            grad_weight_filter = policy.grad_weight_filter
        if rescue is None:
            rescue = policy.grad_weight_filter_rescue
    elif policy is None or isinstance(policy, FLCEPolicy):
        key = policy_key(policy)
    else:
        _refuse_policy(type(policy).__name__)
    grad_enabled = torch.is_grad_enabled()
    wants = (
        grad_enabled and x.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )
    config = _config_text(
        key, rows, vocab_chunk, accum, slab_form, overlap_weight_grad,
        options.reduction, options.ignore_index, float(options.label_smoothing),
        None if options.softcap is None else float(options.softcap), options.softcap_rounding,
        float(options.z_loss_scale), options.return_token_accuracy, options.return_predicted_tokens,
        options.use_token_scaling, options.accum_dtype, options.return_entropy, grad_weight_filter, rescue,
        options.slab_form, compute_dtype, *wants,
    )  # fmt: skip
    out = _CompiledLoss.apply(x, weight, bias, target, class_weight, config, options.reduction == "none", wants)
    loss, z_loss, accuracy, predicted = out[:4]
    entropy = out[7] if options.return_entropy else None
    return loss, z_loss, accuracy, predicted if options.return_predicted_tokens else None, entropy
