"""Which plan a loss call gets, by where its head lives: split over a tensor-parallel group, or whole here.

A vocab-parallel head (``tp_group``, or a ``Shard(0)`` DTensor weight with a DTensor input) is planned
by :mod:`flce_policy.distributed.vocab_parallel`, over its group. Any other call needs the whole head on
this rank: a shard handed over where the whole tensor was meant (an FSDP2 DTensor, a ZeRO-3 partition) is
refused with the fix (:mod:`flce_policy.distributed.sharded`), and the rest is planned by
:func:`flce_policy.call.plan.local_plan`.
"""

from __future__ import annotations

from flce_policy.call.plan import CallPlan, LossCall, local_plan
from flce_policy.distributed.sharded import check_unsharded
from flce_policy.distributed.vocab_parallel import is_vocab_parallel, vocab_parallel_plan

__all__ = ["call_plan"]


def call_plan(call: LossCall) -> CallPlan:
    """The plan of ``call``: its tensors checked, its device's policy resolved to a geometry, its shard agreed."""
    if is_vocab_parallel(call.input, call.weight, call.tp_group):
        return vocab_parallel_plan(call)
    check_unsharded(input=call.input, weight=call.weight, bias=call.bias)  # a clear error, not torch's
    if call.tp_grad_input != "full":
        raise ValueError("tp_grad_input applies to a vocab-parallel head only (tp_group or a DTensor weight)")
    return local_plan(call)
