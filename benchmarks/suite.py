"""Run the methods over the shapes and collect one record per (shape, method)."""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from .measure import Measurement, measure, peak_bytes, rotated, time_sample, warm_up
from .methods import Inputs, Method, Unavailable, make_inputs

__all__ = [
    "Record",
    "run_suite",
    "DEFAULT_SHAPES",
    "SHAPE_SETS",
    "parse_shape",
    "parse_shapes",
    "expand_shapes",
    "format_shape",
    "with_floor_ratios",
]

Shape = tuple[int, int, int]  # (BT, H, V)

DEFAULT_SHAPES: tuple[Shape, ...] = (
    (4096, 1024, 32768),
    (8192, 5376, 262144),
    (32768, 5376, 262144),
    (32768, 4096, 128256),
)

#: Named sets for ``--shapes``: the heads of the 0.5B-3B models most people fine-tune on one GPU
#: (Qwen2.5-0.5B, 1024x131072, Gemma-3-1B, Llama-3.2-1B, Qwen3-1.7B, Llama-3.2-3B) at 16384 tokens,
#: the large heads (Gemma-4 31B at 8k and 32k tokens, Llama-3 8B at 32k), and the softcapped heads (Gemma-2 2B and
#: 9B at 16384 tokens, Gemma-4 31B at 8k: the ``*_softcap30_*`` rows).
SHAPE_SETS: dict[str, tuple[Shape, ...]] = {
    "default": DEFAULT_SHAPES,
    "small-heads": (
        (16384, 896, 151936),
        (16384, 1024, 131072),
        (16384, 1152, 262144),
        (16384, 2048, 128256),
        (16384, 2048, 151936),
        (16384, 3072, 128256),
    ),
    "large-heads": ((8192, 5376, 262144), (32768, 5376, 262144), (32768, 4096, 128256)),
    "softcap-heads": ((16384, 2304, 256000), (16384, 3584, 256000), (8192, 5376, 262144)),
}

_SHAPE_RE = re.compile(r"\s*([0-9]+)\s*[x×]\s*([0-9]+)\s*[x×]\s*([0-9]+)\s*", re.ASCII | re.IGNORECASE)


