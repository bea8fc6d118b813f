"""The loss as registered custom ops, for ``torch.compile``: one opaque node, no graph break.

``fused_linear_cross_entropy`` calls :func:`compiled_loss` instead of ``FLCEFunction`` while
Dynamo traces it. The compiler then sees ``flce_policy::fused_linear_cross_entropy``: its fake
implementation gives the output shapes and dtypes, and at run time the real one runs the same
code as eager (``flce_policy.autograd.forward_pass``: the Python chunk loop, the OOM fallback).

What crosses the op boundary is tensors and scalars only:

- the policy is a key: 0 for the default policy, else the ``id`` of a live ``FLCEPolicy``
  (which registers itself when built), or a Geometry's ``chunk_size``/``vocab_chunk``/planned
  accumulator. The geometry is resolved **inside the op, at run time, from the actual shapes**:
  a marked-dynamic token count gets the geometry of each size it meets, and the device probe
  (NVML, ``.item()``) never runs under the tracer. An ``FLCEPolicy`` keeps remembering the size
  an OOM fallback completed at, because the op resolves through that same policy object;
- the options are the op's scalar arguments (a LossOptions rebuilt inside).

Gradients. For mean/sum the op returns the gradients it computed in forward as outputs (empty
where not wanted); ``setup_context`` keeps detached handles on ``ctx`` (not saved tensors, so
nothing copies them) and backward scales them in place by ``grad_output`` with plain
``Tensor.mul_`` (on the device, no host sync), dropping its own handle before returning them, so
autograd can adopt the buffer the driver allocated as ``.grad`` without a copy. No
parameter-sized buffer is added: the outputs *are* the driver's buffers. Under compile the
backward graph holds the same buffers as saved activations, and functionalization turns the
in-place scale into a clone plus an op on the clone: inductor reinplaces it onto the saved buffer
(``tests/test_compile.py`` checks the ``data_ptr`` of ``.grad`` against the driver's buffer in
eager, through the op, and with inductor), while ``aot_eager``, which never reinplaces, pays that
clone. The scale is an aten op rather than eager's skip-when-1 kernel
(``flce_policy.kernels.scale``) because inductor copies a buffer onto itself before any in-place
custom op on it: one read and write of the gradients either way, and aten's is launched by the
compiled code itself, not through a custom op's Python dispatch. For ``none`` backward is a second op
that recomputes, as in eager.

Targets. Outside CUDA-graph capture the op checks the target range on the host, as eager does
(a ValueError, even under ``torch.compile``). While a CUDA graph is being captured a host sync is
not allowed: there the check is done on the device, out-of-range targets are run as ignored
rows, and the loss becomes NaN (for mean/sum also every gradient): never a silent wrong loss.
"""

from __future__ import annotations

from typing import Any

import torch

from flce_policy.autograd import forward_pass, recompute_grads
from flce_policy.geometry import Geometry
from flce_policy.kernels.driver import GradRequest
from flce_policy.options import LossOptions
from flce_policy.policy_keys import DEFAULT_POLICY_KEY, live_policy, policy_key
from flce_policy.problem import Problem
from flce_policy.targets import TargetCheck, poisoned_targets

__all__ = ["compiled_loss"]


def _geometry_now(
    x: torch.Tensor, weight: torch.Tensor, logits_dtype: torch.dtype, key: int, rows: int, vocab_chunk: int, accum: str
) -> tuple[Geometry | None, Any]:
    """The geometry for these tensors, resolved at run time, and its OOM fallback."""
    from flce_policy.loss import _geometry_for
    from flce_policy.oom import DEFAULT_OOM_FALLBACK

    if x.shape[0] == 0:
        return None, None
    if rows:  # a Geometry was given: rebuilt for the actual problem (the wrapper checked it matches)
        problem = Problem(tokens=x.shape[0], hidden=x.shape[1], vocab=weight.shape[0], dtype=logits_dtype)
        geometry = Geometry.for_problem(problem, rows, vocab_chunk=vocab_chunk, accum_dtype=accum or None)
        return geometry, DEFAULT_OOM_FALLBACK
    return _geometry_for(live_policy(key), x, weight, logits_dtype)


