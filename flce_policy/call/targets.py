"""A call's targets, made ready in one launch: a class index outside ``[0, V)`` is a Python ValueError.

Reading a device flag on the host waits for the GPU to reach it. Done at the start of a call, that
wait also empties the GPU's queue: the GPU then idles while the host issues the call's kernels.
So a :class:`TargetCheck` only queues one kernel (``flce_policy.kernels.safe_targets``: targets
with bad rows turned into ignored ones, so no kernel reads outside ``[0, V)``, plus the flag, the
mean's denominators and the gradient scales) and a non-blocking copy of the flag to the host;
:meth:`TargetCheck.finish`, called once the call's work is queued, waits for that flag only. A bad
call still raises before it returns anything.

A check made with ``deferred=True`` allocates its outputs and queues nothing until :meth:`TargetCheck.queue`:
the eager loss hands ``queue`` to the driver, which calls it right after the first chunk's logits GEMM is
queued, so the GEMM's launch does not wait for the check's (~0.4 ms of host time on the H200's host before a
step's first GEMM, which a step started on an idle GPU waits for). The kernels before that GEMM (the target
logit's) read the caller's targets and check the range themselves; the kernels that read the safe targets or
the scales come after it on the stream.

While a CUDA graph is being captured no host read is allowed at all: a check made with
``host_check=False`` answers a bad target with NaN instead, in the same launch: the gradient scales
are NaN and ``poison``, which the loss adds, is NaN (never a plausible wrong loss).
"""

from __future__ import annotations

import torch

from flce_policy.kernels.host_read import HostRead
from flce_policy.kernels.safe_targets import GRAD_SCALES, META_BAD, META_POISON, empty_meta, prepare_targets_

__all__ = ["TargetCheck", "check_target_range", "poisoned_targets", "start_target_check"]


class TargetCheck:
    """A started check of ``target`` (1-D int64) and what the call runs on meanwhile.

    ``class_weight`` (fp32 ``[V]`` or None) and ``mean`` set the denominators and gradient scales.
    """

    __slots__ = (
        "_flag", "_safe", "_target", "_vocab", "_ignore_index", "_class_weight", "_mean", "_host_check",
        "_queued", "meta", "poison",
    )  # fmt: skip

    def __init__(
        self,
        target: torch.Tensor,
        vocab: int,
        ignore_index: int,
        class_weight: torch.Tensor | None = None,
        mean: bool = True,
        *,
        host_check: bool = True,
        deferred: bool = False,
    ) -> None:
        self._target, self._vocab, self._ignore_index = target, vocab, ignore_index
        self._class_weight, self._mean, self._host_check = class_weight, mean, host_check
        self._safe, self.meta = torch.empty_like(target), empty_meta(target.device)
        self._flag: HostRead | None = None
        #: 0-dim fp32, NaN if a row was bad (``host_check=False`` only; the scales are NaN then too).
        self.poison: torch.Tensor | None = None if host_check else self.meta[META_POISON]
        self._queued = False
        if not deferred:
            self.queue()

    def queue(self) -> None:
        """Queue the check's kernel and its flag's copy to the host; once (later calls do nothing)."""
        if self._queued:
            return
        self._queued = True
        target = self._target
        prepare_targets_(
            target, self._vocab, self._ignore_index, self._class_weight, self._mean, not self._host_check,
            out=(self._safe, self.meta),
        )  # fmt: skip
        if not self._host_check:
            return
        self._flag = HostRead(self.meta[META_BAD : META_BAD + 1], "target check")  # filled when the GPU gets there

    @property
    def queued(self) -> bool:
        """Whether the check's kernel is queued (at construction unless ``deferred``)."""
        return self._queued

    def given_target(self) -> torch.Tensor:
        """The caller's targets (unchecked): for a kernel queued before :meth:`queue` that checks the range itself."""
        return self._target

    def safe_target(self) -> torch.Tensor:
        """``target`` with out-of-range rows set to ``ignore_index``: what the kernels may run on meanwhile."""
        return self._safe

    @property
    def grad_scale(self) -> torch.Tensor:
        """``[scale_ce, scale_z]`` (fp32, on the device): 1/mass and 1/count for mean, ones for sum (NaN after a
        bad target with ``host_check=False``)."""
        return self.meta[GRAD_SCALES]

    def finish(self) -> None:
        """Wait for the flag (not for the work queued after it) and raise ValueError when a row was bad.

        Nothing to wait for without a host check (the poison answers a bad row). Queues the check first if
        nothing did.
        """
        self.queue()
        if self._flag is None:
            return
        if self._flag.wait().item():
            # the rows the kernel changed are the bad ones (a bad index is never ignore_index)
            first = self._target[self._safe != self._target][0].item()
            raise ValueError(
                f"target holds index {first}, outside [0, V={self._vocab}) and not ignore_index={self._ignore_index}"
            )


def start_target_check(
    target: torch.Tensor,
    vocab: int,
    ignore_index: int,
    class_weight: torch.Tensor | None = None,
    mean: bool = True,
    *,
    deferred: bool = False,
) -> tuple[torch.Tensor, TargetCheck]:
    """Start the check of ``target`` (1-D int64); return the targets to run on and the check to finish
    (``deferred``: to queue as well, by :meth:`TargetCheck.queue` or at the latest :meth:`TargetCheck.finish`)."""
    check = TargetCheck(target, vocab, ignore_index, class_weight, mean, deferred=deferred)
    return check.safe_target(), check


def check_target_range(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """The check, waited for now (a host sync); for callers with no work to queue first."""
    TargetCheck(target, vocab, ignore_index).finish()


def poisoned_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For CUDA-graph capture: the targets with bad rows ignored, and a 0-dim fp32 poison (NaN if any was bad).

    No host read, so it can be captured.
    """
    check = TargetCheck(target, vocab, ignore_index, host_check=False)
    return check.safe_target(), check.poison  # type: ignore[return-value]
