"""Liger-Kernel's chunk rule, reproduced bit for bit."""

from __future__ import annotations

from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.problem import Problem
from flce_policy.plan.units import cdiv, next_pow2

from .base import ChunkStrategy, StrategyError, builtin_strategy

__all__ = ["HeuristicC"]


@builtin_strategy
class HeuristicC(ChunkStrategy):
    """``inc_factor = cdiv(V, c*H); chunk = next_pow2(cdiv(BT, inc_factor))``, clamped to BT.

    ``c`` is Liger-Kernel's memory constant: the slab holds about ``c`` times as many logits as
    the input chunk holds activations. It ignores the device, which is why it is a proxy.
    """

    name = "heuristic_c"

    def __init__(self, c: int = 1) -> None:
        self.c = c

    def validate_params(self) -> None:
        if isinstance(self.c, bool) or not isinstance(self.c, int) or self.c < 1:
            raise StrategyError(f"heuristic_c: c must be a positive integer, got {self.c!r}", param="c")

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        inc_factor = cdiv(problem.vocab, self.c * problem.hidden)
        return next_pow2(cdiv(problem.tokens, inc_factor))  # the base class clamps to BT
