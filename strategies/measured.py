"""The geometry measured on the GPU it runs on: the training's first calls of a BT bucket time the candidates."""

from __future__ import annotations

from typing import Any

from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.measuring import FORM_MARGIN, FORM_ORDER, PICK_TOLERANCE, BucketPick, bucket_problem
from flce_policy.plan.problem import Problem

from .base import ChunkStrategy, StrategyError, builtin_strategy, checked_geometry
from .free_memory import FreeMemory
from .nested import nested_config, nested_strategy, validate_nested
from .slab_budget import SlabBudget

__all__ = ["Measured"]

_PICK_KEYS = {"tokens", "hidden", "vocab", "dtype", "chunk_size", "slab_form"}


@builtin_strategy
class Measured(ChunkStrategy):
    """The fastest candidate timed on the training's own calls, within a memory limit, per BT bucket and GPU.

    The limit is the least of ``max_slab`` (bytes or ``"1GiB"``), ``cap`` (a strategy's geometry, as
    ``free_memory``'s cap) and, on a GPU, ``free_memory`` (a fraction of what the GPU can give at the call, as the
    ``free_memory`` strategy reads it; the kept pick is capped by it at every call too). A search and its pick
    stand for a bucket: BT rounded up to a power of two (:func:`flce_policy.plan.measuring.bucket_problem`), the
    candidates sized at its top; a pick of R rows runs ``min(R, BT)`` rows (within the call's own limit), and a
    call's time counts scaled to the top's BT, so calls of any BT in the bucket measure it. The candidates
    (:func:`flce_policy.plan.measuring.candidates`): ``rows`` (default: powers of two from 256 up to the limit's
    rows) times ``slab_forms`` (default: the forms the GPU runs that the cost model predicts within
    ``form_margin``, default 3%, of the fastest, None: all; a rule's ``slab_form`` pins one). Each candidate runs
    ``warmup_calls`` untimed calls, then ``timed_calls`` calls timed with CUDA events; the fastest within
    ``tolerance`` of the best, preferring the smaller slab, is kept unless its rival (the limit in the form predicted
    fastest) beats it by more than ``tolerance`` when the two run in turn (:class:`flce_policy.plan.measuring.Search`).

    An :class:`~flce_policy.engine.policy.FLCEPolicy` does the measuring (it holds the state, per bucket and per
    kind of call); ``cache`` keeps each pick on disk for the next run (``$FLCE_POLICY_CACHE``, else the user's
    cache folder); ``broadcast``: under a process group rank 0 measures, and the ranks agree on its picks at calls
    counted alike on every rank (:mod:`flce_policy.engine.measured_group`: the ranks must call the loss as many
    times, with the same head and options, in the same order; their BT may differ). ``picks``: problems measured
    already (``flce-policy tune --strategy measured`` writes them), each ``{tokens, hidden, vocab, chunk_size,
    slab_form}`` (and ``dtype``, default bfloat16), run without measuring at any BT of the tokens' bucket (of
    several in one bucket, the one of most tokens; a chunk of all its tokens is one chunk there). Where nothing
    measures (the CPU, a GPU planned without one), the geometry is the limit's.
    """

    name = "measured"
    #: the policy times this strategy's candidates on the calls themselves (flce_policy.engine.measured_entry)
    measures = True

    def __init__(
        self,
        max_slab: int | str | None = None,
        cap: ChunkStrategy | dict[str, Any] | None = None,
        free_memory: float | None = None,
        rows: list[int] | None = None,
        slab_forms: list[str] | None = None,
        warmup_calls: int = 1,
        timed_calls: int = 2,
        tolerance: float = PICK_TOLERANCE,
        form_margin: float | None = FORM_MARGIN,
        cache: bool = True,
        broadcast: bool = True,
        picks: list[dict[str, Any]] | None = None,
    ) -> None:
        self.max_slab = max_slab
        self.cap = cap
        self.free_memory = free_memory
        self.rows = rows
        self.slab_forms = slab_forms
        self.warmup_calls = warmup_calls
        self.timed_calls = timed_calls
        self.tolerance = tolerance
        self.form_margin = form_margin
        self.cache = cache
        self.broadcast = broadcast
        self.picks = picks

    def validate_params(self) -> None:
        if self.max_slab is None and self.cap is None and self.free_memory is None:
            raise StrategyError(
                "measured: give a memory limit: max_slab, cap and/or free_memory (candidates are measured within it)",
                param="max_slab",
            )
        if self.max_slab is not None:
            _wrapped(lambda: SlabBudget(self.max_slab).validate_params(), "max_slab")
        if self.free_memory is not None:
            _wrapped(lambda: FreeMemory(fraction=self.free_memory).validate_params(), "free_memory")
        validate_nested(self, "cap")
        cap = nested_strategy(self, "cap")
        if cap is not None and (cap.dynamic or getattr(cap, "measures", False)):
            raise StrategyError(
                "measured: cap must decide from the problem and the device alone; for a limit read at the call "
                "give free_memory: <fraction>",
                param="cap",
            )
        _check_count(self.warmup_calls, "warmup_calls", 0)
        _check_count(self.timed_calls, "timed_calls", 1)
        tol = self.tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < 1:
            raise StrategyError(f"measured: tolerance must be a number in [0, 1), got {tol!r}", param="tolerance")
        margin = self.form_margin
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin < 0):
            raise StrategyError(
                f"measured: form_margin must be a number >= 0 (0.03: forms predicted within 3% of the fastest) or "
                f"null (every form), got {margin!r}",
                param="form_margin",
            )
        for flag in ("cache", "broadcast"):
            if not isinstance(getattr(self, flag), bool):
                raise StrategyError(f"measured: {flag} must be true or false, got {getattr(self, flag)!r}", param=flag)
        if self.rows is not None and (
            not isinstance(self.rows, (list, tuple))
            or not self.rows
            or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in self.rows)
        ):
            raise StrategyError(
                f"measured: rows must be a list of positive row counts, got {self.rows!r}", param="rows"
            )
        if self.slab_forms is not None and (
            not isinstance(self.slab_forms, (list, tuple))
            or not self.slab_forms
            or any(form not in FORM_ORDER for form in self.slab_forms)
        ):
            raise StrategyError(
                f"measured: slab_forms must be a list of {', '.join(FORM_ORDER)}, got {self.slab_forms!r}",
                param="slab_forms",
            )
        for pick in self.picks or ():
            self._checked_pick(pick)
        if self.picks is not None and not isinstance(self.picks, (list, tuple)):
            raise StrategyError(f"measured: picks must be a list, got {self.picks!r}", param="picks")

    def cap_strategy(self) -> ChunkStrategy | None:
        return nested_strategy(self, "cap")

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return self.limit(problem, device).chunk_size

    def geometry(self, problem: Problem, device: DeviceInfo, *, rule: str | None = None) -> Geometry:
        """The limit's geometry: what runs where nothing measures, and the most rows a candidate may have."""
        self.validate_params()
        return self.limit(problem, device, rule=rule)

    def limit(self, problem: Problem, device: DeviceInfo, *, rule: str | None = None) -> Geometry:
        """The least of the limits' geometries for ``problem`` on ``device`` now (free memory read on a GPU)."""
        limits = []
        if self.max_slab is not None:
            limits.append(SlabBudget(self.max_slab).geometry(problem, device))
        cap = self.cap_strategy()
        if cap is not None:
            limits.append(checked_geometry(cap, problem, device))
        if self.free_memory is not None and device.index is not None:
            limits.append(FreeMemory(fraction=self.free_memory).geometry(problem, device))
        if not limits:  # free_memory alone, planned without a GPU: one chunk, as free memory would decide there
            limits.append(Geometry.for_problem(problem, problem.tokens))
        least = min(limits, key=lambda g: (g.chunk_size, g.vocab_chunk))
        return Geometry.for_problem(
            problem, least.chunk_size, vocab_chunk=min(g.vocab_chunk for g in limits), accum_dtype=least.accum_dtype,
            strategy=repr(self), rule=rule,
        )  # fmt: skip

    def seeded_pick(self, problem: Problem) -> BucketPick | None:
        """What ``picks`` gives ``problem``'s BT bucket (:func:`~flce_policy.plan.measuring.bucket_problem`), or
        None: the entry of most tokens in it, a chunk of all its tokens as the top's rows (one chunk at every BT)."""
        bucket = bucket_problem(problem)
        shape = (bucket.tokens, bucket.hidden, bucket.vocab, bucket.dtype)
        found = [pick for pick in self.picks or () if _bucket_of(pick) == shape]
        if not found:
            return None
        pick = max(found, key=lambda p: p["tokens"])
        rows = bucket.tokens if pick["chunk_size"] >= pick["tokens"] else pick["chunk_size"]
        return BucketPick(rows, bucket.vocab, pick.get("slab_form", "logits"), f"picks ({self!r})")

    def _checked_pick(self, pick: Any) -> None:
        if not isinstance(pick, dict) or not {"tokens", "hidden", "vocab", "chunk_size"} <= set(pick):
            raise StrategyError(
                f"measured: each of picks is {{tokens, hidden, vocab, chunk_size, slab_form}}, got {pick!r}",
                param="picks",
            )
        unknown = set(pick) - _PICK_KEYS
        sizes = [pick[k] for k in ("tokens", "hidden", "vocab", "chunk_size")]
        if unknown or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes):
            raise StrategyError(
                f"measured: picks: {pick!r} has unknown keys or sizes that are not positive", param="picks"
            )
        if pick.get("slab_form", "logits") not in FORM_ORDER:
            raise StrategyError(f"measured: picks: slab_form must be one of {', '.join(FORM_ORDER)}", param="picks")

    def to_config(self) -> dict[str, Any]:
        config = super().to_config()
        nested_config(self, "cap", config)
        return config


def _bucket_of(pick: dict[str, Any]) -> tuple[int, int, int, str]:
    dtype = pick.get("dtype", "bfloat16")
    bucket = bucket_problem(Problem(pick["tokens"], pick["hidden"], pick["vocab"], dtype))
    return bucket.tokens, bucket.hidden, bucket.vocab, bucket.dtype


def _check_count(value: Any, param: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise StrategyError(f"measured: {param} must be an integer >= {least}, got {value!r}", param=param)


def _wrapped(check: Any, param: str) -> None:
    try:
        check()
    except StrategyError as err:
        message = str(err).split(": ", 2)[-1]
        raise StrategyError(f"measured: {param}: {message}", param=param) from None
