"""A vocab shard of a tensor-parallel group: merging a row chunk's CE partials across the ranks.

Each rank holds the logits of its contiguous slice of the vocabulary (columns ``start ... stop`` of
``vocab``) and runs the CE partial pass on it, with global column offsets, so its workspace holds
per-row online log-sum-exp partials over its own columns: a remote rank's shard is one more vocab
tile. :meth:`VocabShard.merge` folds the slots of each row into one, all-reduces that row state
over the group, and writes the global state back into slot 0 (the other slots neutral), so the
finish pass then computes exactly what it computes for the whole vocabulary.

Two collectives per row chunk, both on ``[rows]`` vectors, never on logits:

1. MAX of one int64 key per row, packing the row's max logit (order-preserving) with its lowest
   argmax class id: the global max ``M`` and the global argmax (ties to the lowest class id, as
   ``torch.argmax``) in one reduction;
2. SUM of ``[4, rows]`` fp32: ``d * exp(m - M)`` (so ``lse = M + log(sum)``), the target logit
   (the rank holding the target contributes it, the others 0), and the label-smoothing sums
   ``sum_c w_c z_c`` and ``sum_c w_c``.

The cost model counts these from :mod:`flce_policy.plan.collectives` (keep the two in step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .row_partials import CEWorkspace

__all__ = ["VocabShard"]

_LOW32 = (1 << 32) - 1


@dataclass(frozen=True, eq=False)
class VocabShard:
    """This rank's columns ``[start, stop)`` of a ``vocab``-class head split over ``group``."""

    group: Any  # torch.distributed ProcessGroup
    start: int
    stop: int
    vocab: int

    def merge(self, workspace: CEWorkspace, target: torch.Tensor, ignore_index: int, track_argmax: bool) -> None:
        """Replace the partials of ``target``'s rows by the group's merged partials (see the module docstring)."""
        rows, live = target.shape[0], workspace.segments_per_tile  # slots past `live` are padding, never written
        partials, best_index = workspace.partials[:, :rows, :live], workspace.best_index[:rows, :live]
        m_s, d_s = partials[0], partials[1]
        m = m_s.amax(dim=1)
        d = (d_s * torch.exp(m_s - _finite(m)[:, None])).sum(dim=1)
        if track_argmax:
            # the lowest column among the slots holding the row's max (slots of ignored rows may be stale)
            best_s = partials[4]
            idx = torch.where(best_s == best_s.amax(dim=1, keepdim=True), best_index.long(), self.vocab).amin(dim=1)
        else:
            idx = torch.zeros_like(target)
        key = (_order_key(m) << 32) | (_LOW32 - idx)  # larger m first, then the lower class id
        dist.all_reduce(key, op=dist.ReduceOp.MAX, group=self.group)
        m_all = _from_order_key(key >> 32)
        argmax = _LOW32 - (key & _LOW32)

        own = (target >= self.start) & (target < self.stop) & (target != ignore_index)
        sums = torch.stack(
            [
                d * torch.exp(m - _finite(m_all)),
                torch.where(own, partials[5, :, 0], 0.0),
                partials[2].sum(dim=1),
                partials[3].sum(dim=1),
            ]
        )
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)

        neutral = (-float("inf"), 0.0, 0.0, 0.0, -float("inf"))
        for plane, value in enumerate(neutral):
            partials[plane, :, 1:] = value
        for plane, value in enumerate((m_all, sums[0], sums[2], sums[3], m_all, sums[1])):
            partials[plane, :, 0] = value
        best_index[:, 0] = argmax.to(best_index.dtype)


def _finite(m: torch.Tensor) -> torch.Tensor:
    # A row with no column here (or a stale ignored row) has m = -inf: exp(-inf - -inf) would be nan.
    return torch.where(torch.isfinite(m), m, 0.0)


def _order_key(value: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as the fp32 ``value``s: a negative float's magnitude bits are flipped."""
    bits = value.to(torch.float32).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)


def _from_order_key(key: torch.Tensor) -> torch.Tensor:
    bits = key.to(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).view(torch.float32)
