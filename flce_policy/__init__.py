"""flce-policy: GPU-aware chunk policies for a fused linear cross-entropy Triton kernel.

The public surface: the names below, re-exported from the front door (:mod:`flce_policy.loss`), the engine
and the plan. The rooms, from the bottom up: ``plan`` -> ``strategies`` -> ``engine`` -> ``call`` (with
``kernels``) -> ``distributed`` -> ``loss``, then ``integrations`` and ``cli`` (docs/layout.md).
"""

from flce_policy.engine.policy import DeviceRule, FLCEPolicy
from flce_policy.engine.probe import probe_device
from flce_policy.loss import FLCEOutput, FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.oom import OOMFallbackWarning
from flce_policy.plan.problem import Problem

__all__ = [
    "DeviceInfo",
    "DeviceRule",
    "FLCEOutput",
    "FLCEPolicy",
    "FusedLinearCrossEntropyLoss",
    "Geometry",
    "OOMFallbackWarning",
    "Problem",
    "fused_linear_cross_entropy",
    "probe_device",
]
__version__ = "0.1.0"