def _plan(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    options: LossOptions,
    compute_dtype: torch.dtype | None,
    policy: tuple[int, int, int, str],
    wants: tuple[bool, bool, bool],
) -> tuple[Geometry | None, Any, LossOptions, GradRequest]:
    """The geometry resolved now, its OOM fallback, the options following its plan, and the gradients wanted."""
    geometry, fallback = _geometry_now(x, weight, compute_dtype or x.dtype, *policy)
    if geometry is not None:
        options = options.following(geometry)
    want = GradRequest(
        input=wants[0],
        weight=wants[1],
        bias=wants[2] and bias is not None,
        accum_dtype=options.accum_dtype,
        weight_dtype=None if compute_dtype is None else weight.dtype,
    )
    return geometry, fallback, options, want


def _host_sync_allowed(device: torch.device) -> bool:
    """False while a CUDA graph is being captured on the current stream (a sync would break it)."""
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _checked_targets(
    target: torch.Tensor, vocab: int, ignore_index: int, class_weight: torch.Tensor | None, mean: bool
) -> TargetCheck:
    """The call's targets (flce_policy/targets.py).

    Outside CUDA-graph capture: the eager path's check, a ValueError once the call's work is queued.
    While capturing (no host read allowed): bad rows run as ignored and the poison makes the loss NaN.
    """
    return TargetCheck(target, vocab, ignore_index, class_weight, mean, host_check=_host_sync_allowed(target.device))