@dataclass
class Record:
    """One (shape, method) result. Times in ms, memory in bytes; ``status`` is "ok" or why it did not run."""

    shape: Shape
    method: str
    family: str
    accum: str
    chunk_size: int | None = None  # rows per chunk the method ran (ours) or mirrors (Liger's rule)
    vocab_chunk: int | None = None  # vocab columns per tile of the geometry it ran (ours), V for row-only
    median_ms: float | None = None
    times_ms: tuple[float, ...] = ()
    peak_bytes: int | None = None  # over the inputs: max_memory_allocated minus the allocation before the call
    predicted_peak_bytes: int | None = None  # flce_policy.plan.memory.predict_peak at chunk_size
    predicted_ms: float | None = None  # flce_policy.plan.cost_model at the row's geometry
    x_floor: float | None = None  # median_ms / the gemm_floor median of the same shape and run
    status: str = "ok"
    options: dict[str, Any] = field(default_factory=dict)  # the method's (vocab_chunk, max_slab, Liger's c)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Record:
        """The inverse of :meth:`to_dict` (JSON turns tuples into lists); unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["shape"] = tuple(int(n) for n in values["shape"])
        values["times_ms"] = tuple(values.get("times_ms") or ())
        return cls(**values)

    @property
    def pred_over_meas(self) -> float | None:
        """predicted / measured peak, when both are known and the measured peak is non-zero."""
        if self.predicted_peak_bytes is None or not self.peak_bytes:
            return None
        return self.predicted_peak_bytes / self.peak_bytes


def parse_shape(text: str) -> Shape:
    """'8192x5376x262144' -> (BT, H, V); ValueError on anything else."""
    match = _SHAPE_RE.fullmatch(text)
    if match is None or any(int(n) == 0 for n in match.groups()):
        raise ValueError(f"a shape is BTxHxV with three positive integers, e.g. 8192x5376x262144; got {text!r}")
    tokens, hidden, vocab = (int(n) for n in match.groups())
    return tokens, hidden, vocab


def parse_shapes(text: str) -> tuple[Shape, ...]:
    """A shape ('16384x896x151936') or the name of a set in :data:`SHAPE_SETS` -> its shapes."""
    named = SHAPE_SETS.get(text.strip().lower())
    if named is not None:
        return named
    try:
        return (parse_shape(text),)
    except ValueError:
        raise ValueError(
            f"a shape is BTxHxV with three positive integers, e.g. 8192x5376x262144, or one of the sets "
            f"{', '.join(SHAPE_SETS)}; got {text!r}"
        ) from None


def expand_shapes(values: Iterable[Sequence[Shape]] | None, default: Sequence[Shape] = DEFAULT_SHAPES) -> list[Shape]:
    """``--shapes`` values (tuples of shapes, from :func:`parse_shapes`) as one list, each shape once, in order."""
    if not values:
        return list(default)
    return list(dict.fromkeys(shape for value in values for shape in value))


def format_shape(shape: Sequence[int]) -> str:
    """(8192, 5376, 262144) -> '8192x5376x262144'."""
    return "x".join(str(n) for n in shape)


def with_floor_ratios(records: list[Record]) -> list[Record]:
    """Fill ``x_floor`` = median / the gemm_floor median of the same shape (same run)."""
    floors = {r.shape: r.median_ms for r in records if r.family == "floor" and r.median_ms}
    for record in records:
        floor = floors.get(record.shape)
        if floor and record.median_ms is not None:
            record.x_floor = record.median_ms / floor
    return records


def run_suite(
    shapes: Iterable[Shape],
    methods: Sequence[Method],
    *,
    logit_std: float = 4.0,
    warmup: int = 2,
    repeats: int = 5,
    predict_peak: Callable[[Method, Shape], tuple[int | None, int | None]] | None = None,
    predict_time: Callable[[Method, Shape], float | None] | None = None,
    vocab_chunk: Callable[[Method, Shape], int | None] | None = None,
    on_start: Callable[[Shape, Method], None] | None = None,
    on_record: Callable[[Record], None] | None = None,
    inputs_for: Callable[[Shape], Inputs] | None = None,
    busy_start: bool = False,
    interleave: bool = False,
    sustained_s: float | None = None,
) -> list[Record]:
    """Measure every method at every shape; a method that cannot run gets a record saying why.

    ``predict_peak(method, shape)`` returns (chunk_size, predicted peak bytes) for our rows;
    ``predict_time(method, shape)`` the cost model's fwd+bwd milliseconds; ``vocab_chunk(method,
    shape)`` the vocab tile of the geometry our rows run. ``inputs_for(shape)`` gives the inputs of
    a shape (e.g. a trained model's, whose shape is fixed); by default random ones at ``logit_std``.
    ``busy_start``: each timed call after a sleep kernel (:func:`.measure.measure`). ``interleave``: a shape's
    methods are built and warmed together, then timed in rounds, one call of each per round, each round starting
    one row later than the last, so a drift of the GPU's clocks or temperature over the shape's rows, or the row
    before, reaches every row alike (their steps are held at once: the floor's two ``[BT, V]`` buffers beside the
    others); peaks are taken after the rounds, one row at a time. ``sustained_s``: each sample is the mean call of
    that many seconds of calls back to back (:func:`.measure.time_sustained`), not one call.
    """
    timing = dict(busy_start=busy_start, sustained_s=sustained_s)
    records: list[Record] = []
    for shape in shapes:
        inputs = make_inputs(*shape, logit_std=logit_std) if inputs_for is None else inputs_for(shape)
        attempts = []
        for method in methods:
            if on_start is not None:
                on_start(shape, method)
            record = Record(shape=shape, method=method.name, family=method.family, accum=method.accum)
            _plan(record, method, shape, predict_peak, predict_time, vocab_chunk)
            attempt = _Attempt(record, method, inputs)
            if interleave:
                attempt.run(lambda a: warm_up(a.ready(), warmup))
                attempts.append(attempt)
                continue
            attempt.run(lambda a: a.measured(measure(a.ready(), warmup=warmup, repeats=repeats, **timing)))
            attempt.close()
            records.append(record)
            if on_record is not None:
                on_record(record)
        for round_index in range(repeats):  # interleaved rows only: the others are done
            for attempt in rotated(attempts, round_index):  # each round starts one row later
                attempt.run(lambda a: a.timed(time_sample(a.step, **timing)))
        for attempt in attempts:
            attempt.run(lambda a: a.measured(Measurement(a.record.times_ms, peak_bytes(a.step))))
            attempt.close()
            records.append(attempt.record)
            if on_record is not None:
                on_record(attempt.record)
        del inputs, attempts
        gc.collect()
        torch.cuda.empty_cache()
    return with_floor_ratios(records)


def _plan(
    record: Record,
    method: Method,
    shape: Shape,
    predict_peak: Callable[[Method, Shape], tuple[int | None, int | None]] | None,
    predict_time: Callable[[Method, Shape], float | None] | None,
    vocab_chunk: Callable[[Method, Shape], int | None] | None,
) -> None:
    """The record's geometry and the models' predictions, before anything runs."""
    record.chunk_size = method.chunk_size
    record.options = dict(method.options)
    if predict_peak is not None:
        chunk, predicted = predict_peak(method, shape)
        record.chunk_size = chunk if chunk is not None else record.chunk_size
        record.predicted_peak_bytes = predicted
    if predict_time is not None:
        record.predicted_ms = predict_time(method, shape)
    if vocab_chunk is not None:
        record.vocab_chunk = vocab_chunk(method, shape)


class _Attempt:
    """One row's step while it is measured; the first failure goes into its record's status and ends it."""

    def __init__(self, record: Record, method: Method, inputs: Inputs) -> None:
        self.record, self.method, self.inputs = record, method, inputs
        self.step: Callable[[], None] | None = None

    def ready(self) -> Callable[[], None]:
        if self.step is None:
            self.step = self.method.build(self.inputs)
        return self.step

    def timed(self, ms: float) -> None:
        self.record.times_ms = (*self.record.times_ms, ms)

    def measured(self, result: Measurement) -> None:
        self.record.median_ms, self.record.times_ms = result.median_ms, result.times_ms
        self.record.peak_bytes = result.peak_bytes

    def run(self, action: Callable[[_Attempt], None]) -> None:
        if self.record.status != "ok":
            return
        try:
            action(self)
        except Unavailable as why:
            self.record.status = str(why)
        except torch.cuda.OutOfMemoryError:
            self.record.status = "out of memory"
        except Exception as err:  # one broken peer must not cost the rest of a long run
            first_line = (str(err).strip().splitlines() or [""])[0][:200]
            self.record.status = f"error: {type(err).__name__}: {first_line}"
        if self.record.status != "ok":
            self.close()

    def close(self) -> None:
        """Drop the step (its buffers) and give the memory back before the next row allocates."""
        self.step = None
        self.inputs = None
        gc.collect()
        torch.cuda.empty_cache()
