"""The chunk driver: runs one validated Geometry over the BT rows, exactly as given.

Per chunk: logits = x_c @ W.T (+ b) into the reused slab; the CE kernel turns the slab into
dL/dlogits in place; then grad_input_c = G @ W, grad_weight += G.T @ x_c, grad_bias += sum(G).
The driver decides nothing about the geometry: it is handed one and runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from flce_policy.plan.geometry import Geometry

from .ce_kernel import ce_rows, ce_workspace
from .gemm import accumulate_mm
from .vocab_tiled import run_vocab_tiled

if TYPE_CHECKING:
    from .vocab_shard import VocabShard

__all__ = [
    "CEParams",
    "GradRequest",
    "DriverOutputs",
    "DriverCall",
    "ChunkEvent",
    "run_geometry",
    "observe_chunks",
    "inject_oom",
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


def run_geometry(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    geometry: Geometry,
    params: CEParams,
    grads: GradRequest,
    *,
    class_weight: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    scale_per_row: bool = False,
) -> DriverOutputs:
    """Walk ``x [BT, H]`` in ``geometry.num_chunks`` chunks of ``geometry.chunk_size`` rows.

    Row-only geometry runs here; vocab-tiled geometry (``vocab_chunk < V``) in
    :mod:`flce_policy.kernels.vocab_tiled`. ``grad_scale`` multiplies dL/dlogits (``[scale_ce,
    scale_z]``, or per row with ``scale_per_row``); it is required when ``grads.any``. The
    returned gradients are of the scaled loss. No host synchronisation happens here.
    """
    geometry.check_tensors(x, weight)
    tokens, vocab = x.shape[0], weight.shape[0]
    device, f32 = x.device, torch.float32
    weight_dtype = grads.weight_dtype or weight.dtype
    accum_dtype = getattr(torch, geometry.accumulator_dtype(grads.accum_dtype, grads.weight_dtype))
    outputs = DriverOutputs(
        loss_rows=torch.empty(tokens, dtype=f32, device=device),
        z_loss_rows=torch.empty(tokens, dtype=f32, device=device) if params.z_loss_scale else None,
        argmax_rows=torch.empty(tokens, dtype=torch.int64, device=device) if params.track_argmax else None,
        grad_input=torch.empty_like(x) if grads.input else None,
        grad_weight=torch.empty(weight.shape, dtype=accum_dtype, device=device) if grads.weight else None,
        grad_bias=torch.zeros(vocab, dtype=f32, device=device) if grads.bias else None,
        entropy_rows=torch.empty(tokens, dtype=f32, device=device) if params.entropy else None,
    )
    call = DriverCall(x, weight, bias, target, geometry, params, grads, class_weight, grad_scale, scale_per_row)
    (_run_rows if geometry.is_row_only else run_vocab_tiled)(call, outputs)
    # run() has returned, so its slab is freed before a cast allocates a second grad_weight.
    grad_weight, grad_bias = outputs.grad_weight, outputs.grad_bias
    if grad_weight is not None and grad_weight.dtype != weight_dtype:
        grad_weight = grad_weight.to(weight_dtype)
    if grad_bias is not None and bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return outputs._replace(grad_weight=grad_weight, grad_bias=grad_bias)


def _run_rows(call: DriverCall, outputs: DriverOutputs) -> None:
    """The row-only loop: one [chunk_size, V] slab, three GEMMs per chunk."""
    x, weight, bias, target, geometry, params, grads, class_weight, grad_scale, scale_per_row = call
    loss_rows, z_loss_rows, argmax_rows, grad_input, grad_weight, grad_bias, entropy_rows = outputs
    tokens, chunk_size = x.shape[0], geometry.chunk_size
    slab = torch.empty((chunk_size, geometry.vocab_chunk), dtype=x.dtype, device=x.device)
    workspace = ce_workspace(chunk_size, geometry.vocab_chunk, x.device, entropy=entropy_rows is not None)
    weight_t = weight.t()
    for index in range(geometry.num_chunks):
        if _fault_hooks:
            before_chunk(geometry, index)
        start = index * chunk_size
        stop = min(start + chunk_size, tokens)
        x_chunk, logits = x[start:stop], slab[: stop - start]
        if bias is None:
            torch.mm(x_chunk, weight_t, out=logits)
        else:
            torch.addmm(bias, x_chunk, weight_t, out=logits)
        ce_rows(
            logits,
            target[start:stop],
            loss_rows[start:stop],
            workspace,
            ignore_index=params.ignore_index,
            label_smoothing=params.label_smoothing,
            softcap=params.softcap,
            round_softcap=params.round_softcap,
            z_loss_scale=params.z_loss_scale,
            class_weight=class_weight,
            z_loss_rows=None if z_loss_rows is None else z_loss_rows[start:stop],
            argmax_rows=None if argmax_rows is None else argmax_rows[start:stop],
            token_scaling=params.token_scaling,
            grad_scale=None if not grads.any else grad_scale[start:stop] if scale_per_row else grad_scale,
            scale_per_row=scale_per_row,
            shard=params.shard,
            entropy_rows=None if entropy_rows is None else entropy_rows[start:stop],
        )
        if grad_input is not None:
            torch.mm(logits, weight, out=grad_input[start:stop])
        if grad_weight is not None:
            # The first chunk overwrites (beta=0): no zero-fill of a parameter-sized buffer.
            accumulate_mm(grad_weight, logits.t(), x_chunk, first=index == 0)
        if grad_bias is not None:
            grad_bias += logits.sum(dim=0, dtype=torch.float32)
        if _observers:
            notify(ChunkEvent(index, start, stop - start, tuple(slab.shape), slab.numel() * slab.element_size()))
