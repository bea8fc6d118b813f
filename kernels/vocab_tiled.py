"""The vocab-tiled driver: slabs of ``[chunk_size, vocab_chunk]``, logits computed twice.

Per row chunk: pass 1 computes each vocab tile's logits and folds them into the rows' online
log-sum-exp partials (one slot per tile and segment); pass 2 recomputes each tile, turns it into
dL/dlogits in place, adds ``G @ W_tile`` into an fp32 grad_input accumulator (held in borrowed
bytes, see flce_policy.plan.accumulator) and produces ``G.T @ x_chunk`` for that vocab slice of
grad_weight. With a single row chunk each grad_weight slice is written exactly once by a GEMM that
accumulates in fp32 internally: fp32 accuracy with no parameter-sized fp32 buffer and no
read-modify-write. Four GEMMs instead of three (plus the few late tiles computed a third time).
"""

from __future__ import annotations

import torch

from flce_policy.plan.accumulator import accumulator_layout

from .ce_kernel import ce_finish, ce_partial, ce_workspace
from .driver_call import ChunkEvent, DriverCall, DriverOutputs, _fault_hooks, _observers, before_chunk, notify
from .gemm import accumulate_mm
from .input_accumulator import InputAccumulator
from .weight_grad_filter import (
    FlaggedTiles,
    count_unfiltered,
    filter_scratch_for,
    filtered_weight_grad,
    filters,
    flag_tiles,
    rest_after_dense,
)

__all__ = ["run_vocab_tiled"]


def run_vocab_tiled(call: DriverCall, outputs: DriverOutputs) -> None:
    """Fill ``outputs`` (the driver's buffers) for a vocab-tiled ``geometry``; see the module docstring."""
    x, _, _, target, geometry, _, grads, _, grad_scale, scale_per_row, deferred_targets = call
    if deferred_targets is not None:  # every kernel here reads the safe targets
        deferred_targets.queue()
    run = _TiledRun(call, outputs)
    chunk_size, tokens = geometry.chunk_size, x.shape[0]
    for index in range(geometry.num_chunks):
        if _fault_hooks:
            before_chunk(geometry, index)
        row_start = index * chunk_size
        row_stop = min(row_start + chunk_size, tokens)
        rows = slice(row_start, row_stop)
        run.partial_pass(x[rows], target[rows])
        finish = run.finish_options(rows, scale_per_row)
        if not grads.any:
            ce_finish(run.last_tile, target[rows], outputs.loss_rows[rows], run.workspace, **finish)
        else:
            row_scale = grad_scale[rows] if scale_per_row else grad_scale
            run.grad_pass(x[rows], target[rows], rows, dict(finish, grad_scale=row_scale), first_chunk=index == 0)
        if _observers:
            slab_shape = (chunk_size, geometry.vocab_chunk)
            notify(ChunkEvent(index, row_start, row_stop - row_start, slab_shape, run.slab_bytes))
    if run.filter is not None and run.every_tile_dense:  # the flags bought nothing: the policy rests a few calls
        rest_after_dense(call)


