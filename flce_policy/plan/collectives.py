"""What a vocab-parallel call communicates: the one rule the shard merge and the cost model share.

Per row chunk, :class:`flce_policy.kernels.vocab_shard.VocabShard` all-reduces ``[rows]`` vectors
only: a MAX of one int64 key per row (max logit and argmax packed) and a SUM of four fp32 values
per row. Once per call: an all-gather agreeing shard sizes, options and chunk size; an all-reduce
of the ``[V]`` fp32 class weights when given; in backward, an all-reduce of grad_input
(``[BT, H]`` in the input dtype) unless the caller keeps its partial share.
"""

from __future__ import annotations

from typing import NamedTuple

from flce_policy.plan.geometry import Geometry

__all__ = ["COLLECTIVES_PER_CHUNK", "BYTES_PER_ROW", "CommPlan", "comm_plan"]

#: All-reduces per row chunk: one MAX, one SUM.
COLLECTIVES_PER_CHUNK = 2
#: Bytes all-reduced per row and chunk: one int64 key and four fp32 sums.
BYTES_PER_ROW = 8 + 4 * 4


class CommPlan(NamedTuple):
    """Collectives of one fwd+bwd call on one rank, and the bytes each rank hands to them."""

    collectives: int
    bytes: int


def comm_plan(geometry: Geometry, *, grad_input: bool = True) -> CommPlan:
    """What ``geometry``'s call communicates (nothing when the problem is not tensor parallel).

    The chunk collectives run once per pass over the rows: in forward for ``mean``/``sum`` (the
    gradients are made there); counted once here. ``grad_input=False``: the partial share is kept.
    """
    p = geometry.problem
    if p.tp_size == 1:
        return CommPlan(0, 0)
    collectives = geometry.num_chunks * COLLECTIVES_PER_CHUNK + 1  # + the agreeing all-gather
    size = p.tokens * BYTES_PER_ROW
    if grad_input:
        collectives += 1
        size += p.tokens * p.hidden * p.itemsize
    return CommPlan(collectives, size)
