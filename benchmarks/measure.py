"""Timing and peak-memory measurement of one fwd+bwd callable on the current CUDA device."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Measurement", "measure"]


@dataclass(frozen=True)
class Measurement:
    times_ms: tuple[float, ...]
    peak_bytes: int  # max_memory_allocated during one call minus what was allocated before it

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)


def measure(step: Callable[[], None], *, warmup: int = 2, repeats: int = 5) -> Measurement:
    """Time ``step`` with CUDA events (median of ``repeats`` after ``warmup``), then its peak memory.

    ``step`` must leave nothing allocated behind it (it drops its outputs and gradients), so
    every call starts from the same allocation.
    """
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return Measurement(tuple(times), peak)
