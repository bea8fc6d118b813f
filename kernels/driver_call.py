"""The drivers' call and event types and their test hooks: shared by the row driver
(:mod:`flce_policy.kernels.driver`) and the vocab-tiled one (:mod:`flce_policy.kernels.vocab_tiled`),
below both so that neither imports the other's internals. The row driver re-exports them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from flce_policy.plan.geometry import Geometry

if TYPE_CHECKING:
    from flce_policy.plan.weight_filter import FilterRest

    from .vocab_shard import VocabShard

__all__ = [
    "CEParams",
    "GradRequest",
    "DriverOutputs",
    "DriverCall",
    "DeferredTargets",
    "ChunkEvent",
    "observe_chunks",
    "inject_oom",
    "before_chunk",
    "notify",
]


@dataclass(frozen=True)
class CEParams:
    """The cross-entropy options the kernel needs (validated upstream)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    softcap: float | None = None
    #: Each softcap op and its gradient rounded to the logits' dtype, as eager PyTorch computes them.
    round_softcap: bool = False
    z_loss_scale: float = 0.0
    track_argmax: bool = False
    token_scaling: bool = False  # each row's loss and gradient times its detached p_target
    entropy: bool = False  # each row's entropy of softmax(z) into DriverOutputs.entropy_rows
    #: This rank's slice of a vocab-parallel head; the rows' partials are merged over its group per chunk.
    shard: VocabShard | None = None
    #: eps of the grad_weight filter (> 0), or None for the dense GEMM: grad_weight and grad_bias take only the
    #: tiles of dL/dlogits where some |p - onehot| >= eps (flce_policy.kernels.weight_grad_filter).
    grad_weight_filter: float | None = None
    #: N: a tile the filter skips kept anyway with probability 2^-L (L its level, at most log2(N)), counted 2^L times
    #: (unbiased); None: none kept.
    grad_weight_filter_rescue: int | None = None
    #: The policy's memory of this problem's flagged calls (None: the call flags): a call resting after one whose
    #: flags bought nothing (its grad_weight went to the dense GEMM) runs the dense GEMMs without flags.
    grad_weight_filter_rest: FilterRest | None = None


@dataclass(frozen=True)
class GradRequest:
    """Which gradients to produce; with none, the kernel only computes losses."""

    input: bool = False
    weight: bool = False
    bias: bool = False
    accum_dtype: torch.dtype | None = None  # grad_weight accumulator dtype; None = weight dtype
    #: dtype of the returned grad_weight (an autocast caller's master weight); None = the weight's.
    #: An fp32 one is accumulated in fp32 directly: no low-precision gradient and cast.
    weight_dtype: torch.dtype | None = None

    @property
    def any(self) -> bool:
        return self.input or self.weight or self.bias


class DriverOutputs(NamedTuple):
    loss_rows: torch.Tensor  # [BT] fp32, class-weighted CE per row (0 where ignored)
    z_loss_rows: torch.Tensor | None  # [BT] fp32
    argmax_rows: torch.Tensor | None  # [BT] int64, the argmax class (-1 where ignored)
    grad_input: torch.Tensor | None  # [BT, H], input dtype
    grad_weight: torch.Tensor | None  # [V, H], grads.weight_dtype or the weight's
    grad_bias: torch.Tensor | None  # [V], bias dtype
    entropy_rows: torch.Tensor | None = None  # [BT] fp32, entropy of softmax(z) in nats (0 where ignored)


class DeferredTargets(NamedTuple):
    """Targets whose check is not queued yet: the driver calls ``queue`` once the first chunk's logits GEMM is
    queued, so that the GEMM's launch does not wait on the host for the check's. ``given`` (the caller's
    targets, unchecked) is what a kernel queued before it reads; such a kernel checks the range itself."""

    given: torch.Tensor
    queue: Callable[[], None]


class DriverCall(NamedTuple):
    """One call's inputs, as :func:`run_geometry` received them, for the loop of its geometry family."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    target: torch.Tensor
    geometry: Geometry
    params: CEParams
    grads: GradRequest
    class_weight: torch.Tensor | None
    grad_scale: torch.Tensor | None
    scale_per_row: bool
    deferred_targets: DeferredTargets | None = None


class ChunkEvent(NamedTuple):
    """What one chunk iteration did, reported to observers (tests, profiling)."""

    index: int
    row_start: int
    rows: int
    slab_shape: tuple[int, int]
    slab_bytes: int


_observers: list[Callable[[ChunkEvent], None]] = []


@contextmanager
def observe_chunks() -> Iterator[list[ChunkEvent]]:
    """Record every chunk iteration the driver runs inside the block."""
    events: list[ChunkEvent] = []
    _observers.append(events.append)
    try:
        yield events
    finally:
        _observers.remove(events.append)


#: Called as ``hook(geometry, index)`` right before chunk ``index`` fills the slab; a hook may raise
#: (``inject_oom`` raises torch.cuda.OutOfMemoryError). Empty outside tests: one falsy check per chunk.
_fault_hooks: list[Callable[[Geometry, int], None]] = []


@contextmanager
def inject_oom(*, at_chunk: int = 0, above_rows: int = 0) -> Iterator[list[tuple[int, int]]]:
    """Raise ``torch.cuda.OutOfMemoryError`` at chunk ``at_chunk`` of every run whose chunks exceed ``above_rows`` rows.

    A device on which a slab of more than ``above_rows`` rows does not fit, for testing what
    calls the driver without touching torch's allocator: chunk 0 fails as the slab allocation
    would (the call's buffers are already allocated), a later chunk fails mid-accumulation.
    Yields the ``(chunk_size, chunk index)`` of every fault raised inside the block.
    """
    faults: list[tuple[int, int]] = []

    def hook(geometry: Geometry, index: int) -> None:
        if index == at_chunk and geometry.chunk_size > above_rows:
            faults.append((geometry.chunk_size, index))
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory (injected by flce_policy.kernels.driver.inject_oom at chunk {index} "
                f"of {geometry.describe()})"
            )

    _fault_hooks.append(hook)
    try:
        yield faults
    finally:
        _fault_hooks.remove(hook)


def before_chunk(geometry: Geometry, index: int) -> None:
    """Run the fault hooks (tests only) before chunk ``index`` fills its slab."""
    for fault in _fault_hooks:
        fault(geometry, index)


def notify(event: ChunkEvent) -> None:
    """Report one finished chunk iteration to the observers."""
    for observer in _observers:
        observer(event)
