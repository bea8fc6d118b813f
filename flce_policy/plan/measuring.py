"""The measuring core: which geometries to time for a problem, in which order, and which one to keep.

Shared by the ``measured`` strategy (timed on the training's own calls, :mod:`flce_policy.engine.measured_entry`)
and ``flce-policy tune`` (timed by the benchmark), so that ``tune`` writes what ``measured`` would pick:

- :func:`bucket_problem`: the problem a search and a pick stand for: BT rounded up to a power of two (a bucket
  ``(top/2, top]``), since a training with dynamic padding sees a new BT nearly every step. Candidate rows are
  powers of two, so a pick of R rows runs ``min(R, BT)`` rows (:meth:`BucketPick.for_call`) as the same number
  of chunks, within one, at every BT of its bucket: R = top is one chunk everywhere;
- :func:`candidates`: rows in powers of two from :data:`SMALLEST_CHUNK` up to a limit's rows (the limit's own rows
  included: BT itself when one chunk fits), times the slab forms the GPU runs for them, less those the cost model
  predicts more than ``form_margin`` slower than the fastest (:func:`measured_forms`: each form's first call
  compiles its kernels, seconds on a fresh cache);
- :func:`pick`: of the times measured, the fastest within a tolerance (:data:`PICK_TOLERANCE`) of the best,
  preferring the smaller slab (memory a slab does not take is memory the rest of the step keeps);
- :class:`Search`: the order one problem's candidates are timed in. Each form from its most rows down, each
  candidate ``warmup_calls`` untimed calls (Triton's compile, the allocator growing) and then ``timed_calls``
  timed ones, its time the least of them. A form stops going down at the first candidate more than
  that tolerance slower than its best so far: a chunk that small only gets slower (the GEMMs lose their
  efficiency), so the rest would be measured for nothing. A candidate that ran out of memory is dropped, with
  every candidate of as many rows or more. Then the pick and its rival run again in turn, :data:`REMATCH_CALLS`
  timed calls each, and the pick stands unless its median is more than the tolerance behind the rival's: timed
  one after the other, a candidate's few calls share the GPU's clocks of that moment (H100 and H200: picks timed
  fastest or within 1% that way ran 4-6% slower than the limit when the two alternated). The rival is the
  incumbent (the limit's rows in the form the cost model predicts fastest: what would run unmeasured) where the
  pick is another candidate, else the fastest other candidate.

Pure Python on :class:`~flce_policy.plan.geometry.Geometry`: nothing here times anything.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from .cost_model import DeviceRates, predict_seconds
from .device import DeviceInfo
from .form_choice import slab_form_candidates
from .geometry import Geometry
from .problem import Problem
from .units import next_pow2

__all__ = [
    "SMALLEST_CHUNK",
    "TOLERANCE",
    "PICK_TOLERANCE",
    "FORM_MARGIN",
    "REMATCH_CALLS",
    "FORM_ORDER",
    "BucketPick",
    "Search",
    "bucket_label",
    "bucket_problem",
    "candidate_rows",
    "candidates",
    "measured_forms",
    "pick",
    "predicted_fastest_form",
]

#: A pick is as good as the fastest when it runs within 2% of its time: about the run-to-run spread of a call's
#: time on an H200, so a larger slab buys nothing sure.
TOLERANCE = 0.02
#: ``measured``'s default tolerance: its times are the least of two calls of a training, and its goal is the rule's
#: time within 3%; a pick allowed 2% slower than the fastest spent most of that before any call-to-call spread (on
#: the H100 two picks landed 2.9% and 3.3% behind the rule), so it keeps a larger slab sooner.
PICK_TOLERANCE = 0.01
#: The fewest rows measured (unless the limit allows fewer): below 256 the GEMMs fall far from their floor
#: (1.45x at 256 rows on the H200), so such a chunk is never the fastest.
SMALLEST_CHUNK = 256
#: The order forms are measured in (and a tie between equal slabs is broken in): the fewest passes first.
FORM_ORDER = ("scaled_exp_ws", "scaled_exp_rows", "logits")
#: Forms predicted more than 3% slower than the fastest are not measured: each form measured compiles its kernels
#: on the training's first calls (1-2 s on a fresh cache, against 5 s for 200 calls of a 1024-wide head), and where
#: the cost model puts two forms 5% apart the GPU does too (H200, 896- and 1024-wide heads: the warp-specialised
#: slab predicted 5.2% and 5.1% faster than the row-scaled one, measured 5.4% and 5.0% faster); within 3% it cannot
#: tell them apart, so both run.
FORM_MARGIN = 0.03
#: Timed calls of each side of the rematch (the pick against its rival, in turn; the medians compared).
REMATCH_CALLS = 4


def bucket_problem(problem: Problem) -> Problem:
    """The bucket ``problem`` is measured and cached under: its BT rounded up to a power of two, at least
    :data:`SMALLEST_CHUNK` (below it a chunk is one chunk of BT rows anyway)."""
    top = max(SMALLEST_CHUNK, next_pow2(problem.tokens))
    return problem if top == problem.tokens else problem.model_copy(update={"tokens": top})


def bucket_label(bucket: Problem) -> str:
    """``"BT 2049-4096"``: the token counts a bucket (a :func:`bucket_problem`) holds."""
    low = 1 if bucket.tokens <= SMALLEST_CHUNK else bucket.tokens // 2 + 1
    return f"BT {low}-{bucket.tokens}"


class BucketPick(NamedTuple):
    """A bucket's geometry, in rows of its top (a candidate, or the pick kept), and where it came from."""

    rows: int
    vocab_chunk: int
    slab_form: str
    source: str = "measured"

    @classmethod
    def of(cls, geometry: Geometry, source: str = "measured") -> BucketPick:
        return cls(geometry.chunk_size, geometry.vocab_chunk, geometry.slab_form, source)

    def for_call(self, limit: Geometry) -> Geometry:
        """The geometry a call of ``limit``'s problem runs: these rows and columns within its limit (a problem's
        limit is per row, so below it as a rule: the least of R and BT)."""
        return Geometry.for_problem(
            limit.problem, min(self.rows, limit.chunk_size), vocab_chunk=min(self.vocab_chunk, limit.vocab_chunk),
            accum_dtype=limit.accum_dtype, slab_form=self.slab_form, strategy=f"{self.source} ({limit.strategy})",
            rule=limit.rule,
        ).with_filter(limit.grad_weight_filter, limit.grad_weight_filter_rescue)  # fmt: skip


