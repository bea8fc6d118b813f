"""A ``measured`` strategy's answer for one problem: its bucket's pick at its BT, or the candidate a call times.

The policy holds one :class:`MeasuredEntry` per (problem, device) where its strategy measures
(:attr:`~flce_policy.strategies.ChunkStrategy.measures`) and a clock can time the calls; the entries of one head
share a :class:`~flce_policy.engine.measured_head.MeasuredHead`, which keeps the picks and searches per BT bucket.
Each loss call asks :meth:`MeasuredEntry.for_call` with its kind (the options that change the kernels,
:func:`call_kind`'s string):

- once the kind's bucket has its pick, the answer is one dict lookup (under a process group, and a call count);
- before that the call runs the next candidate at its own BT and hands back a :class:`Trial`, which the call layer
  starts and stops around its work. A timed call's lap is read at the next call of the bucket (its CUDA events
  are done by then), so no call waits for the GPU to time itself, and scaled to the bucket's top BT.

A candidate that runs out of memory completes at fewer rows through the OOM fallback (the call's result is that
of a clean run at those rows) and is dropped with every candidate of as many rows.
"""

from __future__ import annotations

import functools
from typing import Any

from flce_policy.engine.clock import Clock, Lap
from flce_policy.engine.measured_head import BucketSearch, MeasuredHead, Step
from flce_policy.engine.planned import planned_geometry
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.measuring import BucketPick, bucket_problem
from flce_policy.plan.oom import OOMFallback
from flce_policy.plan.problem import Problem
from flce_policy.strategies import FreeMemory

__all__ = ["MeasuredEntry", "Trial", "PLAIN_KIND"]

#: The kind of a plain training call (mean or sum, gradients of input and weight, no extra option).
PLAIN_KIND = ""


class Trial:
    """One measuring call: the candidate it runs and whether its time counts; the call layer starts and stops it."""

    __slots__ = ("search", "candidate", "geometry", "timed", "clock", "scale")

    def __init__(
        self, search: BucketSearch, candidate: Geometry, geometry: Geometry, timed: bool, clock: Clock, scale: float
    ) -> None:
        self.search, self.candidate, self.geometry, self.timed = search, candidate, geometry, timed
        self.clock, self.scale = clock, scale

    def start(self, device: Any) -> Lap:
        """Mark the start of the call's work on ``device`` (a torch device)."""
        return self.clock.start(device)

    def stop(self, lap: Lap, completed: Geometry) -> None:
        """The call's work is queued, at ``completed`` (fewer rows than the candidate's after an OOM)."""
        lap.stop(completed)
        if completed.chunk_size < self.geometry.chunk_size:
            return  # the OOM fallback's remember dropped the candidate; this time is not its
        if self.timed:
            self.search.pending.append((self.candidate, lap, self.scale))
        else:
            self.search.search.record(self.candidate, None)


