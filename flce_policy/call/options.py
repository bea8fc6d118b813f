"""The loss options, validated once and carried as one frozen object."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from flce_policy.plan.form_choice import checked_slab_form
from flce_policy.plan.geometry import OVERLAP_NO_FILTER
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
    """The keyword options of :func:`flce_policy.fused_linear_cross_entropy`, each documented here, where it is
    checked (a ValueError or TypeError naming it), and carried through the call as one frozen value."""

    #: a target equal to it skips its row: no loss, no gradient, not counted by ``mean``
    ignore_index: int = -100
    #: ``"mean"`` over the non-ignored tokens (class-weighted, as torch), ``"sum"``, or ``"none"`` (per token,
    #: in ``target``'s shape)
    reduction: Reduction = "mean"
    #: as ``F.cross_entropy``'s, in [0, 1]
    label_smoothing: float = 0.0
    #: logits become ``softcap * tanh(logits / softcap)`` before the loss
    softcap: float | None = None
    #: ``"fp32"`` (default) computes the softcap and its gradient in fp32 on the logits; ``"eager"`` rounds each
    #: of its three ops (``/ softcap``, ``tanh``, ``* softcap``) and each of their gradients to the logits'
    #: dtype, as eager PyTorch computes them on bf16/fp16 logits (HF's Gemma forward): the same numbers as that
    #: path, less precise than fp32. No effect on fp32 logits or without ``softcap``.
    softcap_rounding: SoftcapRounding = "fp32"
    #: adds ``z_loss_scale * logsumexp(logits)**2`` per non-ignored token, averaged over the non-ignored
    #: tokens for ``mean`` (not class-weighted)
    z_loss_scale: float = 0.0
    #: return the z-loss term alone as :attr:`FLCEOutput.z_loss` (it is in the loss either way)
    return_z_loss: bool = False
    #: return the share of non-ignored tokens whose argmax logit is the target
    return_token_accuracy: bool = False
    #: ``torch.float32`` accumulates grad_weight over chunks in fp32. None: what the geometry plans
    #: (``Fastest(accum="fp32")`` and ``FreeMemory(accum_dtype="float32")`` plan fp32), else the weight dtype.
    #: Asking for another than the planned one is an error.
    accum_dtype: torch.dtype | None = None
    #: multiply each token's loss (cross-entropy and z-loss), and so its gradient, by the detached predicted
    #: probability of its target (TRL's ``dft`` loss)
    use_token_scaling: bool = False
    #: return each token's argmax class (int64, ``target``'s shape, -1 where ignored)
    return_predicted_tokens: bool = False
    #: return each token's entropy (nats, fp32, detached, ``target``'s shape, 0 where ignored) of
    #: ``softmax(z)``, ``z`` the logits after ``softcap``: independent of label smoothing, class weights and
    #: token scaling. Computed in the same kernel pass (one more online partial sum), whatever the reduction.
    #: Not supported for a vocab-parallel head (``tp_group`` or a DTensor weight): NotImplementedError.
    return_entropy: bool = False
    #: eps (e.g. ``2**-12``): grad_weight and grad_bias take only the tiles of dL/dlogits (32 rows of a chunk x
    #: 128 classes) in which some token's ``|p_c - [c == y]|`` is ``>= eps`` or that hold a target;
    #: ``p = softmax(z)``, ``z`` after the softcap, before every scale (reduction, ``grad_output``, class
    #: weight, token scaling, z-loss), so the threshold is per token. The loss, every extra and grad_input are
    #: bit for bit the unfiltered call's. With ``label_smoothing`` the threshold ignores the smoothing too, and
    #: a skipped tile drops its uniform ``-eps_ls/V`` term. None (default): the policy rule's
    #: ``grad_weight_filter`` (none unless a rule sets one: the dense path); a number here wins over the
    #: policy's, and ``0`` (nothing skipped) runs the dense path. Given an :class:`FLCEPolicy`, a call whose
    #: flags bought nothing (so many tiles kept that grad_weight ran the dense GEMM) makes the policy run the
    #: problem's next filtered calls at that eps or below (``FILTER_REST_CALLS`` of
    #: :mod:`flce_policy.plan.weight_filter`) dense, without the flags' cost; then one flags again. See
    #: docs/grad_weight_filter.md.
    grad_weight_filter: float | None = None
    #: N, a power of two in [2, 65536]: a tile the filter skips whose largest per-token ``|p - onehot|`` lies
    #: L octaves below eps is multiplied anyway with probability 2^-L (L at least 1, at most log2(N); picked by
    #: a hash of the tile's rows of ``input`` and its classes: other tiles on every step) and counted 2^L
    #: times, so grad_weight and grad_bias equal the dense ones in expectation: the filter's bias on training
    #: goes, for some of the skipped tiles' cost (most for the tiles just under eps, which carry most of what
    #: is dropped) and some noise in each call's grad_weight. None (default): the policy rule's (none unless a
    #: rule sets one). Needs a filter eps (the call's or the rule's): ValueError without one.
    grad_weight_filter_rescue: int | None = None
    #: pins the slab form of this call (one of ``"logits"``, ``"scaled_exp"``, ``"scaled_exp_rows"``,
    #: ``"scaled_exp_ws"``; where the GPU or the call cannot run it, the next one down), over the policy's choice
    #: (:mod:`flce_policy.plan.form_choice`). None (default): the policy's.
    slab_form: str | None = None
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
        checked_slab_form(self.slab_form, "slab_form")
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
        geometry's predicted peak and time assume the planned one; and when it asks for a grad_weight filter
        beside a geometry with ``overlap_weight_grad``.
        """
        if geometry.overlap_weight_grad and self.grad_weight_filter:
            raise ValueError(
                f"grad_weight_filter={self.grad_weight_filter:g} with overlap_weight_grad=True "
                f"({geometry.describe()}): {OVERLAP_NO_FILTER}"
            )
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
