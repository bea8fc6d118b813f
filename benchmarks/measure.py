"""Timing and peak-memory measurement of one fwd+bwd callable on the current CUDA device."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = [
    "Measurement", "back_to_back_ms", "measure", "peak_bytes", "rotated", "sustained_calls", "time_call",
    "time_sample", "time_sustained", "warm_up",
]  # fmt: skip


@dataclass(frozen=True)
class Measurement:
    times_ms: tuple[float, ...]
    peak_bytes: int  # max_memory_allocated during one call minus what was allocated before it

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)


#: GPU clock cycles of the sleep kernel a busy-started step follows (~10 ms at the H200's 1.98 GHz): long enough
#: for the host to issue a call's first kernels, and for the clocks to leave idle, before the start event.
BUSY_START_CYCLES = 20_000_000


def measure(
    step: Callable[[], None],
    *,
    warmup: int = 2,
    repeats: int = 5,
    busy_start: bool = False,
    sustained_s: float | None = None,
) -> Measurement:
    """Time ``step`` with CUDA events (median of ``repeats`` samples after ``warmup``), then its peak memory.

    ``step`` must leave nothing allocated behind it (it drops its outputs and gradients), so
    every call starts from the same allocation. Each timed call starts on an idle GPU (the host's time before
    its first kernel counts, and a ramp from idle clocks that every method pays: 2.4-2.8 ms at the small heads
    on the H200, results/2026-12-02-h200-rows); with ``busy_start`` the GPU runs a sleep kernel while the host
    issues and the start event follows it, as inside a training step, where the loss's kernels queue behind
    the model's. With ``sustained_s`` each sample is :func:`time_sustained`'s instead of one call's.
    """
    warm_up(step, warmup)
    times = tuple(time_sample(step, busy_start=busy_start, sustained_s=sustained_s) for _ in range(repeats))
    return Measurement(times, peak_bytes(step))


def warm_up(step: Callable[[], None], calls: int) -> None:
    """``calls`` untimed calls (compilation, autotuning, the allocator's first blocks), then a synchronize."""
    for _ in range(calls):
        step()
    torch.cuda.synchronize()


def time_call(step: Callable[[], None], *, busy_start: bool = False) -> float:
    """Milliseconds of one call of ``step`` between CUDA events, from an idle GPU (or behind a sleep kernel)."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if busy_start:
        torch.cuda._sleep(BUSY_START_CYCLES)
    start.record()
    step()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def time_sample(step: Callable[[], None], *, busy_start: bool = False, sustained_s: float | None = None) -> float:
    """One timed sample of ``step`` in milliseconds per call: :func:`time_sustained` with ``sustained_s``, else
    :func:`time_call`."""
    if sustained_s is not None:
        return time_sustained(step, sustained_s)
    return time_call(step, busy_start=busy_start)


#: Untimed calls before a sustained window, as a fraction of its calls: the clocks leave the previous row's load for
#: this row's before the window starts.
SUSTAINED_LEAD_IN = 0.25


def sustained_calls(seconds: float, call_ms: float) -> int:
    """Calls of ``call_ms`` each that fill ``seconds`` (at least one)."""
    if seconds <= 0 or call_ms <= 0:
        raise ValueError(f"sustained_calls needs a positive window and call time, got {seconds} s, {call_ms} ms")
    return max(1, math.ceil(seconds * 1e3 / call_ms))


def time_sustained(step: Callable[[], None], seconds: float) -> float:
    """Mean milliseconds per call of ``step`` over about ``seconds`` of calls issued back to back (the GPU never idle).

    A training loop keeps the GPU busy; under sustained load a card may run at its power limit, its SM clock
    below the boost clock that a call started after idle time gets (H100 80GB HBM3, 2026-12-06: ~1.4 GHz at 700 W
    in small-head fwd+bwd back to back, against 1.98 GHz peak). One busy-started call sizes the window; a quarter of
    its calls more run first, untimed, while the clocks settle to this load.
    """
    calls = sustained_calls(seconds, time_call(step, busy_start=True))
    for _ in range(math.ceil(calls * SUSTAINED_LEAD_IN)):
        step()
    return back_to_back_ms(step, calls)


def back_to_back_ms(step: Callable[[], None], calls: int) -> float:
    """Mean milliseconds of ``calls`` calls of ``step`` issued back to back behind whatever is queued (the host
    free to run ahead; no synchronisation before the first)."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        step()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / calls


def peak_bytes(step: Callable[[], None]) -> int:
    """Bytes one call of ``step`` allocates at its peak over what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


Item = TypeVar("Item")


def rotated(items: Sequence[Item], round_index: int) -> list[Item]:
    """``items`` starting ``round_index`` places later (wrapping): the order of one round of interleaved timing.

    With one fixed order a row is always timed right after the same one (the default, always right after the
    floor, ran 0.7-1.4% behind its own geometry further on: H100, 2026-12-06)."""
    if not items:
        return []
    shift = round_index % len(items)
    return list(items[shift:]) + list(items[:shift])
