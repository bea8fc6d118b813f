"""The vocab-tiled driver: slabs of ``[chunk_size, vocab_chunk]``, logits computed twice.

Per row chunk: pass 1 computes each vocab tile's logits and folds them into the rows' online
log-sum-exp partials (one slot per tile and segment); pass 2 recomputes each tile, turns it into
dL/dlogits in place, adds ``G @ W_tile`` into an fp32 grad_input accumulator (held in borrowed
bytes, see flce_policy.accumulator) and produces ``G.T @ x_chunk`` for that vocab slice of
grad_weight. With a single row chunk each grad_weight slice is written exactly once by a GEMM that
accumulates in fp32 internally: fp32 accuracy with no parameter-sized fp32 buffer and no
read-modify-write. Four GEMMs instead of three (plus the few late tiles computed a third time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flce_policy.accumulator import accumulator_layout
from flce_policy.geometry import Geometry

from .ce_kernel import ce_finish, ce_partial, ce_workspace
from .gemm import accumulate_mm
from .input_accumulator import InputAccumulator

if TYPE_CHECKING:
    from .driver import CEParams, DriverOutputs, GradRequest

__all__ = ["run_vocab_tiled"]


def _tiles(geometry: Geometry) -> list[tuple[int, int]]:
    vocab, width = geometry.problem.vocab, geometry.vocab_chunk
    return [(start, min(start + width, vocab)) for start in range(0, vocab, width)]


def run_vocab_tiled(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    geometry: Geometry,
    params: CEParams,
    grads: GradRequest,
    outputs: DriverOutputs,
    *,
    class_weight: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    scale_per_row: bool,
) -> None:
    """Fill ``outputs`` (the driver's buffers) for a vocab-tiled ``geometry``; see the module docstring."""
    from .driver import ChunkEvent, _fault_hooks, _observers, before_chunk, notify

    loss_rows, z_loss_rows, correct_rows, grad_input, grad_weight, grad_bias = outputs
    tokens, vocab = x.shape[0], weight.shape[0]
    chunk_size, tiles = geometry.chunk_size, _tiles(geometry)
    slab = torch.empty(chunk_size * geometry.vocab_chunk, dtype=x.dtype, device=x.device)
    workspace = ce_workspace(chunk_size, geometry.vocab_chunk, x.device, num_tiles=len(tiles))
    layout = accumulator_layout(geometry, input_grad=grad_input is not None, weight_grad=grad_weight is not None)
    separate = (
        torch.empty((layout.separate, x.shape[1]), dtype=torch.float32, device=x.device) if layout.separate else None
    )
    first_late = len(tiles) - layout.late_tiles
    shared = dict(
        ignore_index=params.ignore_index,
        label_smoothing=params.label_smoothing,
        softcap=params.softcap,
        class_weight=class_weight,
    )

    def logits_tile(x_chunk: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        # A contiguous [rows, cols] view at the head of the slab, also for the narrower last tile.
        tile = slab[: x_chunk.shape[0] * (stop - start)].view(x_chunk.shape[0], stop - start)
        w_tile = weight[start:stop].t()
        if bias is None:
            torch.mm(x_chunk, w_tile, out=tile)
        else:
            torch.addmm(bias[start:stop], x_chunk, w_tile, out=tile)
        return tile

    for index in range(geometry.num_chunks):
        if _fault_hooks:
            before_chunk(geometry, index)
        row_start = index * chunk_size
        row_stop = min(row_start + chunk_size, tokens)
        rows = slice(row_start, row_stop)
        x_chunk, target_chunk = x[rows], target[rows]
        for tile_index, (start, stop) in enumerate(tiles):
            tile = logits_tile(x_chunk, start, stop)
            ce_partial(
                tile,
                target_chunk,
                workspace,
                col_offset=start,
                tile_index=tile_index,
                track_argmax=correct_rows is not None,
                **shared,
            )
        finish = dict(
            vocab=vocab,
            z_loss_scale=params.z_loss_scale,
            z_loss_rows=None if z_loss_rows is None else z_loss_rows[rows],
            correct_rows=None if correct_rows is None else correct_rows[rows],
            scale_per_row=scale_per_row,
            **shared,
        )
        if not grads.any:
            ce_finish(tile, target_chunk, loss_rows[rows], workspace, **finish)
        else:
            row_scale = grad_scale[rows] if scale_per_row else grad_scale
            accumulator = (
                None
                if grad_input is None
                else InputAccumulator(grad_input[rows], layout, grad_weight=grad_weight, separate=separate)
            )

            def grad_tile(start: int, stop: int, *, write_loss: bool) -> torch.Tensor:
                tile = logits_tile(x_chunk, start, stop)
                ce_finish(
                    tile,
                    target_chunk,
                    loss_rows[rows],
                    workspace,
                    col_offset=start,
                    write_loss=write_loss,
                    grad_scale=row_scale,
                    **finish,
                )
                return tile

            def weight_slice(tile: torch.Tensor, start: int, stop: int) -> None:
                accumulate_mm(grad_weight[start:stop], tile.t(), x_chunk, first=index == 0)

            for tile_index, (start, stop) in enumerate(tiles):
                tile = grad_tile(start, stop, write_loss=tile_index == 0)
                if accumulator is not None:
                    accumulator.add(tile, weight[start:stop], first=tile_index == 0)
                if grad_weight is not None and tile_index < first_late:
                    weight_slice(tile, start, stop)
                if grad_bias is not None:
                    grad_bias[start:stop] += tile.sum(dim=0, dtype=torch.float32)
            if accumulator is not None:
                accumulator.finish()
            if layout.late_tiles:
                # The borrowed grad_weight rows are free now: the last tile is still in the slab,
                # the other late tiles are computed again.
                weight_slice(tile, *tiles[-1])
                for start, stop in tiles[first_late:-1]:
                    weight_slice(grad_tile(start, stop, write_loss=False), start, stop)
        if _observers:
            slab_shape = (chunk_size, geometry.vocab_chunk)
            notify(ChunkEvent(index, row_start, row_stop - row_start, slab_shape, slab.numel() * slab.element_size()))
