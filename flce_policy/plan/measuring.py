"""The measuring core: which geometries to time for a problem, in which order, and which one to keep.

Shared by the ``measured`` strategy (timed on the training's own calls, :mod:`flce_policy.engine.measured_entry`)
and ``flce-policy tune`` (timed by the benchmark), so that ``tune`` writes what ``measured`` would pick:

- :func:`candidates`: rows in powers of two from :data:`SMALLEST_CHUNK` up to a limit's rows (the limit's own rows
  included: BT itself when one chunk fits), times the slab forms the GPU runs for them;
- :func:`pick`: of the times measured, the fastest within :data:`TOLERANCE` of the best, preferring the smaller
  slab (memory a slab does not take is memory the rest of the step keeps);
- :class:`Search`: the order one problem's candidates are timed in. Each form from its most rows down, each
  candidate ``warmup_calls`` untimed calls (Triton's compile, the allocator growing) and then ``timed_calls``
  timed ones, its time the least of them. A form stops going down at the first candidate more than
  :data:`TOLERANCE` slower than its best so far: a chunk that small only gets slower (the GEMMs lose their
  efficiency), so the rest would be measured for nothing. A candidate that ran out of memory is dropped, with
  every candidate of as many rows or more.

Pure Python on :class:`~flce_policy.plan.geometry.Geometry`: nothing here times anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .device import DeviceInfo
from .form_choice import slab_form_candidates
from .geometry import Geometry

__all__ = ["SMALLEST_CHUNK", "TOLERANCE", "FORM_ORDER", "Search", "candidate_rows", "candidates", "pick"]

#: A pick is as good as the fastest when it runs within 2% of its time: about the run-to-run spread of a call's
#: time on an H200, so a larger slab buys nothing sure.
TOLERANCE = 0.02
#: The fewest rows measured (unless the limit allows fewer): below 256 the GEMMs fall far from their floor
#: (1.45x at 256 rows on the H200), so such a chunk is never the fastest.
SMALLEST_CHUNK = 256
#: The order forms are measured in (and a tie between equal slabs is broken in): the fewest passes first.
FORM_ORDER = ("scaled_exp_ws", "scaled_exp_rows", "logits")


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


def candidates(
    limit: Geometry,
    device: DeviceInfo,
    *,
    rows: Iterable[int] | None = None,
    slab_forms: Sequence[str] | None = None,
) -> list[Geometry]:
    """The geometries to measure for ``limit``'s problem on ``device``: :func:`candidate_rows` under ``limit``'s
    rows, in ``limit``'s vocab tiles, times ``slab_forms`` (default: the forms
    :func:`~flce_policy.plan.form_choice.slab_form_candidates` says the GPU runs; the logits slab alone on the
    CPU, whose interpreter only tests run), grouped by form in :data:`FORM_ORDER`, most rows first."""
    at_limit = limit.with_slab_form("logits")
    runnable = slab_form_candidates(at_limit, device)
    if slab_forms is None:
        forms = ["logits"] if not device.is_gpu else [f for f in FORM_ORDER if runnable[f] is None]
    else:
        forms = [f for f in FORM_ORDER if f in slab_forms and runnable[f] is None] or ["logits"]
    sizes = candidate_rows(limit.chunk_size, rows)
    out = []
    for form in forms:
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


def pick(times: Mapping[Geometry, float], tolerance: float = TOLERANCE) -> Geometry:
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
        tolerance: float = TOLERANCE,
    ) -> None:
        self.geometries = list(geometries)
        self.warmup_calls = warmup_calls
        self.timed_calls = timed_calls
        self.tolerance = tolerance
        self._warm: dict[Geometry, int] = {}
        self._laps: dict[Geometry, list[float]] = {}
        self.dropped: set[Geometry] = set()  # out of memory, or of as many rows as one that was
        self.skipped: set[Geometry] = set()  # below a form's first candidate that was slower than its best

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
        return None

    def record(self, geometry: Geometry, seconds: float | None) -> None:
        """A call of ``geometry`` completed: untimed (``seconds`` None) or in ``seconds``."""
        if geometry in self.dropped or geometry not in self.geometries:
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
        """:func:`pick` over the candidates measured; ValueError when none was."""
        return pick(self.times, self.tolerance)

    def _prune_below(self, geometry: Geometry) -> None:
        times = self.times
        form = [g for g in self.geometries if g.slab_form == geometry.slab_form]
        best = min(t for g, t in times.items() if g.slab_form == geometry.slab_form)
        if times[geometry] > best * (1 + self.tolerance):
            self.skipped.update(g for g in form if g.chunk_size < geometry.chunk_size)
