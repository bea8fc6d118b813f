"""One strategy for the heads of small models, another for the rest, split at a hidden size."""

from __future__ import annotations

from typing import Any

from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem

from .base import ChunkStrategy, StrategyError, builtin_strategy, checked_geometry
from .nested import nested_config, nested_strategy, validate_nested

__all__ = ["ByHidden"]


@builtin_strategy
class ByHidden(ChunkStrategy):
    """``small``'s geometry for heads of hidden size up to ``max_hidden``, ``large``'s above it.

    The heads of 0.5B-3B models (H <= 3072) leave most of the card free and lose most to a chunk's fixed costs
    (grad_weight's read-modify-write of [V, H] against a short K): they take a larger slab than the heads of
    models that may fill the card. The slab form stays the engine's (or the rule's pin).

    YAML: ``{strategy: by_hidden, max_hidden: 3072, small: {strategy: slab_budget, max_slab: 5GiB},
    large: {strategy: slab_budget, max_slab: 2GiB}}``.
    """

    name = "by_hidden"

    def __init__(
        self, max_hidden: int, small: ChunkStrategy | dict[str, Any], large: ChunkStrategy | dict[str, Any]
    ) -> None:
        self.max_hidden = max_hidden
        self.small = small
        self.large = large

    def validate_params(self) -> None:
        limit = self.max_hidden
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise StrategyError(
                f"by_hidden: max_hidden must be a positive integer (a hidden size), got {limit!r}", param="max_hidden"
            )
        for param in ("small", "large"):
            if getattr(self, param) is None:
                raise StrategyError(
                    f"by_hidden: {param} must be a strategy, e.g. {{strategy: slab_budget, max_slab: 2GiB}}",
                    param=param,
                )
            validate_nested(self, param)
            if nested_strategy(self, param).dynamic:  # type: ignore[union-attr]
                raise StrategyError(
                    f"by_hidden: {param} must decide from the problem and the device alone (a strategy that reads "
                    "free memory at each call is asked by the policy itself)",
                    param=param,
                )

    def chosen(self, problem: Problem) -> ChunkStrategy:
        """The strategy that chunks ``problem``."""
        return nested_strategy(self, "small" if problem.hidden <= self.max_hidden else "large")  # type: ignore[return-value]

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return self.chosen(problem).pick_chunk_size(problem, device)

    def geometry(self, problem: Problem, device: DeviceInfo, *, rule: str | None = None) -> Geometry:
        self.validate_params()
        return checked_geometry(self.chosen(problem), problem, device, rule=rule).with_origin(strategy=repr(self))

    def to_config(self) -> dict[str, Any]:
        config = super().to_config()
        nested_config(self, "small", config)
        nested_config(self, "large", config)
        return config
