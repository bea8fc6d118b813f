"""The row driver's grad_weight work on a second CUDA stream, beside the grad_input GEMM
(``Geometry.overlap_weight_grad``).

Per chunk the CE kernel turns the slab into G; then ``grad_input = G @ W`` (compute-bound: few output tiles at a
small chunk) and ``grad_weight (+)= G.T @ x_c`` (memory-bound after the first chunk: a read-modify-write of the
whole ``[V, H]`` gradient) only read G, so they may run at once:

- :meth:`WeightGradStream.fork`, once G is queued: the side stream waits for everything queued on the main stream
  so far (G, x_c, grad_weight's and grad_bias's allocation and zero-fill; the first chunk's beta=0 GEMM then writes
  a grad_weight no earlier kernel still uses);
- the grad_input GEMM is queued on the main stream, then the grad_weight work inside
  :meth:`WeightGradStream.beside` on the side stream;
- leaving ``beside`` (also on an error: the OOM fallback frees these buffers and retries) the main stream waits for
  the side stream, so the next chunk's logits GEMM, which overwrites the slab, and everything after the loop (the
  accumulator's cast, the caller) see a finished grad_weight.

The buffers the side stream uses were allocated on the main stream; the caching allocator may hand a freed block to
a later main-stream allocation at once, which is safe because the main stream has joined the side stream before the
driver returns (no ``record_stream`` needed). A scratch tensor the side stream allocates (grad_bias's column sums) is
its own. ``wait_stream`` records and waits on events only: no host sync, and the fork/join that CUDA graph capture
needs (the side stream joins the capture and rejoins it before it ends). On CPU there are no streams: the same calls
run in order, the results are identical.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from flce_policy.plan.geometry import OVERLAP_NO_FILTER, Geometry

__all__ = ["WeightGradStream", "weight_grad_stream"]


class WeightGradStream:
    """Where one call's grad_weight work runs: ``side`` beside ``main``, or (``side`` None) in order on the current
    stream."""

    def __init__(self, main: torch.cuda.Stream | None, side: torch.cuda.Stream | None) -> None:
        self.main = main
        self.side = side

    def fork(self) -> None:
        """The side stream waits for the work queued on the main stream so far (the chunk's G)."""
        if self.side is not None:
            self.side.wait_stream(self.main)

    @contextlib.contextmanager
    def beside(self) -> Iterator[None]:
        """Queue the block's work on the side stream; on leaving, the main stream waits for it."""
        if self.side is None:
            yield
            return
        try:
            with torch.cuda.stream(self.side):
                yield
        finally:
            self.main.wait_stream(self.side)


def weight_grad_stream(geometry: Geometry, device: torch.device, filtered: bool) -> WeightGradStream:
    """The row driver's :class:`WeightGradStream` for ``geometry`` on ``device``: a side stream where the geometry
    asks for it and the tensors are on CUDA. ``filtered``: the call filters grad_weight (a ValueError with the
    overlap, which :meth:`flce_policy.call.options.LossOptions.following` refuses before a loss call gets here)."""
    if not geometry.overlap_weight_grad:
        return WeightGradStream(None, None)
    if filtered:
        raise ValueError(
            f"overlap_weight_grad=True with a grad_weight filter ({geometry.describe()}): {OVERLAP_NO_FILTER}"
        )
    if device.type != "cuda":
        return WeightGradStream(None, None)
    return WeightGradStream(torch.cuda.current_stream(device), _side_stream(device.index))


@functools.cache
def _side_stream(device_index: int | None) -> torch.cuda.Stream:
    """One side stream per device, created at its first use (a warm-up call before any CUDA graph capture)."""
    return torch.cuda.Stream(device=device_index)
