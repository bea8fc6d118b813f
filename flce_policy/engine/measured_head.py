"""A ``measured`` strategy's state for one LM head (H, V, dtype) on one device: per kind of call, per BT bucket.

Each bucket (:func:`flce_policy.plan.measuring.bucket_problem`) of a kind has a pick, or a search under way in this
process, or nothing yet. The first call of a bucket takes a pick from the strategy's ``picks`` or the disk cache
(:mod:`flce_policy.engine.pick_cache`), else starts a :class:`~flce_policy.plan.measuring.Search` over the
candidates sized at the bucket's top BT; its calls, whatever their BT, run the next candidate
(:class:`BucketSearch`). Under a process group (and ``broadcast``) rank 0 alone searches and the ranks agree on
the picks at exchanges (:mod:`flce_policy.engine.measured_group`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from flce_policy.engine import pick_cache
from flce_policy.engine.clock import Clock, Lap
from flce_policy.engine.measured_group import STALE_EXCHANGES, GroupSync, Message, broadcast_group, rank
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.measuring import BucketPick, Search, candidates, measured_forms, predicted_fastest_form
from flce_policy.plan.oom import OOMFallback
from flce_policy.plan.problem import Problem
from flce_policy.strategies import ChunkStrategy

__all__ = ["BucketSearch", "MeasuredHead", "Step"]


class BucketSearch:
    """This process's measuring of one bucket and kind: the search, its laps not yet read, the cache key."""

    def __init__(self, search: Search, key: pick_cache.PickKey | None, limit: Geometry) -> None:
        self.search = search
        self.key = key
        self.limit = limit  # the bucket's limit, at its top BT
        self.pending: list[tuple[Geometry, Lap, float]] = []  # candidate, lap, its scale to the top's BT
        self.fell_back: Geometry | None = None  # the rows an OOM fallback completed at, the fewest known to fit
        self.idle = 0  # exchanges since rank 0 last ran it (under a process group)

    def oom(self, completed: Geometry) -> None:
        """The OOM fallback's remember: the candidate ran out of memory and the call completed at ``completed``."""
        self.fell_back = completed
        self.search.drop_from(completed.chunk_size + 1)

    def next(self) -> Step | BucketPick:
        """The next candidate to run, or the pick once every candidate is done."""
        for candidate, lap, scale in self.pending:  # a timed call's lap, read at the next call: its events are done
            self.search.record(candidate, lap.seconds() * scale)
        self.pending.clear()
        step = self.search.next()
        if step is not None:
            return Step(self, *step)
        if self.search.times:
            return BucketPick.of(self.search.pick())
        # every candidate ran out of memory: the rows the OOM fallback completed at, else the limit's
        fewest = self.fell_back or self.search.geometries[-1]
        return BucketPick(fewest.chunk_size, fewest.vocab_chunk, fewest.slab_form)


class Step(NamedTuple):
    """A call that runs a candidate: whose search (None on a rank following rank 0), and whether it is timed."""

    search: BucketSearch | None
    candidate: Geometry
    timed: bool


class _KindState:
    """One kind's buckets: their picks (by top BT), this process's searches, the ranks' exchanges."""

    def __init__(self, sync: GroupSync | None) -> None:
        self.picks: dict[int, BucketPick] = {}
        self.searches: dict[int, BucketSearch] = {}
        self.sync = sync
        self.to_publish: dict[int, BucketPick] = {}  # rank 0: cached picks of other ranks' buckets


