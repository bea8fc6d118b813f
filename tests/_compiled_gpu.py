"""Tests only, for the GPU tests of compiled calls: dynamo reset around each test, and a
``torch.compile(mode="reduce-overhead")`` step called through its warm-up, recording and replays, the replays with
the host sync forbidden."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import torch

__all__ = ["CALLS", "fresh_dynamo", "replayed"]

T = TypeVar("T")
#: warm-up, recording, then replays from call REPLAYS_FROM
CALLS, REPLAYS_FROM = 5, 3


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles afresh, and leaves the GPU's cache empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def replayed(step: Callable[[], T]) -> Iterator[T]:
    """Each call's result; a replay that synchronised the host raises (CUDA's sync debug mode)."""
    for i in range(CALLS):
        torch.compiler.cudagraph_mark_step_begin()
        if i >= REPLAYS_FROM:
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        yield got
