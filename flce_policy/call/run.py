"""A planned loss call run: eagerly through the autograd Function, or as one custom op while Dynamo traces.

Both are imported when first run, not with the package: the kernels pick Triton's interpreter or its
compiler at import (``TRITON_INTERPRET``), which a script may set after importing flce_policy.
"""

from __future__ import annotations

import torch

from flce_policy.call.output import LossResults
from flce_policy.call.plan import CallPlan

__all__ = ["run"]


def run(plan: CallPlan) -> LossResults:
    """The loss and its extras of ``plan``, its gradients wired into autograd."""
    if plan.compiled:
        from flce_policy.call.custom_op import compiled_loss

        return compiled_loss(
            plan.x, plan.weight, plan.bias, plan.target, plan.class_weight, plan.policy, plan.options,
            plan.compute_dtype,
        )  # fmt: skip
    from flce_policy.call.autograd import FLCEFunction

    return FLCEFunction.apply(
        plan.x, plan.weight, plan.bias, plan.target, plan.class_weight, plan.geometry, plan.options,
        torch.is_grad_enabled(), plan.fallback, plan.compute_dtype, plan.targets, plan.filter_rest, plan.trial,
    )  # fmt: skip
