"""Another strategy's chunks on the scaled-exp slab, where the problem and the GPU can run it."""

from __future__ import annotations

from typing import Any

from flce_policy.plan.device import TMA_COMPUTE_CAPABILITY, DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.plan.scaled_exp import scaled_exp_unsupported

from .base import ChunkStrategy, StrategyError, builtin_strategy, checked_geometry
from .nested import nested_config, nested_strategy, validate_nested

__all__ = ["ScaledExp"]


@builtin_strategy
class ScaledExp(ChunkStrategy):
    """``inner``'s geometry with ``slab_form="scaled_exp"`` (:mod:`flce_policy.plan.scaled_exp`): the logits
    GEMM's epilogue stores ``exp(z - m)`` per 256 columns, for gradients without the logits' bf16 rounding
    and one pass less over the slab. Where the problem cannot run it (fp32, vocab tiles, a vocab shard,
    H or V not a multiple of 8) or the GPU is older than Hopper, ``inner``'s geometry as it is.

    YAML: ``{strategy: scaled_exp, inner: {strategy: slab_budget, max_slab: 2GiB}}``.
    """

    name = "scaled_exp"

    def __init__(self, inner: ChunkStrategy | dict[str, Any]) -> None:
        self.inner = inner

    def validate_params(self) -> None:
        if self.inner is None:
            raise StrategyError(
                "scaled_exp: inner must be a strategy, e.g. {strategy: heuristic_c, c: 16}", param="inner"
            )
        validate_nested(self, "inner")
        if nested_strategy(self, "inner").dynamic:  # type: ignore[union-attr]
            raise StrategyError(
                "scaled_exp: inner must decide from the problem and the device alone (a strategy that reads free "
                "memory at each call is asked by the policy itself)",
                param="inner",
            )

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return nested_strategy(self, "inner").pick_chunk_size(problem, device)  # type: ignore[union-attr]

    def geometry(self, problem: Problem, device: DeviceInfo, *, rule: str | None = None) -> Geometry:
        self.validate_params()
        inner = checked_geometry(nested_strategy(self, "inner"), problem, device, rule=rule)  # type: ignore[arg-type]
        capable = device.compute_capability is None or device.compute_capability >= TMA_COMPUTE_CAPABILITY
        form = "scaled_exp" if capable and scaled_exp_unsupported(problem, inner.vocab_chunk) is None else "logits"
        return inner.with_slab_form(form).with_origin(strategy=repr(self))

    def to_config(self) -> dict[str, Any]:
        config = super().to_config()
        nested_config(self, "inner", config)
        return config