class _TiledRun:
    """The buffers shared by every row chunk of one call, and the two passes over a chunk's tiles."""

    def __init__(self, call: DriverCall, outputs: DriverOutputs) -> None:
        x, geometry, params, class_weight = call.x, call.geometry, call.params, call.class_weight
        self.weight, self.bias, self.outputs, self.params = call.weight, call.bias, outputs, call.params
        vocab, width = geometry.problem.vocab, geometry.vocab_chunk
        # A vocab-parallel shard's tiles are columns of the global vocabulary, from its first class on.
        self.shard = params.shard
        self.col_base = 0 if self.shard is None else self.shard.start
        self.tiles = [(start, min(start + width, vocab)) for start in range(0, vocab, width)]
        self.slab = torch.empty(geometry.chunk_size * width, dtype=x.dtype, device=x.device)
        self.slab_bytes = self.slab.numel() * self.slab.element_size()
        self.workspace = ce_workspace(geometry.chunk_size, width, x.device, entropy=outputs.entropy_rows is not None)
        self.layout = accumulator_layout(
            geometry, input_grad=outputs.grad_input is not None, weight_grad=outputs.grad_weight is not None
        )
        separate_rows = self.layout.separate
        self.separate = (
            torch.empty((separate_rows, x.shape[1]), dtype=torch.float32, device=x.device) if separate_rows else None
        )
        self.first_late = len(self.tiles) - self.layout.late_tiles
        self.filter = filter_scratch_for(call, geometry.chunk_size, width)  # None: the dense GEMMs
        self.filtered = filters(call)  # with a filter even where this call rests (the observers count it unfiltered)
        self.every_tile_dense = self.filter is not None  # until a vocab tile's flags run the filtered kernel
        self.shared = dict(
            ignore_index=params.ignore_index,
            label_smoothing=params.label_smoothing,
            softcap=params.softcap,
            round_softcap=params.round_softcap,
            class_weight=class_weight,
        )
        self.last_tile: torch.Tensor | None = None

    def logits_tile(self, x_chunk: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        # A contiguous [rows, cols] view at the head of the slab, also for the narrower last tile.
        tile = self.slab[: x_chunk.shape[0] * (stop - start)].view(x_chunk.shape[0], stop - start)
        w_tile = self.weight[start:stop].t()
        if self.bias is None:
            torch.mm(x_chunk, w_tile, out=tile)
        else:
            torch.addmm(self.bias[start:stop], x_chunk, w_tile, out=tile)
        self.last_tile = tile
        return tile

    def partial_pass(self, x_chunk: torch.Tensor, target_chunk: torch.Tensor) -> None:
        """Pass 1: every tile's logits folded into the rows' log-sum-exp partials (then the group's, when sharded)."""
        track_argmax = self.outputs.argmax_rows is not None
        for tile_index, (start, stop) in enumerate(self.tiles):
            ce_partial(
                self.logits_tile(x_chunk, start, stop),
                target_chunk,
                self.workspace,
                col_offset=self.col_base + start,
                first_tile=tile_index == 0,
                track_argmax=track_argmax,
                entropy=self.outputs.entropy_rows is not None,
                **self.shared,
            )
        if self.shard is not None:
            self.shard.merge(self.workspace, target_chunk, self.params.ignore_index, track_argmax)

    def finish_options(self, rows: slice, scale_per_row: bool) -> dict:
        z_loss_rows, argmax_rows, entropy_rows = (
            self.outputs.z_loss_rows, self.outputs.argmax_rows, self.outputs.entropy_rows
        )  # fmt: skip
        return dict(
            vocab=self.weight.shape[0] if self.shard is None else self.shard.vocab,
            z_loss_scale=self.params.z_loss_scale,
            z_loss_rows=None if z_loss_rows is None else z_loss_rows[rows],
            argmax_rows=None if argmax_rows is None else argmax_rows[rows],
            entropy_rows=None if entropy_rows is None else entropy_rows[rows],
            token_scaling=self.params.token_scaling,
            scale_per_row=scale_per_row,
            filter_flags=None if self.filter is None else self.filter.flags,
            filter_eps=self.params.grad_weight_filter or 0.0,
            **self.shared,
        )

    def grad_tile(self, x_chunk, target_chunk, loss_rows, finish: dict, start: int, stop: int, *, write_loss: bool):
        """A tile's logits again, turned into dL/dlogits in place (and the rows' losses with ``write_loss``)."""
        tile = self.logits_tile(x_chunk, start, stop)
        col_offset = self.col_base + start
        ce_finish(tile, target_chunk, loss_rows, self.workspace, col_offset=col_offset, write_loss=write_loss, **finish)
        return tile

    def grad_pass(self, x_chunk, target_chunk, rows: slice, finish: dict, *, first_chunk: bool) -> None:
        """Pass 2: per tile, dL/dlogits, then the grad_input accumulator, grad_weight slice and grad_bias."""
        grad_input, grad_weight, grad_bias = self.outputs.grad_input, self.outputs.grad_weight, self.outputs.grad_bias
        loss_rows = self.outputs.loss_rows[rows]
        accumulator = (
            None
            if grad_input is None
            else InputAccumulator(grad_input[rows], self.layout, grad_weight=grad_weight, separate=self.separate)
        )
        for tile_index, (start, stop) in enumerate(self.tiles):
            tile = self.grad_tile(x_chunk, target_chunk, loss_rows, finish, start, stop, write_loss=tile_index == 0)
            # the filter's tile count, queued now: the host reads it while the GPU runs the grad_input GEMM
            flagged = (
                None
                if self.filter is None or tile_index >= self.first_late
                else flag_tiles(self.filter, *tile.shape, rescue=self.params.grad_weight_filter_rescue)
            )
            if accumulator is not None:
                accumulator.add(tile, self.weight[start:stop], first=tile_index == 0)
            if tile_index < self.first_late:
                self.weight_grad(tile, x_chunk, start, stop, first=first_chunk, flagged=flagged)
            if grad_bias is not None and self.filter is None:
                grad_bias[start:stop] += tile.sum(dim=0, dtype=torch.float32)
        if accumulator is not None:
            accumulator.finish()
        if self.layout.late_tiles:
            # The borrowed grad_weight rows are free now: the last tile is still in the slab, the
            # other late tiles are computed again. (Late tiles exist only with one row chunk.)
            # Their flags are still those of the tile in the slab: the last one, or the one just recomputed.
            start, stop = self.tiles[-1]
            self.weight_grad(tile, x_chunk, start, stop, first=True)
            for start, stop in self.tiles[self.first_late : -1]:
                tile = self.grad_tile(x_chunk, target_chunk, loss_rows, finish, start, stop, write_loss=False)
                self.weight_grad(tile, x_chunk, start, stop, first=True)

    def weight_grad(
        self,
        tile: torch.Tensor,
        x_chunk: torch.Tensor,
        start: int,
        stop: int,
        *,
        first: bool,
        flagged: FlaggedTiles | None = None,
    ) -> None:
        """A tile's share of grad_weight (cuBLAS); with the filter, of grad_weight and grad_bias (its kernel)."""
        grad_weight, grad_bias = self.outputs.grad_weight, self.outputs.grad_bias
        if self.filter is not None:
            went_dense = filtered_weight_grad(
                None if grad_weight is None else grad_weight[start:stop],
                tile,
                x_chunk,
                self.filter,
                first=first,
                grad_bias=None if grad_bias is None else grad_bias[start:stop],
                rescue=self.params.grad_weight_filter_rescue,
                flagged=flagged,
            )
            self.every_tile_dense = self.every_tile_dense and went_dense
            return
        if grad_weight is not None:
            accumulate_mm(grad_weight[start:stop], tile.t(), x_chunk, first=first)
        if self.filtered:
            count_unfiltered(*tile.shape, tile.device)