def _empty(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


# The scalars after the five tensors, in op order; the backward returns None for each.
_SCALARS = (
    "policy_key",
    "rows",
    "vocab_chunk",
    "accum",
    "reduction",
    "ignore_index",
    "label_smoothing",
    "softcap",
    "softcap_rounding",
    "z_loss_scale",
    "token_accuracy",
    "predicted_tokens",
    "token_scaling",
    "accum_dtype",
    "compute_dtype",
    "want_input",
    "want_weight",
    "want_bias",
    "entropy",
)


def _options(
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    softcap_rounding: str,
    z_loss_scale: float,
    token_accuracy: bool,
    predicted_tokens: bool,
    token_scaling: bool,
    accum_dtype: torch.dtype | None,
    entropy: bool = False,
) -> LossOptions:
    return LossOptions(
        ignore_index=ignore_index,
        reduction=reduction,  # type: ignore[arg-type]
        label_smoothing=label_smoothing,
        softcap=softcap,
        softcap_rounding=softcap_rounding,  # type: ignore[arg-type]
        z_loss_scale=z_loss_scale,
        return_token_accuracy=token_accuracy,
        return_predicted_tokens=predicted_tokens,
        use_token_scaling=token_scaling,
        accum_dtype=accum_dtype,
        return_entropy=entropy,
    )


@torch.library.custom_op("flce_policy::fused_linear_cross_entropy", mutates_args=())
def _loss_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    policy_key: int,
    rows: int,
    vocab_chunk: int,
    accum: str,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    softcap_rounding: str,
    z_loss_scale: float,
    token_accuracy: bool,
    predicted_tokens: bool,
    token_scaling: bool,
    accum_dtype: torch.dtype | None,
    compute_dtype: torch.dtype | None,
    want_input: bool,
    want_weight: bool,
    want_bias: bool,
    entropy: bool = False,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """``(loss, z_loss, accuracy, predicted, grad_input, grad_weight, grad_bias, entropy)``; unwanted ones are empty."""
    options = _options(
        reduction, ignore_index, label_smoothing, softcap, softcap_rounding, z_loss_scale, token_accuracy,
        predicted_tokens, token_scaling, accum_dtype, entropy,
    )  # fmt: skip
    targets = _checked_targets(target, weight.shape[0], ignore_index, class_weight, reduction == "mean")
    geometry, fallback, options, want = _plan(
        x,
        weight,
        bias,
        options,
        compute_dtype,
        (policy_key, rows, vocab_chunk, accum),
        (want_input, want_weight, want_bias),
    )
    with torch.autocast(x.device.type, enabled=False):
        result = forward_pass(x, weight, bias, targets, class_weight, geometry, options, want, fallback, compute_dtype)
    device = x.device
    grads = tuple(
        g if g is not None else _empty(device, t.dtype) for g, t in zip(result.grads, (x, weight, x), strict=True)
    )
    predicted = result.predicted if result.predicted is not None else _empty(device, torch.int64)
    entropy_rows = result.entropy if result.entropy is not None else _empty(device)
    return (result.loss, result.z_loss, result.accuracy, predicted, *grads, entropy_rows)  # type: ignore[return-value]


@_loss_op.register_fake
def _(x, weight, bias, target, class_weight, policy_key, rows, vocab_chunk, accum, reduction, ignore_index,
      label_smoothing, softcap, softcap_rounding, z_loss_scale, token_accuracy, predicted_tokens, token_scaling,
      accum_dtype, compute_dtype, want_input, want_weight, want_bias, entropy=False):  # fmt: skip
    f32, device = torch.float32, x.device
    loss_shape = (x.shape[0],) if reduction == "none" else ()
    in_forward = reduction != "none"
    return (
        x.new_empty(loss_shape, dtype=f32),
        x.new_empty(loss_shape, dtype=f32),
        x.new_empty((), dtype=f32),
        x.new_empty((x.shape[0],) if predicted_tokens else (0,), dtype=torch.int64),
        torch.empty_like(x) if in_forward and want_input else _empty(device, x.dtype),
        torch.empty_like(weight) if in_forward and want_weight else _empty(device, weight.dtype),
        torch.empty_like(bias) if in_forward and want_bias and bias is not None else _empty(device, x.dtype),
        x.new_empty((x.shape[0],) if entropy else (0,), dtype=f32),
    )


@torch.library.custom_op("flce_policy::fused_linear_cross_entropy_backward", mutates_args=())
def _recompute_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    grad_loss: torch.Tensor,
    policy_key: int,
    rows: int,
    vocab_chunk: int,
    accum: str,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    softcap_rounding: str,
    z_loss_scale: float,
    token_scaling: bool,
    accum_dtype: torch.dtype | None,
    compute_dtype: torch.dtype | None,
    want_input: bool,
    want_weight: bool,
    want_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduction none's backward: ``(grad_input, grad_weight, grad_bias)``, recomputed; unwanted ones are empty."""
    options = _options(
        "none", ignore_index, label_smoothing, softcap, softcap_rounding, z_loss_scale, False, False, token_scaling,
        accum_dtype,
    )  # fmt: skip
    if not _host_sync_allowed(target.device):
        target, _ = poisoned_targets(target, weight.shape[0], ignore_index)  # the forward's loss is NaN already
    geometry, fallback, options, want = _plan(
        x,
        weight,
        bias,
        options,
        compute_dtype,
        (policy_key, rows, vocab_chunk, accum),
        (want_input, want_weight, want_bias),
    )
    with torch.autocast(x.device.type, enabled=False):
        grads, _ = recompute_grads(
            x, weight, bias, target, class_weight, geometry, options, want, fallback, compute_dtype, grad_loss
        )
    dtypes = (x.dtype, weight.dtype, x.dtype if bias is None else bias.dtype)
    return tuple(g if g is not None else _empty(x.device, t) for g, t in zip(grads, dtypes, strict=True))  # type: ignore[return-value]


@_recompute_op.register_fake
def _(x, weight, bias, target, class_weight, grad_loss, policy_key, rows, vocab_chunk, accum, ignore_index,
      label_smoothing, softcap, softcap_rounding, z_loss_scale, token_scaling, accum_dtype, compute_dtype, want_input,
      want_weight, want_bias):  # fmt: skip
    return (
        torch.empty_like(x) if want_input else _empty(x.device, x.dtype),
        torch.empty_like(weight) if want_weight else _empty(x.device, weight.dtype),
        torch.empty_like(bias) if want_bias and bias is not None else _empty(x.device, x.dtype),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, weight, bias, target, class_weight, *scalars = inputs
    ctx.scalars = dict(zip(_SCALARS, scalars, strict=True))
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(*output[1:])
    if ctx.scalars["reduction"] == "none":
        ctx.save_for_backward(x, weight, bias, target, class_weight)
        ctx.grads = None
        return
    wanted = (ctx.scalars["want_input"], ctx.scalars["want_weight"], ctx.scalars["want_bias"] and ctx.has_bias)
    # Detached handles, not saved tensors: saving would make autograd keep (and under some
    # settings copy) them, and a handle with the output's grad_fn would form a reference cycle.
    ctx.grads = tuple(g.detach() if w else None for g, w in zip(output[4:7], wanted, strict=True))


def _backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[Any, ...]:
    s = ctx.scalars
    if s["reduction"] == "none":
        x, weight, bias, target, class_weight = ctx.saved_tensors
        forward_only = ("reduction", "token_accuracy", "predicted_tokens", "entropy")
        recompute = (s[name] for name in _SCALARS if name not in forward_only)
        grads = _recompute_op(x, weight, bias, target, class_weight, grad_loss.contiguous(), *recompute)
        wanted = (s["want_input"], s["want_weight"], s["want_bias"] and ctx.has_bias)
        grads = tuple(g if w else None for g, w in zip(grads, wanted, strict=True))
    else:
        grads, ctx.grads = ctx.grads, None  # the only other reference: autograd may adopt the buffers
        if grads is None:
            raise RuntimeError("fused_linear_cross_entropy: backward ran twice through the same call")
        for g in grads:
            if g is not None:
                g.mul_(grad_loss)  # fp32 product rounded once to g's dtype; g unchanged when grad_loss is 1
    grad_input, grad_weight, grad_bias = grads
    return (grad_input, grad_weight, grad_bias, None, None, *([None] * len(_SCALARS)))


_loss_op.register_autograd(_backward, setup_context=_setup_context)


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
    """``FLCEFunction.apply``'s results through the custom op: ``(loss, z_loss, accuracy, predicted, entropy)``."""
    from flce_policy.policy import FLCEPolicy

    rows, vocab_chunk, accum = 0, 0, ""
    if isinstance(policy, Geometry):
        _check_geometry_matches(policy, x, weight, compute_dtype or x.dtype)
        rows, vocab_chunk, accum = policy.chunk_size, policy.vocab_chunk, policy.accum_dtype or ""
        key = DEFAULT_POLICY_KEY
    elif policy is None or isinstance(policy, FLCEPolicy):
        key = policy_key(policy)
    else:
        raise TypeError(
            f"under torch.compile, policy must be an FLCEPolicy, a Geometry or None; got {type(policy).__name__} "
            "(wrap a strategy as FLCEPolicy(default=strategy), built outside the compiled function)"
        )
    grad_enabled = torch.is_grad_enabled()
    out = _loss_op(
        x,
        weight,
        bias,
        target,
        class_weight,
        key,
        rows,
        vocab_chunk,
        accum,
        options.reduction,
        options.ignore_index,
        float(options.label_smoothing),
        None if options.softcap is None else float(options.softcap),
        options.softcap_rounding,
        float(options.z_loss_scale),
        options.return_token_accuracy,
        options.return_predicted_tokens,
        options.use_token_scaling,
        options.accum_dtype,
        compute_dtype,
        grad_enabled and x.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
        options.return_entropy,
    )
    loss, z_loss, accuracy, predicted = out[:4]
    entropy = out[7] if options.return_entropy else None
    return loss, z_loss, accuracy, predicted if options.return_predicted_tokens else None, entropy


def _check_geometry_matches(geometry: Geometry, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> None:
    p = geometry.problem
    if (p.tokens, p.hidden, p.vocab) != (x.shape[0], x.shape[1], weight.shape[0]) or p.dtype != str(dtype).removeprefix(
        "torch."
    ):
        raise ValueError(
            f"geometry was made for {p.describe()} but the tensors are BT={x.shape[0]} H={x.shape[1]} "
            f"V={weight.shape[0]} {dtype}; resolve a geometry for this problem"
        )
