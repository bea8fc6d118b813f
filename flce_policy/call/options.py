"""The loss options, validated once and carried as one frozen object."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from flce_policy.plan.weight_filter import checked_filter_eps, checked_filter_rescue

if TYPE_CHECKING:
    from flce_policy.plan.geometry import Geometry

__all__ = ["LossOptions", "Reduction", "SoftcapRounding"]

Reduction = Literal["mean", "sum", "none"]
_REDUCTIONS = ("mean", "sum", "none")
SoftcapRounding = Literal["fp32", "eager"]
_SOFTCAP_ROUNDINGS = ("fp32", "eager")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class LossOptions:
    """Keyword options of :func:`flce_policy.fused_linear_cross_entropy` (see there)."""

    ignore_index: int = -100
    reduction: Reduction = "mean"
    label_smoothing: float = 0.0
    softcap: float | None = None
    softcap_rounding: SoftcapRounding = "fp32"
    z_loss_scale: float = 0.0
    return_z_loss: bool = False
    return_token_accuracy: bool = False
    accum_dtype: torch.dtype | None = None
    use_token_scaling: bool = False
    return_predicted_tokens: bool = False
    return_entropy: bool = False
    #: eps of the grad_weight filter; None follows the policy's rule (itself None by default: dense).
    grad_weight_filter: float | None = None
    #: N of the filter's rescue; None follows the policy's rule (itself None by default: no rescue).
    grad_weight_filter_rescue: int | None = None
    #: Set by the loss for a vocab-parallel head (``tp_group``, or a ``Shard(0)`` DTensor weight):
    #: this rank's :class:`flce_policy.kernels.vocab_shard.VocabShard`. Not a caller's option.
    vocab_shard: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {self.ignore_index!r}")
        if not _INT64_MIN <= self.ignore_index <= _INT64_MAX:
            # compared with int64 targets: a wider value would wrap around, or not reach the kernel at all
            raise ValueError(f"ignore_index must fit in int64 [-2**63, 2**63 - 1], got {self.ignore_index}")
        if self.reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {', '.join(_REDUCTIONS)}; got {self.reduction!r}")
        if not _is_real(self.label_smoothing) or not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing!r}")
        if self.softcap is not None and (not _is_real(self.softcap) or not self.softcap > 0):
            raise ValueError(f"softcap must be a positive finite number or None, got {self.softcap!r}")
        if self.softcap_rounding not in _SOFTCAP_ROUNDINGS:
            raise ValueError(
                f"softcap_rounding must be one of {', '.join(_SOFTCAP_ROUNDINGS)}; got {self.softcap_rounding!r}"
            )
        if not _is_real(self.z_loss_scale) or self.z_loss_scale < 0:
            raise ValueError(f"z_loss_scale must be a finite number >= 0, got {self.z_loss_scale!r}")
        for name in (
            "return_z_loss", "return_token_accuracy", "use_token_scaling", "return_predicted_tokens", "return_entropy"
        ):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        object.__setattr__(self, "grad_weight_filter", checked_filter_eps(self.grad_weight_filter))
        object.__setattr__(self, "grad_weight_filter_rescue", checked_filter_rescue(self.grad_weight_filter_rescue))
        if self.accum_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"accum_dtype must be None, torch.float32, torch.bfloat16 or torch.float16; got {self.accum_dtype!r}"
            )

    def following(self, geometry: Geometry) -> LossOptions:
        """These options with the grad_weight accumulator ``geometry`` planned (none given here), and
        its grad_weight filter and rescue (a policy rule's) where the call gave none: the call's keyword wins.

        ValueError when the call asked for a different accumulator than the one planned: the
        geometry's predicted peak and time assume the planned one.
        """
        if geometry.grad_weight_filter is not None or geometry.grad_weight_filter_rescue is not None:
            planned_filter = {
                name: getattr(geometry, name)
                for name in ("grad_weight_filter", "grad_weight_filter_rescue")
                if getattr(self, name) is None and getattr(geometry, name) is not None
            }
            if planned_filter:
                return dataclasses.replace(self, **planned_filter).following(geometry)
        if geometry.accum_dtype is None:
            return self
        planned = getattr(torch, geometry.accum_dtype)
        if self.accum_dtype is None:
            return dataclasses.replace(self, accum_dtype=planned)
        if self.accum_dtype != planned:
            raise ValueError(
                f"accum_dtype={self.accum_dtype} conflicts with the geometry's planned grad_weight accumulator "
                f"{planned} (from {geometry.strategy}): pass accum_dtype=None to follow the plan, or plan "
                "another accumulator in the strategy"
            )
        return self


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
