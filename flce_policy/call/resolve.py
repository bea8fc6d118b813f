"""A loss call's tensors checked and its geometry resolved: the one place every path gets them.

The local plan (:mod:`flce_policy.call.plan`), the compiled op (:mod:`flce_policy.call.custom_op`) and the
vocab-parallel path (:mod:`flce_policy.distributed.vocab_parallel`) all check their tensors with
:func:`check_tensors` and turn the policy into a Geometry with :func:`geometry_for`, so the three
answer a call alike; :func:`geometry_for_call` then takes the slab form the call's options and device can
run (the autograd forward, for every path). Nothing here runs per chunk.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from flce_policy.engine import probe
from flce_policy.engine.policy import CONFIG_ENV_VAR, FLCEPolicy
from flce_policy.engine.strategy_cache import strategy_geometry
from flce_policy.kernels.tma import tma_device
from flce_policy.plan.form_choice import pinned_slab_form
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.oom import DEFAULT_OOM_FALLBACK
from flce_policy.plan.problem import Problem
from flce_policy.plan.scaled_exp import call_form, is_scaled_exp
from flce_policy.strategies import ChunkStrategy

if TYPE_CHECKING:
    from flce_policy.call.options import LossOptions
    from flce_policy.engine.measured_entry import Trial
    from flce_policy.plan.oom import OOMFallback
    from flce_policy.plan.weight_filter import FilterRest

__all__ = ["ResolvedCall", "call_kind", "check_tensors", "geometry_for", "geometry_for_call", "call_problem"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ResolvedCall(NamedTuple):
    """What a loss call takes from its policy argument."""

    geometry: Geometry
    #: how an OOM on the slab is answered (None: not at all)
    fallback: OOMFallback | None
    #: the policy's memory of the problem's last flagged call (None without a policy: every filtered call flags)
    filter_rest: FilterRest | None = None
    #: times the call while a ``measured`` strategy measures its problem (None otherwise)
    trial: Trial | None = None


def geometry_for(
    policy: Any, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, *, tp_size: int = 1, kind: str | None = None
) -> ResolvedCall:
    """The geometry to run, how an OOM on its slab is answered (a policy's settings, else the default) and, from a
    policy, the grad_weight filter's rest for the problem.

    Under tensor parallelism ``weight`` is this rank's shard and ``tp_size`` the group's size.
    Called on every loss call (eager, and inside the compiled op): plain lookups, no validation
    once a problem has been seen. ``kind`` (:func:`call_kind`): an eager call whose policy may measure it; None
    (a vocab-parallel head, whose ranks must agree; the compiled op) runs the pick known without measuring.
    """
    if isinstance(policy, Geometry):
        return ResolvedCall(policy, DEFAULT_OOM_FALLBACK)  # checked against the tensors by the driver
    problem = call_problem(x.shape[0], x.shape[1], weight.shape[0], dtype, tp_size)
    device = probe.device_for_tensor_device(x.device)
    if isinstance(policy, ChunkStrategy):
        if policy.measures:  # its state lives in a policy: one per strategy parameters
            return geometry_for(_policy_around(policy), x, weight, dtype, tp_size=tp_size, kind=kind)
        return ResolvedCall(strategy_geometry(policy, problem, device), DEFAULT_OOM_FALLBACK)
    if policy is None:
        policy = _default_policy(os.environ.get(CONFIG_ENV_VAR))
    if isinstance(policy, FLCEPolicy):
        if kind is not None:
            geometry, fallback, trial = policy.resolve_call(problem, device, kind)
            return ResolvedCall(geometry, fallback, policy.filter_rest_for(problem, device), trial)
        return ResolvedCall(
            policy.resolve(problem, device),
            policy.oom_fallback_for(problem, device),
            policy.filter_rest_for(problem, device),
        )
    raise TypeError(f"policy must be an FLCEPolicy, a Geometry, a ChunkStrategy or None; got {type(policy).__name__}")


def call_kind(options: LossOptions, bias: torch.Tensor | None, wants: tuple[bool, bool]) -> str:
    """The options of a call that change what its kernels do, as a short string ("" for a plain training call:
    mean or sum, gradients of input and weight, nothing else): a ``measured`` strategy times each kind apart."""
    return _kind(options, bias is not None, wants)


@functools.lru_cache(maxsize=256)
def _kind(options: LossOptions, bias: bool, wants: tuple[bool, bool]) -> str:
    """call_kind's string, built once per distinct options (every call asks: a lookup, not a join)."""
    parts = [
        name
        for name, on in (
            ("bias", bias),
            ("reduction none", options.reduction == "none"),
            ("label smoothing", bool(options.label_smoothing)),
            ("softcap", options.softcap is not None),
            ("argmax", options.return_token_accuracy or options.return_predicted_tokens),
            ("entropy", options.return_entropy),
            ("z-loss", bool(options.z_loss_scale) or options.return_z_loss),
            ("token scaling", options.use_token_scaling),
            ("no input grad", not wants[0]),
            ("no weight grad", not wants[1]),
        )
        if on
    ]
    if options.grad_weight_filter:
        parts.append(f"filter {options.grad_weight_filter:g}")
    if options.accum_dtype is not None:
        parts.append(f"accum {str(options.accum_dtype).removeprefix('torch.')}")
    if options.slab_form is not None:
        parts.append(f"form {options.slab_form}")  # the call pins it: measured over rows alone
    return ", ".join(parts)


@functools.lru_cache(maxsize=64)
def _policy_around(strategy: ChunkStrategy) -> FLCEPolicy:
    """A ``measured`` strategy given to the loss itself, held in a policy of its own (per parameters: strategies
    hash by them) that keeps its picks and searches."""
    return FLCEPolicy(default=strategy, source=f"policy={strategy!r}")


def geometry_for_call(
    geometry: Geometry, options: LossOptions, device: torch.device, *, bias: bool, grads: bool
) -> Geometry:
    """``geometry`` in the form the call pins (``options.slab_form``; None: the geometry's), then in the form the
    call runs (:func:`flce_policy.plan.scaled_exp.call_form`: its options, ``bias``, ``grads`` in the forward), or on
    the logits slab where the device cannot run the scaled-exp slab (TMA: Hopper or later)."""
    if options.slab_form is not None and options.slab_form != geometry.slab_form:
        geometry = _pinned(geometry, options.slab_form, device)
    if not is_scaled_exp(geometry.slab_form):
        return geometry
    if not tma_device(device):
        return _with_slab_form(geometry, "logits")
    return _with_slab_form(geometry, _call_form(options, geometry.slab_form, geometry.problem.dtype, bias, grads))


@functools.lru_cache(maxsize=256)
def _call_form(options: LossOptions, slab_form: str, dtype: str, bias: bool, grads: bool) -> str:
    return call_form(
        slab_form,
        dtype,
        options.softcap,
        eager_rounding=options.softcap_rounding == "eager",
        bias=bias,
        label_smoothing=options.label_smoothing,
        grads=grads,
        argmax_or_entropy=_argmax_or_entropy(options),
    )[0]


def _argmax_or_entropy(options: LossOptions) -> bool:
    return options.return_token_accuracy or options.return_predicted_tokens or options.return_entropy


@functools.lru_cache(maxsize=256)
def _pinned(geometry: Geometry, slab_form: str, device: torch.device) -> Geometry:
    return geometry.with_slab_form(
        pinned_slab_form(slab_form, geometry, probe.device_for_tensor_device(device)).slab_form
    )


@functools.lru_cache(maxsize=256)
def _with_slab_form(geometry: Geometry, slab_form: str) -> Geometry:
    return geometry if slab_form == geometry.slab_form else geometry.with_slab_form(slab_form)


@functools.lru_cache(maxsize=1024)
def call_problem(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, tp_size: int) -> Problem:
    """The (validated, immutable) Problem of a call's sizes, built once per distinct sizes."""
    return Problem(tokens=tokens, hidden=hidden, vocab=vocab, dtype=dtype, tp_size=tp_size)


@functools.lru_cache(maxsize=4)
def _default_policy(config_path: str | None) -> FLCEPolicy:
    """``FLCEPolicy.default()`` loaded once per FLCE_POLICY_CONFIG value, not on every call."""
    return FLCEPolicy.default()


def check_tensors(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate shapes, dtypes and devices; return flattened input/target and fp32 class weights.

    ``compute_dtype`` (autocast) lets input, weight and bias differ in dtype: all are cast to it.
    The target range is the caller's to check (flce_policy/call/targets.py): eagerly while the call's
    kernels are queued, inside the custom op under compile, over the whole V for a vocab shard.
    """
    for name, tensor in (("input", input), ("weight", weight), ("target", target)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(_bias_type_message(bias))
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    vocab, hidden = weight.shape
    if input.dim() < 1 or input.shape[-1] != hidden:
        raise ValueError(
            f"input must be [..., H] with H={hidden} (weight is [V={vocab}, H={hidden}]), got {tuple(input.shape)}"
        )
    if target.shape != input.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} must equal input.shape[:-1] = {tuple(input.shape[:-1])}")
    for name, tensor in (("input", input), ("weight", weight)):
        if tensor.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} dtype must be bfloat16, float16 or float32, got {tensor.dtype}")
    if weight.dtype != input.dtype and compute_dtype is None:
        raise TypeError(
            f"weight dtype {weight.dtype} must equal input dtype {input.dtype} "
            "(outside torch.autocast; inside it both are cast to the autocast dtype)"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices, got dtype {target.dtype}")
    if bias is not None:
        if bias.shape != (vocab,):
            raise ValueError(f"bias must be [V={vocab}], got {tuple(bias.shape)}")
        if bias.dtype != input.dtype and compute_dtype is None:
            raise TypeError(f"bias dtype {bias.dtype} must equal input dtype {input.dtype}")
    if class_weight is not None:
        if not isinstance(class_weight, torch.Tensor) or class_weight.shape != (vocab,):
            shape = tuple(class_weight.shape) if isinstance(class_weight, torch.Tensor) else type(class_weight).__name__
            raise ValueError(f"class_weight must be a [V={vocab}] tensor, got {shape}")
        if not class_weight.dtype.is_floating_point:
            raise TypeError(f"class_weight must be floating point, got {class_weight.dtype}")
        class_weight = class_weight.to(torch.float32).contiguous()
    tensors = {"weight": weight, "target": target, "bias": bias, "class_weight": class_weight}
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != input.device:
            raise ValueError(f"{name} is on {tensor.device} but input is on {input.device}")
    _check_runnable_device(input.device)

    x = input.reshape(target.numel(), hidden)  # not -1: with H=0 that size is ambiguous
    if not x.is_contiguous():
        x = x.contiguous()
    target_flat = target.reshape(-1).to(torch.int64)
    if not target_flat.is_contiguous():
        target_flat = target_flat.contiguous()
    return x, target_flat, class_weight


def _bias_type_message(bias: object) -> str:
    message = f"bias must be a torch.Tensor [V] or None, got {type(bias).__name__}"
    if isinstance(bias, (FLCEPolicy, Geometry, ChunkStrategy)):
        # the fourth positional argument is bias; a policy given there was meant for the keyword
        message += f": pass a {type(bias).__name__} by keyword, as policy=..."
    return message


def _check_runnable_device(device: torch.device) -> None:
    from flce_policy.kernels import KERNELS_INTERPRETED, interpreter_requested

    if device.type == "cuda" and not KERNELS_INTERPRETED:
        return
    if device.type == "cpu" and KERNELS_INTERPRETED:
        return
    # Triton decides interpreter or GPU compiler when a kernel is defined: flce_policy's first were at its import.
    if device.type == "cpu" and interpreter_requested():
        raise RuntimeError(
            "fused_linear_cross_entropy: TRITON_INTERPRET=1 was set after flce_policy was imported, so its Triton "
            "kernels were built for a GPU; set TRITON_INTERPRET=1 before importing flce_policy (first thing in the "
            "script, or in the shell) to run CPU tensors under Triton's interpreter"
        )
    if device.type == "cpu":
        raise RuntimeError(
            "fused_linear_cross_entropy runs Triton kernels: CPU tensors need TRITON_INTERPRET=1 set before "
            "flce_policy is imported (the Triton interpreter; slow, meant for tests)"
        )
    if device.type == "cuda":
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set when flce_policy was imported, so its kernels run under Triton's CPU "
            "interpreter; CUDA tensors need it unset before importing flce_policy"
        )
    raise RuntimeError(f"unsupported device {device}: flce_policy needs a CUDA GPU (or CPU under TRITON_INTERPRET=1)")
