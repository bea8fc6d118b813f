"""What a run's records say: the targets summary, the terminal table, and the JSON and CSV files.

Everything here is pure over :class:`Record` lists (no GPU), so ``--from-json`` and the tests use it too.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .suite import Record, format_shape

__all__ = [
    "CHUNK256_SHAPE",
    "Check",
    "read_json",
    "render_checks",
    "render_table",
    "target_checks",
    "write_csv",
    "write_json",
]

Shape = tuple[int, int, int]

DEFAULT_MAX_X_FLOOR = 1.08  # ours_default_bf16, every shape
CHUNK256_SHAPE: Shape = (8192, 5376, 262144)
CHUNK256_MAX_X_FLOOR = 1.45  # ours_chunk256_bf16 at CHUNK256_SHAPE
PREDICTION_TOLERANCE = 0.05  # max |predicted / measured - 1| over our rows
LIGER_PEAK_TOLERANCE = 0.05  # our peak / Liger's peak - 1 at the same chunk size and accumulation
FASTEST_PICK_TOLERANCE = 1.10  # a Fastest row's time / the fastest swept row within its limits

_GIB = 2**30
CSV_COLUMNS = (
    "shape",
    "tokens",
    "hidden",
    "vocab",
    "method",
    "family",
    "accum",
    "chunk_size",
    "vocab_chunk",
    "median_ms",
    "x_floor",
    "peak_bytes",
    "predicted_peak_bytes",
    "pred_over_meas",
    "predicted_ms",
    "status",
    "times_ms",
)


@dataclass(frozen=True)
class Check:
    """One target at one shape: passed when ``value <= limit``; ``value`` None when it could not be judged.

    ``unit`` is "x" (a ratio, shown as 1.077x), "%" (a fraction, shown as 1.2%) or "+%" (signed, +1.2%).
    """

    shape: Shape
    target: str
    value: float | None
    limit: float
    unit: str
    rows: str  # the rows compared, or why the target could not be judged

    @property
    def passed(self) -> bool | None:
        return None if self.value is None else self.value <= self.limit

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


# --- targets --------------------------------------------------------------------------------------


def target_checks(records: Sequence[Record]) -> list[Check]:
    """The targets summary, per shape in record order (records must carry ``x_floor`` already)."""
    checks: list[Check] = []
    for shape in _shapes(records):
        rows = [r for r in records if r.shape == shape]
        by_name = {r.method: r for r in rows}
        checks.append(_floor_check(shape, by_name, "ours_default_bf16", "default policy x floor", DEFAULT_MAX_X_FLOOR))
        if shape == CHUNK256_SHAPE:
            checks.append(_floor_check(shape, by_name, "ours_chunk256_bf16", "chunk 256 x floor", CHUNK256_MAX_X_FLOOR))
        checks.append(_prediction_check(shape, rows))
        checks.extend(_liger_checks(shape, rows))
        checks.extend(_fastest_checks(shape, rows))
    return checks


def _shapes(records: Iterable[Record]) -> list[Shape]:
    return list(dict.fromkeys(r.shape for r in records))


def _floor_check(shape: Shape, by_name: dict[str, Record], method: str, target: str, limit: float) -> Check:
    record = by_name.get(method)
    if record is None:
        return Check(shape, target, None, limit, "x", f"{method} not in this run")
    if record.x_floor is None:
        return Check(shape, target, None, limit, "x", f"{method}: {_why_missing(record)}")
    return Check(shape, target, record.x_floor, limit, "x", method)


def _prediction_check(shape: Shape, rows: Sequence[Record]) -> Check:
    target = "max |peak pred/meas - 1| over ours"
    ours = [(r, r.pred_over_meas) for r in rows if _is_ours(r) and r.pred_over_meas is not None]
    if not ours:
        return Check(shape, target, None, PREDICTION_TOLERANCE, "%", "no row of ours with a measured peak")
    worst, ratio = max(ours, key=lambda pair: abs(pair[1] - 1))
    return Check(shape, target, abs(ratio - 1), PREDICTION_TOLERANCE, "%", f"worst of {len(ours)}: {worst.method}")


def _liger_checks(shape: Shape, rows: Sequence[Record]) -> list[Check]:
    """Our peak vs Liger's at the same chunk size and accumulation, where the chunk sizes coincide."""
    target = "peak vs Liger, same chunk"
    liger = [r for r in rows if r.family == "liger"]
    if not liger:
        return []
    checks, reasons = [], []
    for theirs in liger:
        if not theirs.peak_bytes:
            reasons.append(f"{theirs.method}: {_why_missing(theirs)}")
            continue
        mine = _ours_at(rows, theirs.chunk_size, theirs.accum)
        if mine is None:
            reasons.append(f"{theirs.method}: no row of ours measured at chunk {theirs.chunk_size}")
            continue
        value = mine.peak_bytes / theirs.peak_bytes - 1
        checks.append(Check(shape, target, value, LIGER_PEAK_TOLERANCE, "+%", f"{mine.method} vs {theirs.method}"))
    if not checks:
        checks.append(Check(shape, target, None, LIGER_PEAK_TOLERANCE, "+%", "; ".join(dict.fromkeys(reasons))))
    return checks


