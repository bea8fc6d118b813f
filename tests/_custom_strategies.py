"""User-style strategies that tests load by import path ("tests._custom_strategies:HalfTokens")."""

from __future__ import annotations

from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.problem import Problem
from flce_policy.strategies import ChunkStrategy


class HalfTokens(ChunkStrategy):
    """Half of the token rows per chunk (the base class floors to a power of two)."""

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return problem.tokens // 2


class FractionOfTokens(ChunkStrategy):
    """``tokens // divisor`` rows per chunk: a user strategy with a parameter."""

    def __init__(self, divisor: int = 2) -> None:
        self.divisor = divisor

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return problem.tokens // self.divisor


class NotAStrategy:
    """A class that is not a ChunkStrategy."""

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return 1
