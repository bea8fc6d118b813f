"""A strategy given to the loss itself is asked once per (parameters, problem, device), unless dynamic.

What is observed: how often the strategy is asked (it records each question) and the chunks the
driver runs (``observe_chunks``), never timing.
"""

from __future__ import annotations

import pytest
import torch
from test_loss_kernel import DEVICE, NEEDS_KERNEL_DEVICE

from flce_policy import fused_linear_cross_entropy
from flce_policy.engine import strategy_cache
from flce_policy.kernels.driver import observe_chunks
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.problem import Problem
from flce_policy.strategies import ChunkStrategy, FixedChunkSize, StrategyError

pytestmark = NEEDS_KERNEL_DEVICE
H, V = 16, 37


class Parts(ChunkStrategy):
    """``tokens // parts`` rows; records every question in the class-level ``asked``."""

    asked: list[tuple[int, int]] = []

    def __init__(self, parts: int = 2) -> None:
        self.parts = parts

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        type(self).asked.append((self.parts, problem.tokens))
        return max(1, problem.tokens // self.parts)


class LiveParts(Parts):
    """The same answer, declared dynamic (as a strategy reading free memory is)."""

    asked: list[tuple[int, int]] = []
    dynamic = True


@pytest.fixture(autouse=True)
def fresh_cache():
    strategy_cache.clear_strategy_cache()
    Parts.asked.clear()
    LiveParts.asked.clear()
    yield
    strategy_cache.clear_strategy_cache()


def inputs(tokens: int):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g).to(DEVICE)
    w = torch.randn(V, H, generator=g).to(DEVICE)
    y = torch.randint(0, V, (tokens,), generator=g).to(DEVICE)
    return x, w, y


def chunk_rows(strategy, tokens: int = 32) -> list[int]:
    """The rows of each chunk the driver runs for one forward of the loss under ``strategy``."""
    with torch.no_grad(), observe_chunks() as events:
        fused_linear_cross_entropy(*inputs(tokens), policy=strategy)
    return [event.rows for event in events]


def test_a_strategy_is_asked_once_per_problem():
    strategy = Parts(4)
    assert chunk_rows(strategy) == [8, 8, 8, 8]
    assert chunk_rows(strategy) == [8, 8, 8, 8]
    assert Parts.asked == [(4, 32)]
    assert chunk_rows(strategy, tokens=16) == [4, 4, 4, 4]  # another problem: asked
    assert chunk_rows(Parts(4)) == [8, 8, 8, 8]  # an equal strategy: the same answer, not asked again
    assert Parts.asked == [(4, 32), (4, 16)]


def test_a_changed_parameter_is_asked_again_not_answered_from_the_cache():
    strategy = Parts(4)
    assert chunk_rows(strategy) == [8, 8, 8, 8]
    strategy.parts = 2  # scikit-learn style: parameters are plain attributes
    assert chunk_rows(strategy) == [16, 16]
    strategy.parts = 4
    assert chunk_rows(strategy) == [8, 8, 8, 8]
    assert Parts.asked == [(4, 32), (2, 32)]


def test_a_dynamic_strategy_is_asked_on_every_call():
    strategy = LiveParts(4)
    for _ in range(3):
        assert chunk_rows(strategy) == [8, 8, 8, 8]
    assert LiveParts.asked == [(4, 32)] * 3


def test_an_invalid_strategy_fails_on_every_call():
    strategy = FixedChunkSize(0)
    for _ in range(2):
        with pytest.raises(StrategyError, match="chunk_size"):
            chunk_rows(strategy)
    strategy.chunk_size = 8  # fixed: now it runs
    assert chunk_rows(strategy) == [8, 8, 8, 8]


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(strategy_cache, "_CACHE_LIMIT", 3)
    device = DeviceInfo.cpu()
    for tokens in range(1, 11):
        strategy_cache.strategy_geometry(Parts(1), Problem(tokens, H, V), device)
        assert len(strategy_cache._cache) <= 3
    assert strategy_cache.strategy_geometry(Parts(1), Problem(10, H, V), device).chunk_size == 8
    assert Parts.asked == [(1, tokens) for tokens in range(1, 11)]  # the last one still cached
