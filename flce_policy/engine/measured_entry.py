"""A ``measured`` strategy's state in a policy: per kind of call, the search under way or the pick it kept.

The policy holds one :class:`MeasuredEntry` per (problem, device) where its strategy measures
(:attr:`~flce_policy.strategies.ChunkStrategy.measures`) and a clock can time the calls. Each loss call asks
:meth:`MeasuredEntry.for_call` with its kind (the options that change the kernels, :func:`call_kind`'s string):

- once a kind has its pick, the answer is one dict lookup, as a cached geometry's is;
- before that, a pick from the strategy's ``picks`` or from the disk cache (:mod:`flce_policy.engine.pick_cache`)
  is taken without measuring; else the call runs the next candidate of a
  :class:`~flce_policy.plan.measuring.Search` and hands back a :class:`Trial`, which the call layer starts and
  stops around its work. A timed call's lap is read at the next call of the kind (its CUDA events are done by
  then), so no call waits for the GPU to time itself.

A candidate that runs out of memory completes at fewer rows through the OOM fallback (the call's result is that
of a clean run at those rows) and is dropped with every candidate of as many rows. Under a process group (and
``broadcast``), rank 0 searches and broadcasts what each call runs, and the pick; the other ranks run that.
"""

from __future__ import annotations

import functools
from typing import Any

from flce_policy.engine import pick_cache
from flce_policy.engine.clock import Clock, Lap
from flce_policy.engine.planned import planned_geometry
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.measuring import Search, candidates
from flce_policy.plan.oom import OOMFallback
from flce_policy.plan.problem import Problem
from flce_policy.strategies import ChunkStrategy, FreeMemory

__all__ = ["MeasuredEntry", "Trial", "PLAIN_KIND"]

#: The kind of a plain training call (mean or sum, gradients of input and weight, no extra option).
PLAIN_KIND = ""


class Trial:
    """One measuring call: the candidate it runs and whether its time counts; the call layer starts and stops it."""

    __slots__ = ("state", "geometry", "timed", "clock")

    def __init__(self, state: _KindSearch, geometry: Geometry, timed: bool, clock: Clock) -> None:
        self.state, self.geometry, self.timed, self.clock = state, geometry, timed, clock

    def start(self, device: Any) -> Lap:
        """Mark the start of the call's work on ``device`` (a torch device)."""
        return self.clock.start(device)

    def stop(self, lap: Lap, completed: Geometry) -> None:
        """The call's work is queued, at ``completed`` (fewer rows than the candidate's after an OOM)."""
        lap.stop(completed)
        if completed.chunk_size < self.geometry.chunk_size:
            return  # the OOM fallback's remember dropped the candidate; this time is not its
        if self.timed:
            self.state.pending.append((self.geometry, lap))
        else:
            self.state.search.record(self.geometry, None)  # type: ignore[union-attr]


class _KindSearch:
    """One kind's measuring: the search (rank 0's, or this process's), the laps not yet read, the cache key."""

    def __init__(
        self, search: Search | None, key: pick_cache.PickKey | None, group: Any, limit: Geometry | None = None
    ) -> None:
        self.search = search  # None on a rank that follows rank 0
        self.key = key
        self.limit = limit
        self.asked_known = False
        self.group = group  # torch.distributed's default group when rank 0 decides for every rank
        self.pending: list[tuple[Geometry, Lap]] = []
        self.fell_back: Geometry | None = None  # the rows an OOM fallback completed at, the smallest known to fit

    def oom(self, completed: Geometry) -> None:
        """The OOM fallback's remember: the candidate ran out of memory and the call completed at ``completed``."""
        self.fell_back = completed
        if self.search is not None:
            self.search.drop_from(completed.chunk_size + 1)

    def read_laps(self) -> None:
        for geometry, lap in self.pending:
            self.search.record(geometry, lap.seconds())  # type: ignore[union-attr]
        self.pending.clear()


