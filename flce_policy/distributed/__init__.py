"""Parameters split across processes: what the loss does with them.

``route`` (which plan a call gets: a vocab-parallel head's, or a whole head's), ``sharded`` (recognising
a DTensor or a ZeRO-3 partition, refusing one with the fix, gathering a ZeRO-3 head) and
``vocab_parallel`` (a head split along the vocabulary over a tensor-parallel group: its shards checked
and agreed over the group, the driver's row chunks merged across the ranks).
The collectives' cost lives with the cost model (:mod:`flce_policy.plan.collectives`).

May import: :mod:`flce_policy.plan`, :mod:`flce_policy.call` and :mod:`flce_policy.kernels`; never the
front door, ``integrations`` or ``cli``.
"""