class MeasuredEntry:
    """A ``measured`` strategy's geometry for one (problem, device), per kind of call, from its head's buckets."""

    def __init__(self, head: MeasuredHead, problem: Problem, *, grad_weight_filter: Any, rescue: Any) -> None:
        self.head, self.problem = head, problem
        self.bucket = bucket_problem(problem)
        #: the limit in the engine's form: what runs where nothing was measured, the most rows a call may run
        self.static = planned_geometry(
            head.strategy, problem, head.device, rule=head.rule, slab_form=head.pin
        ).with_filter(grad_weight_filter, rescue)
        self.picked: dict[str, Geometry] = {}
        self.fallbacks: dict[str, OOMFallback | None] = {}
        self.sources: dict[str, str] = {}  # kind -> where its pick came from (explain)
        self._resolved: Geometry | None = None  # resolve()'s answer, until a pick is kept

    # --- the hot path --------------------------------------------------------------------------

    def for_call(self, kind: str) -> tuple[Geometry, OOMFallback | None, Trial | None]:
        """The geometry a call of ``kind`` runs, its OOM fallback, and the trial that times it (None once picked)."""
        geometry = self.picked.get(kind)
        if geometry is not None and self.head.kinds[kind].sync is None:
            return self._within_free_memory(geometry), self.fallbacks[kind], None
        head = self.head
        if head.kind(kind).sync is None:
            return self._answer(kind, head.local_call(self.bucket, kind))
        return self._answer(kind, head.group_call(self.bucket, kind))

    def _answer(self, kind: str, decision: Step | BucketPick | None) -> tuple[Geometry, OOMFallback | None, Any]:
        if decision is None:  # under a process group, a bucket not settled yet: the limit
            return self.static, self._plain_fallback(), None
        if type(decision) is BucketPick:
            return self._within_free_memory(self._kept(kind, decision)), self.fallbacks[kind], None
        return self._run(decision)  # type: ignore[arg-type]

    # --- measuring -----------------------------------------------------------------------------

    def _run(self, step: Step) -> tuple[Geometry, OOMFallback | None, Trial | None]:
        candidate = step.candidate
        geometry = BucketPick.of(candidate, "measured candidate").for_call(self.static)
        search = step.search
        if search is None:  # a rank following rank 0: untimed, remembering nothing on OOM
            return geometry, self._plain_fallback(), None
        if geometry.chunk_size < min(candidate.chunk_size, self.problem.tokens):
            # this BT's own limit is below the candidate: it cannot be measured here, nor picked for the bucket
            search.search.drop_from(geometry.chunk_size + 1)
            return geometry, self._plain_fallback(), None
        fallback = None if self.head.fallback is None else OOMFallback(self.head.fallback.min_chunk_size, search.oom)
        scale = self.bucket.tokens / self.problem.tokens  # a call's time as the bucket's top BT's
        return geometry, fallback, Trial(search, candidate, geometry, step.timed, self.head.clock, scale)

    def _plain_fallback(self) -> OOMFallback | None:
        return None if self.head.fallback is None else OOMFallback(self.head.fallback.min_chunk_size)

    def _kept(self, kind: str, pick: BucketPick) -> Geometry:
        geometry = self.picked.get(kind)
        if geometry is None:
            geometry = self._keep(kind, pick.for_call(self.static), pick.source)
        return geometry

    def _keep(self, kind: str, geometry: Geometry, source: str) -> Geometry:
        self.picked[kind] = geometry
        self._resolved = None
        self.sources[kind] = source
        self.fallbacks[kind] = (
            None
            if self.head.fallback is None
            else OOMFallback(self.head.fallback.min_chunk_size, functools.partial(self.remember, kind))
        )
        return geometry

    # --- after the pick ------------------------------------------------------------------------

    def remember(self, kind: str, geometry: Geometry) -> None:
        """An OOM after the pick: the rows that completed are the kind's from now on, here and for the bucket's
        problems seen later."""
        self._keep(kind, geometry, f"{self.sources.get(kind, 'measured')}; then an OOM fallback")
        self.head.lower(self.bucket, kind, geometry.chunk_size)

    def _within_free_memory(self, geometry: Geometry) -> Geometry:
        fraction = self.head.strategy.free_memory  # type: ignore[attr-defined]
        if fraction is None:
            return geometry
        fits = FreeMemory(fraction=fraction).geometry(self.problem, self.head.device)
        if fits.chunk_size >= geometry.chunk_size:
            return geometry
        return Geometry.for_problem(
            self.problem, fits.chunk_size, vocab_chunk=geometry.vocab_chunk, accum_dtype=geometry.accum_dtype,
            slab_form=geometry.slab_form, strategy=f"{geometry.strategy}, within free memory now", rule=self.head.rule,
        ).with_filter(geometry.grad_weight_filter, geometry.grad_weight_filter_rescue)  # fmt: skip

    def known_pick(self, kind: str = PLAIN_KIND) -> tuple[Geometry, str] | None:
        """The pick a call of ``kind`` would run without measuring, and where it came from; None if it needs one."""
        geometry = self.picked.get(kind)
        if geometry is not None:
            return geometry, self.sources[kind]
        state = self.head.kinds.get(kind)
        pick = None if state is None else state.picks.get(self.bucket.tokens)
        if pick is None:
            pick = self.head.known(self.bucket, kind)
        return None if pick is None else (pick.for_call(self.static), pick.source)

    def resolve(self) -> Geometry:
        """The plain kind's pick if known without measuring, else the limit's geometry (explain, a vocab-parallel
        head, the compiled op: asked each call, so the disk is read once, until a pick is kept)."""
        if self._resolved is None:
            known = self.known_pick()
            self._resolved = self.static if known is None else known[0]
        return self._resolved