class MeasuredHead:
    """A ``measured`` strategy's picks and searches for one head on one device, per kind and BT bucket."""

    def __init__(
        self,
        strategy: ChunkStrategy,
        device: DeviceInfo,
        *,
        rule: str,
        slab_form: str | None,
        fallback: OOMFallback | None,
        clock: Clock,
    ) -> None:
        self.strategy, self.device, self.rule, self.pin = strategy, device, rule, slab_form
        self.fallback = fallback  # the policy's settings (min_chunk_size), or None: an OOM propagates
        self.clock = clock
        self.kinds: dict[str, _KindState] = {}
        self._limits: dict[int, Geometry] = {}  # bucket top BT -> the limit there

    def kind(self, kind: str) -> _KindState:
        state = self.kinds.get(kind)
        if state is None:
            group = broadcast_group() if self.strategy.broadcast else None  # type: ignore[attr-defined]
            state = self.kinds[kind] = _KindState(None if group is None else GroupSync(group, rank()))
        return state

    # --- one process ---------------------------------------------------------------------------

    def local_call(self, bucket: Problem, kind: str) -> Step | BucketPick:
        """What a call of ``bucket`` runs in a process that decides alone."""
        state = self.kind(kind)
        pick = state.picks.get(bucket.tokens)
        if pick is not None:
            return pick
        decision = self._decide(bucket, kind, state)
        if type(decision) is BucketPick:
            state.picks[bucket.tokens] = decision
        return decision

    def _decide(self, bucket: Problem, kind: str, state: _KindState) -> Step | BucketPick:
        search = state.searches.get(bucket.tokens)
        if search is None:
            known = self.known(bucket, kind)
            if known is not None:
                return known
            search = state.searches[bucket.tokens] = self._search(bucket, kind)
        decision = search.next()
        if type(decision) is BucketPick:
            del state.searches[bucket.tokens]
            if search.key is not None:
                pick_cache.store(search.key, decision, search.search.times)
        return decision

    def _search(self, bucket: Problem, kind: str) -> BucketSearch:
        strategy: Any = self.strategy
        limit, rates = self.limit(bucket), strategy.planned_rates(self.device)
        forms = measured_forms(
            limit, self.device, rates,
            slab_forms=[self.pin] if self.pin is not None else strategy.slab_forms, form_margin=strategy.form_margin,
        )  # fmt: skip
        search = Search(
            candidates(limit, forms, rows=strategy.rows),
            warmup_calls=strategy.warmup_calls,
            timed_calls=strategy.timed_calls,
            tolerance=strategy.tolerance,
            incumbent_form=predicted_fastest_form(limit, forms, rates),
        )
        return BucketSearch(search, self._key(bucket, kind), limit)

    def limit(self, bucket: Problem) -> Geometry:
        """The strategy's limit at the bucket's top BT (free memory read once per bucket)."""
        limit = self._limits.get(bucket.tokens)
        if limit is None:
            limit = self._limits[bucket.tokens] = self.strategy.limit(bucket, self.device, rule=self.rule)  # type: ignore[attr-defined]
        return limit

    def _key(self, bucket: Problem, kind: str) -> pick_cache.PickKey | None:
        if not self.strategy.cache:  # type: ignore[attr-defined]
            return None
        return pick_cache.pick_key(self.device, bucket, kind, self.strategy.params_key())

    def known(self, bucket: Problem, kind: str) -> BucketPick | None:
        """A pick of ``bucket`` that needs no measuring: the strategy's ``picks``, else the disk cache's (either
        dropped where its form cannot run the head)."""
        seeded = self.strategy.seeded_pick(bucket)  # type: ignore[attr-defined]
        if seeded is not None and _runs(seeded, self.limit(bucket)):
            return seeded
        key = self._key(bucket, kind)
        cached = None if key is None else pick_cache.load(key)
        if cached is None or not _runs(cached.pick(), self.limit(bucket)):
            return None
        return cached.pick()

    def lower(self, bucket: Problem, kind: str, rows: int) -> None:
        """An OOM after the pick completed at ``rows``: the bucket's calls seen from now on run no more."""
        state = self.kind(kind)
        pick = state.picks.get(bucket.tokens)
        if pick is not None and rows < pick.rows:
            state.picks[bucket.tokens] = pick._replace(rows=rows, source=f"{pick.source}; then an OOM fallback")

    # --- under a process group -----------------------------------------------------------------

    def group_call(self, bucket: Problem, kind: str) -> Step | BucketPick | None:
        """What a call of ``bucket`` runs under a process group: a pick, a candidate, or None (the limit)."""
        state = self.kind(kind)
        sync: GroupSync = state.sync  # type: ignore[assignment]
        if not sync.due():
            return state.picks.get(bucket.tokens)
        step, message = self._rank0_message(bucket, kind, state) if sync.rank == 0 else (None, None)
        gathered = sync.exchange(bucket.tokens, message)
        bucket0, message0 = gathered[0]
        for tokens, pick in message0.settled:  # type: ignore[union-attr]
            state.picks.setdefault(tokens, pick)
        if sync.rank == 0:
            self._cached_for_others(bucket, kind, state, [tokens for tokens, _ in gathered[1:]])
        pick = state.picks.get(bucket.tokens)
        if pick is not None:
            return pick
        if step is not None:
            return step
        candidate = message0.candidate  # type: ignore[union-attr]
        if candidate is not None and bucket0 == bucket.tokens:  # rank 0's candidate, at this rank's BT
            geometry = Geometry.for_problem(
                bucket, candidate.rows, vocab_chunk=candidate.vocab_chunk, slab_form=candidate.slab_form, rule=self.rule
            )
            return Step(None, geometry, False)
        return None

    def _rank0_message(self, bucket: Problem, kind: str, state: _KindState) -> tuple[Step | None, Message]:
        settled = dict(state.to_publish)
        state.to_publish.clear()
        step = None
        if bucket.tokens not in state.picks:
            decision = self._decide(bucket, kind, state)
            if type(decision) is BucketPick:
                settled[bucket.tokens] = decision
            else:
                step = decision
        for tokens in list(state.searches):
            search = state.searches[tokens]
            search.idle = 0 if step is not None and tokens == bucket.tokens else search.idle + 1
            if search.idle > STALE_EXCHANGES:
                del state.searches[tokens]
        candidate = None if step is None else BucketPick.of(step.candidate, "measured on rank 0")  # type: ignore[union-attr]
        return step, Message(candidate, bool(state.searches), tuple(settled.items()))  # type: ignore[return-value]

    def _cached_for_others(self, bucket: Problem, kind: str, state: _KindState, others: list[int]) -> None:
        """Rank 0: the other ranks' buckets that its cache or ``picks`` holds, published at the next exchange."""
        for tokens in set(others):
            if tokens in state.picks or tokens in state.searches or tokens in state.to_publish:
                continue
            known = self.known(bucket.model_copy(update={"tokens": tokens}), kind)
            if known is not None:
                state.to_publish[tokens] = known


def _runs(pick: BucketPick, limit: Geometry) -> bool:
    """Whether ``pick`` makes a geometry of ``limit``'s problem (a form the dtype cannot run does not)."""
    try:
        pick.for_call(limit)
    except ValueError:
        return False
    return True
