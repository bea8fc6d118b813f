"""flce-policy: GPU-aware chunk policies for a fused linear cross-entropy Triton kernel."""

from flce_policy.device import DeviceInfo
from flce_policy.geometry import Geometry
from flce_policy.problem import Problem

__all__ = ["DeviceInfo", "Geometry", "Problem"]
__version__ = "0.1.0"
