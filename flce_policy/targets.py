"""The target-range check: a class index outside ``[0, V)`` is a Python ValueError, not a device assert.

Reading a device flag on the host waits for the GPU to reach it. Done at the start of a call, that
wait also empties the GPU's queue: the GPU then idles while the host issues the call's kernels.
So :func:`start_target_check` only queues one kernel (``flce_policy.kernels.safe_targets``) and a
non-blocking copy of its flag to the host; the call runs its kernels on targets whose bad rows are
turned into ignored ones (no kernel reads outside ``[0, V)``), and :meth:`TargetCheck.finish`,
called once the call's work is queued, waits for that flag only. A bad call still raises before it
returns anything.

While a CUDA graph is being captured no host read is allowed at all: :func:`poisoned_targets`
answers a bad target with a NaN loss (and NaN gradients) instead.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["TargetCheck", "check_target_range", "poisoned_targets", "start_target_check"]


def _safe_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The targets with bad rows ignored, and a device int32 flag set to 1 if any row was bad (one launch)."""
    from flce_policy.kernels.safe_targets import safe_targets_

    flag = torch.zeros(1, dtype=torch.int32, device=target.device)
    return safe_targets_(target, vocab, ignore_index, flag), flag


class TargetCheck:
    """A started range check of ``target``; :meth:`finish` raises if any index was out of range."""

    __slots__ = ("_flag", "_ready", "_safe", "_target", "_vocab", "_ignore_index")

    def __init__(self, target: torch.Tensor, vocab: int, ignore_index: int) -> None:
        self._target, self._vocab, self._ignore_index = target, vocab, ignore_index
        self._safe, device_flag = _safe_targets(target, vocab, ignore_index)
        self._ready: torch.cuda.Event | None = None
        if target.is_cuda:
            self._flag, self._ready = _host_flag(target.device)
            self._flag.copy_(device_flag, non_blocking=True)  # filled when the GPU gets there
            self._ready.record(torch.cuda.current_stream(target.device))
        else:
            self._flag = device_flag

    def safe_target(self) -> torch.Tensor:
        """``target`` with out-of-range rows set to ``ignore_index``: what the kernels may run on meanwhile."""
        return self._safe

    def finish(self) -> None:
        """Wait for the flag (not for the work queued after it) and raise ValueError when a row was bad."""
        if self._ready is not None:
            self._ready.synchronize()
        if self._flag.item():
            # the rows the kernel changed are the bad ones (a bad index is never ignore_index)
            first = self._target[self._safe != self._target][0].item()
            raise ValueError(
                f"target holds index {first}, outside [0, V={self._vocab}) and not ignore_index={self._ignore_index}"
            )


_flags = threading.local()


def _host_flag(device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event]:
    """This thread's pinned one-element flag and event for ``device``, made once (a pinned allocation costs
    more than the whole check). A call finishes its check before the next one in the thread starts."""
    cache = _flags.__dict__.setdefault("by_device", {})
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in cache:
        cache[index] = (torch.zeros(1, dtype=torch.int32, pin_memory=True), torch.cuda.Event())
    return cache[index]


def start_target_check(target: torch.Tensor, vocab: int, ignore_index: int) -> tuple[torch.Tensor, TargetCheck]:
    """Start the check of ``target`` (1-D int64); return the targets to run on and the check to finish."""
    check = TargetCheck(target, vocab, ignore_index)
    return check.safe_target(), check


def check_target_range(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """The check, waited for now (a host sync); for callers with no work to queue first."""
    TargetCheck(target, vocab, ignore_index).finish()


def poisoned_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For CUDA-graph capture: the targets with bad rows ignored, and a 0-dim fp32 poison (NaN if any was bad).

    The caller adds the poison to the loss and to the gradient scale: a bad call gives NaN, never a
    plausible wrong loss. No host read, so it can be captured.
    """
    safe, flag = _safe_targets(target, vocab, ignore_index)
    nan = torch.full((), float("nan"), dtype=torch.float32, device=target.device)  # a fill: capturable
    return safe, torch.where(flag.view(()) > 0, nan, torch.zeros_like(nan))