def _fastest_checks(shape: Shape, rows: Sequence[Record]) -> list[Check]:
    """Each cost-model pick against the fastest swept row of ours within the same limits.

    Swept rows: fixed chunks (of the pick's accumulation) and vocab tiles over one row chunk (no
    accumulator, fp32-accurate, so they count under both); within the pick's ``max_slab`` and,
    where it has one, its ``max_peak`` on the predicted peak (the limit Fastest itself applies).
    """
    checks = []
    for pick in (r for r in rows if r.family == "ours fastest"):
        target = f"{pick.method} / fastest swept"
        if pick.median_ms is None:
            checks.append(Check(shape, target, None, FASTEST_PICK_TOLERANCE, "x", _why_missing(pick)))
            continue
        max_slab, max_peak = pick.options["max_slab"], pick.options.get("max_peak")
        swept = [
            r
            for r in rows
            if r.median_ms is not None
            and (r.family == "ours vocab-tiled" or (r.family == "ours fixed" and r.accum == pick.accum))
            and _slab_bytes(r) <= max_slab
            and (max_peak is None or (r.predicted_peak_bytes or 0) <= max_peak)
        ]
        if not swept:
            checks.append(Check(shape, target, None, FASTEST_PICK_TOLERANCE, "x", "no swept row within its limits"))
            continue
        best = min(swept, key=lambda r: r.median_ms)  # type: ignore[arg-type, return-value]
        value = pick.median_ms / best.median_ms  # type: ignore[operator]
        checks.append(Check(shape, target, value, FASTEST_PICK_TOLERANCE, "x", f"vs {best.method}"))
    return checks


def _slab_bytes(record: Record) -> int:
    """The row's logits slab: chunk rows x its vocab tile (all of V without one), bf16."""
    vocab_chunk = record.vocab_chunk or record.options.get("vocab_chunk") or record.shape[2]
    return (record.chunk_size or record.shape[0]) * min(vocab_chunk, record.shape[2]) * 2


def _ours_at(rows: Sequence[Record], chunk: int | None, accum: str) -> Record | None:
    """Our row at ``chunk`` rows and ``accum`` with a measured peak; a fixed-chunk row before the default one."""
    candidates = [r for r in rows if _is_ours(r) and r.chunk_size == chunk and r.accum == accum and r.peak_bytes]
    candidates.sort(key=lambda r: r.family != "ours fixed")
    return candidates[0] if candidates and chunk is not None else None


def _is_ours(record: Record) -> bool:
    return record.family.startswith("ours")


def _why_missing(record: Record) -> str:
    return record.status if record.status != "ok" else "not measured"


# --- terminal -------------------------------------------------------------------------------------


def render_table(records: Sequence[Record], console: Console, *, title: str = "") -> None:
    """The results table: one row per (shape, method), a section per shape."""
    table = Table(title=title or None, caption=_CAPTION)
    for name, justify in _COLUMNS:
        table.add_column(name, justify=justify)
    for i, shape in enumerate(_shapes(records)):
        if i:
            table.add_section()
        for r in (r for r in records if r.shape == shape):
            predicted = _gib(r.predicted_peak_bytes)
            if r.family == "liger" and r.predicted_peak_bytes is not None:
                predicted += "*"
            table.add_row(
                format_shape(r.shape),
                r.method,
                r.accum,
                _chunk_text(r),
                _num(r.median_ms, "{:.2f}"),
                _num(r.x_floor, "{:.3f}"),
                _gib(r.peak_bytes),
                predicted,
                _num(r.pred_over_meas, "{:.3f}"),
                _num(r.predicted_ms, "{:.1f}"),
                r.status,
            )
    console.print(table)


