"""A chunk size the user fixes."""

from __future__ import annotations

from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.problem import Problem

from .base import ChunkStrategy, StrategyError, builtin_strategy

__all__ = ["FixedChunkSize"]


@builtin_strategy
class FixedChunkSize(ChunkStrategy):
    """Always ``chunk_size`` rows, floored to a power of two and clamped to BT (100 -> 64)."""

    name = "fixed_chunk_size"

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def validate_params(self) -> None:
        value = self.chunk_size
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise StrategyError(
                f"fixed_chunk_size: chunk_size must be a positive integer, got {value!r}", param="chunk_size"
            )

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return self.chunk_size