class MeasuredEntry:
    """A ``measured`` strategy's picks and searches for one (problem, device), per kind of call."""

    def __init__(
        self,
        strategy: ChunkStrategy,
        problem: Problem,
        device: DeviceInfo,
        *,
        rule: str,
        slab_form: str | None,
        grad_weight_filter: float | None,
        grad_weight_filter_rescue: int | None,
        fallback: OOMFallback | None,
        clock: Clock,
    ) -> None:
        self.strategy, self.problem, self.device, self.rule, self.pin = strategy, problem, device, rule, slab_form
        self.filter = (grad_weight_filter, grad_weight_filter_rescue)
        self.fallback = fallback  # the policy's settings (min_chunk_size), or None: an OOM propagates
        self.clock = clock
        #: what runs where nothing was measured (the limit, in the engine's form): explain, a vocab-parallel head
        self.static = planned_geometry(strategy, problem, device, rule=rule, slab_form=slab_form).with_filter(
            *self.filter
        )
        self.kinds: dict[str, Geometry | _KindSearch] = {}
        self.fallbacks: dict[str, OOMFallback | None] = {}
        self.sources: dict[str, str] = {}  # kind -> where its pick came from (explain)
        self._resolved: Geometry | None = None  # resolve()'s answer, until a pick is kept

    # --- the hot path --------------------------------------------------------------------------

    def for_call(self, kind: str) -> tuple[Geometry, OOMFallback | None, Trial | None]:
        """The geometry a call of ``kind`` runs, its OOM fallback, and the trial that times it (None once picked)."""
        slot = self.kinds.get(kind)
        if type(slot) is Geometry:
            if self.strategy.free_memory is not None:  # type: ignore[attr-defined]
                return self._within_free_memory(slot), self.fallbacks[kind], None
            return slot, self.fallbacks[kind], None
        return self._measuring(kind, slot)  # type: ignore[arg-type]

    # --- measuring -----------------------------------------------------------------------------

    def _measuring(self, kind: str, state: _KindSearch | None) -> tuple[Geometry, OOMFallback | None, Trial | None]:
        if state is None:
            state = self._start(kind)
            self.kinds[kind] = state
        decision = self._decide(state, kind) if state.search is not None else None
        if state.group is not None:
            decision = self._shared(decision, state)
        if decision[0] == "pick":  # type: ignore[index]
            geometry = self._kept(kind, decision[1], decision[2])  # type: ignore[index, misc]
            if state.search is not None and decision[2] == "measured" and state.key is not None:  # type: ignore[index]
                pick_cache.store(state.key, geometry, state.search.times)
            return self.for_call(kind)
        _, geometry, timed = decision  # type: ignore[misc]
        if state.search is None:  # a following rank: runs rank 0's choice, untimed, remembering nothing on OOM
            return geometry, None if self.fallback is None else OOMFallback(self.fallback.min_chunk_size), None
        fallback = None if self.fallback is None else OOMFallback(self.fallback.min_chunk_size, state.oom)
        return geometry, fallback, Trial(state, geometry, timed, self.clock)

    def _start(self, kind: str) -> _KindSearch:
        strategy = self.strategy
        group = _broadcast_group() if strategy.broadcast else None  # type: ignore[attr-defined]
        if group is not None and _rank() != 0:
            return _KindSearch(None, None, group)
        limit = strategy.limit(self.problem, self.device, rule=self.rule)  # type: ignore[attr-defined]
        forms = [self.pin] if self.pin is not None else strategy.slab_forms  # type: ignore[attr-defined]
        geometries = [
            g.with_filter(*self.filter)
            for g in candidates(limit, self.device, rows=strategy.rows, slab_forms=forms)  # type: ignore[attr-defined]
        ]
        search = Search(
            geometries,
            warmup_calls=strategy.warmup_calls,  # type: ignore[attr-defined]
            timed_calls=strategy.timed_calls,  # type: ignore[attr-defined]
            tolerance=strategy.tolerance,  # type: ignore[attr-defined]
        )
        key = None
        if strategy.cache:  # type: ignore[attr-defined]
            key = pick_cache.pick_key(self.device, self.problem, kind, strategy.params_key())
        return _KindSearch(search, key, group, limit)

    def _decide(self, state: _KindSearch, kind: str) -> tuple:
        """This process's decision: ``("pick", geometry, source)`` or ``("run", geometry, timed)``."""
        search = state.search
        if not state.asked_known:  # the kind's first call: a pick from picks or the cache, if there is one
            state.asked_known = True
            known = self._known(state.key, state.limit)
            if known is not None:
                return ("pick", *known)
        state.read_laps()
        step = search.next()  # type: ignore[union-attr]
        if step is not None:
            return ("run", *step)
        if search.times:  # type: ignore[union-attr]
            return ("pick", search.pick(), "measured")  # type: ignore[union-attr]
        # every candidate ran out of memory: the rows the OOM fallback completed at, else the limit's
        return ("pick", state.fell_back or self.static, "measured")

    def _known(self, key: pick_cache.PickKey | None, limit: Geometry) -> tuple[Geometry, str] | None:
        """A pick that needs no measuring: the strategy's ``picks``, else the disk cache's."""
        seeded = self.strategy.seeded_pick(self.problem)  # type: ignore[attr-defined]
        if seeded is not None:
            rows, form = seeded
            try:
                return Geometry.for_problem(
                    self.problem, min(rows, self.problem.tokens), vocab_chunk=limit.vocab_chunk,
                    accum_dtype=limit.accum_dtype, slab_form=form, strategy=f"picks ({self.strategy!r})",
                    rule=self.rule,
                ), "picks"  # fmt: skip
            except ValueError:
                pass  # the form cannot run this problem: measured instead
        if key is None:
            return None
        cached = pick_cache.load(key)
        if cached is None:
            return None
        try:
            return cached.geometry(limit), f"cache, measured {cached.measured_at}"
        except ValueError:
            return None

    def _shared(self, decision: tuple | None, state: _KindSearch) -> tuple:
        """Rank 0's decision, on every rank (one broadcast per call while the kind is measured)."""
        import torch.distributed as dist

        message = [None if decision is None else _to_message(decision)]
        dist.broadcast_object_list(message, src=0, group=state.group)
        if decision is not None:  # rank 0 keeps its own objects
            return decision
        return _from_message(message[0], self.problem, self.static)

    def _kept(self, kind: str, geometry: Geometry, source: str) -> Geometry:
        geometry = geometry.with_filter(*self.filter)
        self.kinds[kind] = geometry
        self._resolved = None
        self.sources[kind] = source
        self.fallbacks[kind] = (
            None
            if self.fallback is None
            else OOMFallback(self.fallback.min_chunk_size, functools.partial(self.remember, kind))
        )
        return geometry

    # --- after the pick ------------------------------------------------------------------------

    def remember(self, kind: str, geometry: Geometry) -> None:
        """An OOM after the pick: the rows that completed are the kind's from now on."""
        self._kept(kind, geometry, f"{self.sources.get(kind, 'measured')}; then an OOM fallback")

    def _within_free_memory(self, geometry: Geometry) -> Geometry:
        fits = FreeMemory(fraction=self.strategy.free_memory).geometry(self.problem, self.device)  # type: ignore[attr-defined]
        if fits.chunk_size >= geometry.chunk_size:
            return geometry
        return Geometry.for_problem(
            self.problem, fits.chunk_size, vocab_chunk=geometry.vocab_chunk, accum_dtype=geometry.accum_dtype,
            slab_form=geometry.slab_form, strategy=f"{geometry.strategy}, within free memory now", rule=self.rule,
        ).with_filter(geometry.grad_weight_filter, geometry.grad_weight_filter_rescue)  # fmt: skip

    def known_pick(self, kind: str = PLAIN_KIND) -> tuple[Geometry, str] | None:
        """The pick a call of ``kind`` would run without measuring, and where it came from; None if it needs one."""
        slot = self.kinds.get(kind)
        if type(slot) is Geometry:
            return slot, self.sources.get(kind, "measured")
        key = None
        if self.strategy.cache:  # type: ignore[attr-defined]
            key = pick_cache.pick_key(self.device, self.problem, kind, self.strategy.params_key())
        known = self._known(key, self.strategy.limit(self.problem, self.device, rule=self.rule))  # type: ignore[attr-defined]
        return None if known is None else (known[0].with_filter(*self.filter), known[1])

    def resolve(self) -> Geometry:
        """The plain kind's pick if known without measuring, else the limit's geometry (explain, a vocab-parallel
        head, the compiled op: asked each call, so the disk is read once, until a pick is kept)."""
        if self._resolved is None:
            known = self.known_pick()
            self._resolved = self.static if known is None else known[0]
        return self._resolved


def _to_message(decision: tuple) -> tuple:
    geometry = decision[1]
    return (decision[0], geometry.chunk_size, geometry.vocab_chunk, geometry.slab_form, decision[2])


def _from_message(message: Any, problem: Problem, static: Geometry) -> tuple:
    """Rank 0's decision, rebuilt from its sizes on another rank."""
    kind, rows, vocab_chunk, form, extra = message
    geometry = Geometry.for_problem(
        problem, rows, vocab_chunk=vocab_chunk, accum_dtype=static.accum_dtype, slab_form=form,
        strategy=f"measured on rank 0 ({static.strategy})", rule=static.rule,
    )  # fmt: skip
    return (kind, geometry, "rank 0" if kind == "pick" else extra)


def _broadcast_group() -> Any:
    """torch.distributed's default group when one is up with more than one rank, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.group.WORLD


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()
