"""The public loss: ``fused_linear_cross_entropy`` and its ``nn.Module``.

The front door tells one call's story, each step one floor down: the options checked, the plan
resolved (the tensors checked; the device's policy turned into a geometry; a vocab shard agreed over
its group), the plan run (eagerly, or as one custom op under ``torch.compile``), the results wrapped as
the caller asked. Nothing below imports this module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flce_policy.call.options import LossOptions, Reduction, SoftcapRounding
from flce_policy.call.output import FLCEOutput, loss_output
from flce_policy.call.plan import LossCall, autocast_dtype
from flce_policy.call.run import run
from flce_policy.distributed.route import call_plan
from flce_policy.distributed.vocab_parallel import GradInputMode

__all__ = ["fused_linear_cross_entropy", "FusedLinearCrossEntropyLoss", "FLCEOutput", "autocast_dtype"]


def fused_linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    policy: Any = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    class_weight: torch.Tensor | None = None,
    accum_dtype: torch.dtype | None = None,
    use_token_scaling: bool = False,
    return_predicted_tokens: bool = False,
    tp_group: Any = None,
    tp_grad_input: GradInputMode = "full",
    return_entropy: bool = False,
    softcap_rounding: SoftcapRounding = "fp32",
    grad_weight_filter: float | None = None,
    grad_weight_filter_rescue: int | None = None,
    slab_form: str | None = None,
) -> torch.Tensor | FLCEOutput:
    """``cross_entropy(input @ weight.T + bias, target)`` without materialising the logits.

    ``input`` ``[..., H]`` (leading dims flattened into rows), ``weight`` ``[V, H]`` and ``bias`` ``[V]`` as
    ``F.linear`` takes them, in one dtype; under ``torch.autocast`` in any float dtypes: computed in the
    autocast dtype, each gradient returned in its tensor's (an fp32 master weight's accumulated in fp32).
    ``target`` ``[...]`` (``input.shape[:-1]``): class ids. ``class_weight`` ``[V]``: as ``F.cross_entropy``'s
    ``weight``, any sign (``mean`` divides by the kept targets' weight sum, as torch). ``policy``: an
    :class:`FLCEPolicy` (default ``FLCEPolicy.default()``, which honours ``FLCE_POLICY_CONFIG``), a
    :class:`Geometry` for this exact problem, or a strategy. A slab that runs out of memory is retried at
    half the rows (``OOMFallbackWarning``); a policy sets the floor, may switch it off, and remembers the
    size that completed. ``tp_group``, ``tp_grad_input``: a head split along the vocabulary over a process
    group (:mod:`flce_policy.distributed.vocab_parallel`). Each other keyword is an option documented on
    :class:`~flce_policy.call.options.LossOptions`, where it is checked. Returns the loss, or an
    :class:`FLCEOutput` when a ``return_*`` option is set.

    Differences from ``F.cross_entropy``: the loss is float32 whatever the input dtype; ``mean``
    over zero non-ignored tokens (all ignored, or empty input) is 0 with zero gradients, not NaN;
    ``V = 0`` is a ValueError; there is no second derivative: a gradient returned under
    ``create_graph=True`` requires grad, and differentiating it raises RuntimeError.
    """
    options = LossOptions(
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, softcap=softcap,
        softcap_rounding=softcap_rounding, z_loss_scale=z_loss_scale, return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy, accum_dtype=accum_dtype, use_token_scaling=use_token_scaling,
        return_predicted_tokens=return_predicted_tokens, return_entropy=return_entropy,
        grad_weight_filter=grad_weight_filter, grad_weight_filter_rescue=grad_weight_filter_rescue, slab_form=slab_form,
    )  # fmt: skip
    compute_dtype = autocast_dtype(input, weight, bias)
    call = LossCall(input, weight, target, bias, class_weight, policy, options, tp_group, tp_grad_input, compute_dtype)
    plan = call_plan(call)  # the tensors checked, the policy resolved to a geometry, a vocab shard agreed
    return loss_output(run(plan), target.shape, options)  # eagerly, or one custom op while Dynamo traces


class FusedLinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`; options are fixed at construction."""

    def __init__(self, policy: Any = None, **options: Any) -> None:
        super().__init__()
        self.policy = policy
        self.options = options
        # fail early on bad options (the tensor and group ones are checked at the call)
        LossOptions(**{k: v for k, v in options.items() if k not in ("class_weight", "tp_group", "tp_grad_input")})

    def forward(
        self, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | FLCEOutput:
        return fused_linear_cross_entropy(input, weight, target, bias, policy=self.policy, **self.options)

    def extra_repr(self) -> str:
        return ", ".join([f"policy={self.policy!r}"] + [f"{k}={v!r}" for k, v in self.options.items()])