def _chunk_text(record: Record) -> str:
    """Rows per chunk, and "x columns" for vocab tiles narrower than V."""
    if record.chunk_size is None:
        return "-"
    vocab_chunk = record.vocab_chunk or record.options.get("vocab_chunk")
    tiles = f"x{vocab_chunk}" if vocab_chunk and vocab_chunk < record.shape[2] else ""
    return f"{record.chunk_size}{tiles}"


_COLUMNS = (
    ("shape", "left"),
    ("method", "left"),
    ("accum", "left"),
    ("chunk (x tile)", "right"),
    ("median ms", "right"),
    ("x floor", "right"),
    ("peak GiB", "right"),
    ("predicted GiB", "right"),
    ("pred/meas", "right"),
    ("model ms", "right"),
    ("status", "left"),
)
_CAPTION = (
    "x floor = median / gemm_floor median (same run, same GPU). Peak = max allocated during one call minus before it.\n"
    "* Liger rows: our memory model at Liger's chunk (HeuristicC(c)), not Liger's own accounting.\n"
    "model ms: the cost model's prediction (flce_policy/plan/cost_model.py) at the row's geometry."
)


def render_checks(checks: Sequence[Check], console: Console) -> None:
    """The targets summary, a section per shape."""
    table = Table(title="targets")
    for name, justify in (("shape", "left"), ("target", "left"), ("value", "right"), ("limit", "right")):
        table.add_column(name, justify=justify)
    table.add_column("result")
    table.add_column("rows")
    previous = None
    for check in checks:
        if previous is not None and check.shape != previous:
            table.add_section()
        previous = check.shape
        result = {True: "pass", False: "MISS", None: "n/a"}[check.passed]
        limit = "<= " + _format(check.limit, check.unit)
        table.add_row(format_shape(check.shape), check.target, _check_value(check), limit, result, check.rows)
    console.print(table)


def _check_value(check: Check) -> str:
    return "-" if check.value is None else _format(check.value, check.unit, digits=3)


def _format(value: float, unit: str, *, digits: int = 2) -> str:
    if unit == "x":
        return f"{value:.{digits}f}x"
    return f"{value:{'+' if unit == '+%' else ''}.{digits - 2}%}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _gib(size: int | None) -> str:
    return "-" if size is None else f"{size / _GIB:.2f}"


# --- files ----------------------------------------------------------------------------------------


def write_json(path: Path, records: Sequence[Record], metadata: dict[str, Any]) -> None:
    """``{"metadata", "records", "targets"}``; targets are derived, and recomputed when read back."""
    document = {
        "metadata": metadata,
        "records": [r.to_dict() for r in records],
        "targets": [c.to_dict() for c in target_checks(records)],
    }
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def read_json(path: Path) -> tuple[list[Record], dict[str, Any]]:
    """Records and metadata of a file :func:`write_json` wrote; ValueError naming the file otherwise."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    if not isinstance(document, dict) or not isinstance(document.get("records"), list):
        raise ValueError(f"{path}: not a bench results file (expected an object with a 'records' list)")
    records = []
    for i, data in enumerate(document["records"]):
        try:
            records.append(Record.from_dict(data))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: records[{i}] is not a bench record ({err!r})") from None
    metadata = document.get("metadata")
    return records, metadata if isinstance(metadata, dict) else {}


def write_csv(path: Path, records: Sequence[Record]) -> None:
    """One line per record; bytes and ms as numbers, empty where unknown, times_ms joined by ';'."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in records:
            tokens, hidden, vocab = r.shape
            row = {**r.to_dict(), "shape": format_shape(r.shape), "tokens": tokens, "hidden": hidden, "vocab": vocab}
            row["pred_over_meas"] = r.pred_over_meas
            row["times_ms"] = ";".join(f"{t:.4f}" for t in r.times_ms)
            writer.writerow({k: "" if row[k] is None else row[k] for k in CSV_COLUMNS})
