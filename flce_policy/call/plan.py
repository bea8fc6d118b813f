"""A loss call's arguments as one value, and its plan: what runs, on which tensors, at which geometry.

The front door (:mod:`flce_policy.loss`) packs its arguments into a :class:`LossCall`; the path that
fits the head (:mod:`flce_policy.distributed.route`) turns that into a :class:`CallPlan`, here by
:func:`local_plan` for a head that is whole on this rank, or by the vocab-parallel path for a shard of
one; :mod:`flce_policy.call.run` runs the plan. Each step hands the next one value, never back up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from flce_policy.call.options import LossOptions
from flce_policy.call.resolve import call_kind, check_tensors, geometry_for
from flce_policy.call.targets import TargetCheck, start_target_check
from flce_policy.plan.geometry import Geometry

if TYPE_CHECKING:
    from flce_policy.engine.measured_entry import Trial
    from flce_policy.plan.oom import OOMFallback
    from flce_policy.plan.weight_filter import FilterRest

__all__ = ["CallPlan", "LossCall", "autocast_dtype", "local_plan"]


class LossCall(NamedTuple):
    """One call of :func:`flce_policy.fused_linear_cross_entropy`: its arguments as given, the scalar
    options checked (:class:`LossOptions`), and the dtype it computes in."""

    input: torch.Tensor
    weight: torch.Tensor
    target: torch.Tensor
    bias: torch.Tensor | None
    class_weight: torch.Tensor | None
    policy: Any
    options: LossOptions
    tp_group: Any
    tp_grad_input: str
    #: the autocast dtype where it differs from a tensor's (:func:`autocast_dtype`); None computes in theirs
    compute_dtype: torch.dtype | None


class CallPlan(NamedTuple):
    """What runs: the checked tensors (``x`` ``[BT, H]``, ``target`` ``[BT]`` int64), the options following
    the geometry's plan, and either the resolved geometry (eager) or the policy the compiled op resolves."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    target: torch.Tensor  # the target check's safe targets (eager), or the flat given ones (compiled)
    class_weight: torch.Tensor | None  # fp32, the whole vocabulary's
    options: LossOptions
    compute_dtype: torch.dtype | None
    geometry: Geometry | None = None  # None: no rows to run, or compiled (resolved inside the op)
    #: how an OOM on the slab is answered (None: not at all, as on a vocab-parallel rank)
    fallback: OOMFallback | None = None
    targets: TargetCheck | None = None  # the started target check, which the forward pass finishes
    filter_rest: FilterRest | None = None  # the policy's memory of the problem's flagged calls
    #: True while Dynamo traces the call: it runs as one custom op that resolves ``policy`` at run time
    compiled: bool = False
    policy: Any = None
    trial: Trial | None = None  # times the call while a measured strategy measures its problem


def local_plan(call: LossCall) -> CallPlan:
    """The plan of a call whose head is whole on this rank: the tensors checked, then (eagerly) the target
    check started and the policy resolved to a geometry; under ``torch.compile`` the op does both at run time.
    """
    weight, bias, options, compute_dtype = call.weight, call.bias, call.options, call.compute_dtype
    x, target, class_weight = check_tensors(call.input, weight, call.target, bias, call.class_weight, compute_dtype)
    if not weight.shape[0]:
        raise ValueError(
            f"weight has no rows: its vocabulary dimension V is 0 (weight is [V, H] = {tuple(weight.shape)}); "
            "cross-entropy needs at least one class"
        )
    if not x.shape[1]:
        x, weight = _one_zero_column(x, weight)
    if torch.compiler.is_compiling():
        # One opaque node (flce_policy/call/custom_op.py): the geometry is resolved and the target range
        # checked inside it, at run time.
        return CallPlan(
            x, weight, bias, target, class_weight, options, compute_dtype, compiled=True, policy=call.policy
        )
    # queued by the driver after its first GEMM (flce_policy/call/targets.py says why), at the latest by finish
    target, targets = start_target_check(
        target, weight.shape[0], options.ignore_index, class_weight, options.reduction == "mean", deferred=True
    )
    if not x.shape[0]:
        return CallPlan(x, weight, bias, target, class_weight, options, compute_dtype, targets=targets)
    grad = torch.is_grad_enabled()
    kind = call_kind(options, bias, (grad and call.input.requires_grad, grad and weight.requires_grad))
    geometry, fallback, filter_rest, trial = geometry_for(call.policy, x, weight, compute_dtype or x.dtype, kind=kind)
    return CallPlan(
        x, weight, bias, target, class_weight, options.following(geometry), compute_dtype, geometry, fallback, targets,
        filter_rest, trial=trial,
    )  # fmt: skip


def autocast_dtype(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype | None:
    """The dtype the loss computes in under ``torch.autocast`` when it differs from a tensor's; else None.

    ``F.linear`` under autocast runs in the autocast dtype whatever its operands' dtypes; the loss
    does the same (an fp32 master weight and fp32 or bf16 hidden states compute in bf16).
    """
    if not isinstance(input, torch.Tensor) or input.device.type not in ("cuda", "cpu"):
        return None  # check_tensors names the problem
    device_type = input.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    tensors = (input, weight) if bias is None else (input, weight, bias)
    if all(t.dtype == dtype for t in tensors if isinstance(t, torch.Tensor)):
        return None
    return dtype


def _one_zero_column(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [BT, 0]`` and ``weight [V, 0]`` with one zero column each: the same logits (zeros, plus the bias),
    so the kernels run an H=0 call as torch does (``mean`` is log V without a bias); autograd slices the
    gradients back to H=0. Only for that degenerate size: no copy on any other call."""
    return torch.nn.functional.pad(x, (0, 1)), torch.nn.functional.pad(weight, (0, 1))
