"""How the ranks of a process group agree on a ``measured`` strategy's picks without a collective that cannot pair.

Ranks see different BT (dynamic padding), so different buckets, and one rank may know a bucket's pick while
another does not: a rank cannot tell from its own call whether the others make a collective. So no rank decides
that from its bucket. Per (head, kind of call) every rank counts its calls, and the calls that exchange (one
``all_gather_object`` of each rank's bucket and rank 0's message, on every rank) follow from that count and from
what was exchanged alone, the same on every rank:

- the first call exchanges; the next exchange is 1 call later while rank 0 has a search under way, else the gap
  doubles up to :data:`MAX_GAP` calls (an idle policy pays one small collective per that many calls);
- rank 0 alone times and decides: its message is the candidate its call runs (a rank in the same bucket runs it
  at its own BT, untimed), whether it still searches, and the picks settled (its own, measured or from its cache
  or ``picks``; and those its cache holds for the other ranks' buckets, learnt at the exchange before);
- a rank whose bucket has no settled pick runs its limit; a rank 0 search that has not run for
  :data:`STALE_EXCHANGES` exchanges (rank 0 left its bucket) is dropped, to start again when rank 0 is back.

So the ranks must call the loss as many times per head and kind, in the same order (as the same model code does;
DDP and FSDP need as much); their BT and buckets may differ. A rank's out-of-memory fallback changes only its own
geometry, never the count.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from flce_policy.plan.measuring import BucketPick

__all__ = ["GroupSync", "Message", "MAX_GAP", "STALE_EXCHANGES", "broadcast_group", "rank"]

#: The most calls between two exchanges once nothing is measured: a bucket new to rank 0 waits at most this long.
MAX_GAP = 64
#: Exchanges a rank 0 search may go without running before it is dropped (keeping the calls from exchanging
#: every call for a bucket rank 0 no longer sees).
STALE_EXCHANGES = 32


class Message(NamedTuple):
    """Rank 0's part of an exchange: what its call runs, whether it still searches, the picks settled."""

    candidate: BucketPick | None
    searching: bool
    settled: tuple[tuple[int, BucketPick], ...]


class GroupSync:
    """One kind's exchanges: which calls make one, and the exchange itself (the same on every rank)."""

    def __init__(self, group: Any, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.calls = 0
        self.next_exchange = 0
        self.gap = 1

    def due(self) -> bool:
        """Count a call; True when it exchanges."""
        call = self.calls
        self.calls += 1
        return call == self.next_exchange

    def exchange(self, bucket_tokens: int, message: Message | None) -> list[tuple[int, Message | None]]:
        """Every rank's bucket (its top BT), each with its message (rank 0's alone is not None); schedules the next
        exchange from rank 0's."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (bucket_tokens, message), group=self.group)
        searching = gathered[0][1].searching
        self.gap = 1 if searching else min(2 * self.gap, MAX_GAP)
        self.next_exchange = self.calls - 1 + self.gap
        return gathered


def broadcast_group() -> Any:
    """torch.distributed's default group when one is up with more than one rank, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.group.WORLD


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()