def candidate_rows(limit_rows: int, rows: Iterable[int] | None = None) -> tuple[int, ...]:
    """The chunk sizes to measure under a limit of ``limit_rows``, most first: ``rows`` where given (those within
    the limit), else the powers of two from :data:`SMALLEST_CHUNK` below it and the limit itself."""
    if rows is not None:
        return tuple(sorted({r for r in rows if r <= limit_rows}, reverse=True)) or (limit_rows,)
    sizes, chunk = [limit_rows], SMALLEST_CHUNK
    while chunk < limit_rows:
        sizes.append(chunk)
        chunk *= 2
    return tuple(sorted(set(sizes), reverse=True))


def measured_forms(
    limit: Geometry,
    device: DeviceInfo,
    rates: DeviceRates,
    *,
    slab_forms: Sequence[str] | None = None,
    form_margin: float | None = FORM_MARGIN,
) -> list[str]:
    """The slab forms to measure for ``limit``'s problem on ``device``, in :data:`FORM_ORDER`: ``slab_forms`` (a
    pin, a strategy's list) where it runs, as given; else the forms the GPU runs (the logits slab alone on the CPU,
    whose interpreter only tests run) predicted at ``limit``'s rows and ``rates`` within ``form_margin`` of the
    fastest (None: every one)."""
    at_limit = limit.with_slab_form("logits")
    runnable = slab_form_candidates(at_limit, device)
    if slab_forms is not None:
        return [f for f in FORM_ORDER if f in slab_forms and runnable[f] is None] or ["logits"]
    if not device.is_gpu:
        return ["logits"]
    forms = [f for f in FORM_ORDER if runnable[f] is None]
    if form_margin is None:
        return forms
    seconds = {f: predict_seconds(at_limit.with_slab_form(f), rates).seconds for f in forms}
    fastest = min(seconds.values())
    return [f for f in forms if seconds[f] <= fastest * (1 + form_margin)]


def predicted_fastest_form(limit: Geometry, forms: Sequence[str], rates: DeviceRates) -> str:
    """Of ``forms``, the one the cost model predicts fastest at ``limit``'s rows (the first of equals)."""
    return min(forms, key=lambda f: predict_seconds(limit.with_slab_form(f), rates).seconds)


def candidates(limit: Geometry, forms: Sequence[str], *, rows: Iterable[int] | None = None) -> list[Geometry]:
    """The geometries to measure for ``limit``'s problem: :func:`candidate_rows` under ``limit``'s rows, in
    ``limit``'s vocab tiles, times ``forms`` (:func:`measured_forms`), grouped by form, most rows first."""
    sizes = candidate_rows(limit.chunk_size, rows)
    out = []
    for form in sorted(forms, key=_form_rank):
        for size in sizes:
            out.append(
                Geometry.for_problem(
                    limit.problem,
                    size,
                    vocab_chunk=limit.vocab_chunk,
                    accum_dtype=limit.accum_dtype,
                    slab_form=form,
                    strategy=f"measured candidate ({limit.strategy})",
                    rule=limit.rule,
                )  # fmt: skip
            )
    return out


def pick(times: Mapping[Geometry, float], tolerance: float = PICK_TOLERANCE) -> Geometry:
    """Of ``times`` (seconds per geometry), the smallest slab within ``tolerance`` of the fastest, the faster of
    equal slabs (then the form first in :data:`FORM_ORDER`); ValueError when nothing was measured."""
    if not times:
        raise ValueError("no candidate was measured: nothing to pick from")
    best = min(times.values())
    within = [g for g, t in times.items() if t <= best * (1 + tolerance)]
    return min(within, key=lambda g: (g.slab_bytes, times[g], _form_rank(g.slab_form)))


