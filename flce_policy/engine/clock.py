"""What times a measuring call: CUDA events on the call's stream, read at the next call, never waited on in it.

A clock's :meth:`~CudaClock.start` marks the start of a call's work and returns a lap; the lap's ``stop`` marks
its end, told which geometry ran (a fake clock for tests prices it from that); ``seconds`` reads the time,
waiting for the GPU only if it has not got there (by the next call of the problem it has, as a rule).
"""

from __future__ import annotations

from typing import Any, Protocol

from flce_policy.plan.geometry import Geometry

__all__ = ["Clock", "Lap", "CudaClock", "HostClock", "clock_for"]


class Lap(Protocol):
    def stop(self, geometry: Geometry) -> None: ...

    def seconds(self) -> float: ...


class Clock(Protocol):
    def start(self, device: Any) -> Lap: ...


class _EventLap:
    __slots__ = ("begin", "end", "stream")

    def __init__(self, device: Any) -> None:
        import torch

        self.stream = torch.cuda.current_stream(device)
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.begin.record(self.stream)

    def stop(self, geometry: Geometry) -> None:
        self.end.record(self.stream)

    def seconds(self) -> float:
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1e3


class CudaClock:
    """CUDA events around the call's work on the current stream of its device."""

    def start(self, device: Any) -> Lap:
        return _EventLap(device)

    def __repr__(self) -> str:
        return "CudaClock()"


_CUDA_CLOCK = CudaClock()


def clock_for(device: Any) -> Clock | None:
    """The clock of a probed GPU (CUDA events); None for the CPU and for a GPU planned without one: nothing is
    measured there unless a policy is given a clock (tests give a fake one)."""
    if not device.is_gpu or device.index is None:
        return None
    return _CUDA_CLOCK


class HostClock:
    """The host's clock around the call: for the CPU (the interpreter's smoke runs), where the work is done when the
    call returns. Never chosen by default: nothing is measured on the CPU unless a policy is given a clock."""

    def start(self, device: Any) -> Lap:
        return _HostLap()

    def __repr__(self) -> str:
        return "HostClock()"


class _HostLap:
    __slots__ = ("begin", "end")

    def __init__(self) -> None:
        import time

        self.begin = time.perf_counter()

    def stop(self, geometry: Geometry) -> None:
        import time

        self.end = time.perf_counter()

    def seconds(self) -> float:
        return self.end - self.begin
