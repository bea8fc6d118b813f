"""The slab the packaged policy derives from a GPU's total memory, for a GPU nobody measured."""

from __future__ import annotations

from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.problem import Problem
from flce_policy.plan.units import format_bytes, parse_bytes, prev_pow2

from .base import ChunkStrategy, StrategyError, builtin_strategy

__all__ = ["MemoryRule"]


@builtin_strategy
class MemoryRule(ChunkStrategy):
    """The largest chunk within ``max_slab = max(floor, largest power of two <= share * (total - reserved))``.

    ``total`` is the device's total memory (0 on the CPU: the floor). The defaults are the packaged policy's memory
    rule (configs/default.yaml): 3% of what a card holds beyond the 64 GiB the rest of a large step takes, and never
    less than 128 MiB. ``floor`` may be raised (``floor: 2GiB`` is the H100's large-head slab, or the rule's where
    larger). Sizes are bytes or strings such as ``"64GiB"``, kept as written.
    """

    name = "memory_rule"

    def __init__(self, share: float = 0.03, reserved: int | str = "64GiB", floor: int | str = "128MiB") -> None:
        self.share = share
        self.reserved = reserved
        self.floor = floor

    def _bytes(self, param: str) -> int:
        try:
            return parse_bytes(getattr(self, param))
        except ValueError as err:
            raise StrategyError(f"memory_rule: {param}: {err}", param=param) from None

    def validate_params(self) -> None:
        share = self.share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise StrategyError(f"memory_rule: share must be a number in (0, 1], got {share!r}", param="share")
        self._bytes("reserved")
        if self._bytes("floor") == 0:
            raise StrategyError("memory_rule: floor must be positive, got 0", param="floor")

    def max_slab_bytes(self, device: DeviceInfo) -> int:
        """The slab budget on ``device``."""
        budget = int(self.share * (device.total_memory_bytes - self._bytes("reserved")))
        return max(self._bytes("floor"), prev_pow2(budget) if budget >= 1 else 0)

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        budget = self.max_slab_bytes(device)
        row_bytes = problem.vocab * problem.itemsize
        if budget < row_bytes:
            raise StrategyError(
                f"memory_rule: the budget {format_bytes(budget)} on {device.name} is smaller than one row of logits "
                f"for V={problem.vocab} in {problem.dtype} ({format_bytes(row_bytes)}); raise floor"
            )
        return budget // row_bytes
