"""The largest chunk whose logits slab fits a byte budget."""

from __future__ import annotations

from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.problem import Problem
from flce_policy.plan.units import format_bytes, parse_bytes

from .base import ChunkStrategy, StrategyError, builtin_strategy

__all__ = ["SlabBudget"]


@builtin_strategy
class SlabBudget(ChunkStrategy):
    """Largest power-of-two chunk with ``chunk_size * V * itemsize <= max_slab``.

    ``max_slab`` is bytes or a string such as ``"1GiB"`` / ``"512MiB"``; it is kept as written
    so the YAML round-trip shows what the user wrote.
    """

    name = "slab_budget"

    def __init__(self, max_slab: int | str) -> None:
        self.max_slab = max_slab

    @property
    def max_slab_bytes(self) -> int:
        try:
            return parse_bytes(self.max_slab)
        except ValueError as err:
            raise StrategyError(f"slab_budget: max_slab: {err}", param="max_slab") from None

    def validate_params(self) -> None:
        if self.max_slab_bytes == 0:
            raise StrategyError("slab_budget: max_slab must be positive, got 0", param="max_slab")

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        row_bytes = problem.vocab * problem.itemsize
        rows = self.max_slab_bytes // row_bytes
        if rows < 1:
            raise StrategyError(
                f"slab_budget: max_slab={self.max_slab!r} ({format_bytes(self.max_slab_bytes)}) is smaller than "
                f"one row of logits for V={problem.vocab} in {problem.dtype}; the minimum is {row_bytes} bytes "
                f"({format_bytes(row_bytes)})"
            )
        return rows