def _form_rank(form: str) -> int:
    return FORM_ORDER.index(form) if form in FORM_ORDER else len(FORM_ORDER)


class Search:
    """One problem's candidates timed in turn (the module docstring says in which order), then the pick.

    Ask :meth:`next` before each call: the candidate to run and whether the call is timed (None once done). Give
    each completed call to :meth:`record` (its seconds, or None for an untimed call), an out-of-memory to
    :meth:`drop_from`. A call that never reports back (it raised) is simply asked for again.
    """

    def __init__(
        self,
        geometries: Sequence[Geometry],
        *,
        warmup_calls: int = 1,
        timed_calls: int = 2,
        tolerance: float = PICK_TOLERANCE,
        incumbent_form: str | None = None,
    ) -> None:
        self.geometries = list(geometries)
        # the rematch's rival where the pick is another: the most rows in this form (None: no incumbent)
        self.incumbent = next((g for g in self.geometries if g.slab_form == incumbent_form), None)
        self.warmup_calls = warmup_calls
        self.timed_calls = timed_calls
        self.tolerance = tolerance
        self._warm: dict[Geometry, int] = {}
        self._laps: dict[Geometry, list[float]] = {}
        self.dropped: set[Geometry] = set()  # out of memory, or of as many rows as one that was
        self.skipped: set[Geometry] = set()  # below a form's first candidate that was slower than its best
        # the pick and its rival timed again in turn, once every candidate is done (None: not yet; empty: no rival)
        self._rematch: dict[Geometry, list[float]] | None = None

    @property
    def times(self) -> dict[Geometry, float]:
        """Each fully measured candidate's time: the least of its timed calls."""
        done = self.timed_calls
        return {g: min(laps) for g, laps in self._laps.items() if len(laps) >= done and g not in self.dropped}

    def next(self) -> tuple[Geometry, bool] | None:
        """The candidate the next call runs and whether that call is timed; None when every candidate is done."""
        for geometry in self.geometries:
            if geometry in self.dropped or geometry in self.skipped:
                continue
            if len(self._laps.get(geometry, ())) >= self.timed_calls:
                continue
            return geometry, self._warm.get(geometry, 0) >= self.warmup_calls
        return self._next_rematch()

    def _next_rematch(self) -> tuple[Geometry, bool] | None:
        """The pick and its rival in turn, :data:`REMATCH_CALLS` timed calls each."""
        if self._rematch is None:
            times = self.times
            if not times:
                return None
            kept = pick(times, self.tolerance)
            others = [g for g in times if g != kept]
            rival = self.incumbent if self.incumbent in others else min(others, key=times.__getitem__, default=None)
            self._rematch = {} if rival is None else {rival: [], kept: []}
        if not self._rematch or any(g in self.dropped for g in self._rematch):
            return None
        behind = min(self._rematch, key=lambda g: len(self._rematch[g]))  # type: ignore[index]
        return (behind, True) if len(self._rematch[behind]) < REMATCH_CALLS else None

    def record(self, geometry: Geometry, seconds: float | None) -> None:
        """A call of ``geometry`` completed: untimed (``seconds`` None) or in ``seconds``."""
        if geometry in self.dropped or geometry not in self.geometries:
            return
        if self._rematch:  # only the rematch's timed calls count now
            if seconds is not None and geometry in self._rematch:
                self._rematch[geometry].append(seconds)
            return
        if seconds is None:
            self._warm[geometry] = self._warm.get(geometry, 0) + 1
            return
        laps = self._laps.setdefault(geometry, [])
        laps.append(seconds)
        if len(laps) == self.timed_calls:
            self._prune_below(geometry)

    def drop_from(self, chunk_size: int) -> None:
        """A candidate of ``chunk_size`` rows (or more) ran out of memory: drop every candidate of as many rows."""
        self.dropped.update(g for g in self.geometries if g.chunk_size >= chunk_size)

    def pick(self) -> Geometry:
        """:func:`pick` over the candidates measured, unless the rematch's median put it more than the tolerance
        behind its rival: then the rival; ValueError when none was measured."""
        kept = pick(self.times, self.tolerance)
        laps = self._rematch or {}
        if len(laps) == 2 and all(len(t) >= REMATCH_CALLS for t in laps.values()) and kept in laps:
            (rival,) = (g for g in laps if g != kept)
            if statistics.median(laps[kept]) > statistics.median(laps[rival]) * (1 + self.tolerance):
                return rival
        return kept

    def _prune_below(self, geometry: Geometry) -> None:
        times = self.times
        form = [g for g in self.geometries if g.slab_form == geometry.slab_form]
        best = min(t for g, t in times.items() if g.slab_form == geometry.slab_form)
        if times[geometry] > best * (1 + self.tolerance):
            self.skipped.update(g for g in form if g.chunk_size < geometry.chunk_size)
