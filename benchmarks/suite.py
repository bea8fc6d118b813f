"""Run the methods over the shapes and collect one record per (shape, method)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

from .measure import measure
from .methods import Method, Unavailable, make_inputs

__all__ = ["Record", "run_suite", "DEFAULT_SHAPES", "parse_shape", "with_floor_ratios"]

DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = (
    (4096, 1024, 32768),
    (8192, 5376, 262144),
    (32768, 5376, 262144),
    (32768, 4096, 128256),
)


@dataclass
class Record:
    shape: tuple[int, int, int]
    method: str
    family: str
    accum: str
    chunk_size: int | None = None
    median_ms: float | None = None
    times_ms: tuple[float, ...] = ()
    peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    x_floor: float | None = None
    status: str = "ok"

    def to_dict(self) -> dict:
        return asdict(self)


def parse_shape(text: str) -> tuple[int, int, int]:
    """'8192x5376x262144' -> (BT, H, V)."""
    parts = text.lower().replace("×", "x").split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"a shape is BTxHxV with three positive integers, e.g. 8192x5376x262144; got {text!r}")
    tokens, hidden, vocab = (int(p) for p in parts)
    return tokens, hidden, vocab


def with_floor_ratios(records: list[Record]) -> list[Record]:
    """Fill ``x_floor`` = median / the gemm_floor median of the same shape (same run)."""
    floors = {r.shape: r.median_ms for r in records if r.family == "floor" and r.median_ms}
    for record in records:
        floor = floors.get(record.shape)
        if floor and record.median_ms is not None:
            record.x_floor = record.median_ms / floor
    return records


def run_suite(
    shapes: Iterable[tuple[int, int, int]],
    methods: Sequence[Method],
    *,
    logit_std: float = 4.0,
    warmup: int = 2,
    repeats: int = 5,
    predict_peak: Callable[[Method, tuple[int, int, int]], tuple[int | None, int | None]] | None = None,
    on_record: Callable[[Record], None] | None = None,
) -> list[Record]:
    """Measure every method at every shape; a method that cannot run gets a record saying why.

    ``predict_peak(method, shape)`` returns (chunk_size, predicted peak bytes) for our rows.
    """
    records: list[Record] = []
    for shape in shapes:
        inputs = make_inputs(*shape, logit_std=logit_std)
        for method in methods:
            record = Record(shape=shape, method=method.name, family=method.family, accum=method.accum)
            record.chunk_size = method.chunk_size
            if predict_peak is not None:
                chunk, predicted = predict_peak(method, shape)
                record.chunk_size = chunk if chunk is not None else record.chunk_size
                record.predicted_peak_bytes = predicted
            try:
                step = method.build(inputs)
                result = measure(step, warmup=warmup, repeats=repeats)
                record.median_ms, record.times_ms, record.peak_bytes = result.median_ms, result.times_ms, result.peak_bytes
            except Unavailable as why:
                record.status = str(why)
            except torch.OutOfMemoryError:
                record.status = "out of memory"
            finally:
                step = None
                gc.collect()
                torch.cuda.empty_cache()
            records.append(record)
            if on_record is not None:
                on_record(record)
        del inputs
        gc.collect()
        torch.cuda.empty_cache()
    return with_floor_ratios(records)
