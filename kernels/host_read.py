"""Reading a few device values on the host without stalling the GPU's queue.

A plain ``.item()`` waits for every kernel queued so far and leaves the GPU idle while Python queues the next
ones. Here the copy into pinned memory is queued with an event behind it; the caller queues more work, then
waits for the event only (the GPU keeps running what was queued after it).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["HostRead"]

_slots = threading.local()


def _pinned_slot(
    device: torch.device, key: str, size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.cuda.Event]:
    """This thread's pinned buffer and event for ``key`` on ``device``, made once (a pinned allocation costs more
    than the copy). A reader finishes before the next one of the same key in the thread starts."""
    cache = _slots.__dict__.setdefault("by_key", {})
    index = device.index if device.index is not None else torch.cuda.current_device()
    slot = cache.get((key, index))
    if slot is None or slot[0].numel() < size or slot[0].dtype != dtype:
        slot = cache[(key, index)] = (torch.zeros(size, dtype=dtype, pin_memory=True), torch.cuda.Event())
    return slot


class HostRead:
    """``values`` (a small device tensor) on its way to the host: queued at construction, read by :meth:`wait`.

    ``key`` names the pinned buffer reused by the next read of that key in this thread (one in flight per key).
    On a CPU tensor nothing is copied.
    """

    def __init__(self, values: torch.Tensor, key: str) -> None:
        if values.is_cuda:
            buffer, self._ready = _pinned_slot(values.device, key, values.numel(), values.dtype)
            self._host = buffer[: values.numel()]
            self._host.copy_(values.reshape(-1), non_blocking=True)
            self._ready.record(torch.cuda.current_stream(values.device))
        else:
            self._host, self._ready = values.reshape(-1), None

    def wait(self) -> torch.Tensor:
        """The values on the host (waits for the copy, not for the work queued after it)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host
