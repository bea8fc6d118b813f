"""The Pareto picture: fwd+bwd time against peak memory, one subplot per shape, the GEMM floor as a line.

matplotlib is imported when plotting, not with the package, so the CLI's other paths work without it.
Drawn on a bare ``Figure`` (the Agg canvas), so no pyplot state or display backend is involved.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .suite import Record

__all__ = ["plot_results"]

Shape = tuple[int, int, int]

_GIB = 2**30
FAMILY_COLOURS = {
    "ours default": "tab:red",
    "ours fixed": "tab:blue",
    "liger": "tab:orange",
    "cce": "tab:green",
    "eager": "tab:gray",
}
ACCUM_MARKERS = {"bf16": "o", "fp32": "^"}  # fp32 grad_weight accumulation: a triangle


def plot_results(records: Sequence[Record], metadata: dict[str, Any], path: Path) -> None:
    """Write the PNG to ``path``; ImportError when matplotlib is missing."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    shapes = list(dict.fromkeys(r.shape for r in records))
    ncols = 1 if len(shapes) == 1 else 2
    nrows = max(1, math.ceil(len(shapes) / ncols))
    fig = Figure(figsize=(8 * ncols, 6 * nrows + 1), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, shape in zip(axes, shapes, strict=False):
        _plot_shape(ax, shape, [r for r in records if r.shape == shape])
    for ax in axes[len(shapes) :]:
        ax.set_visible(False)

    families = list(dict.fromkeys(r.family for r in records if r.family != "floor" and r.median_ms is not None))
    handles = [
        Line2D([], [], color=_colour(f), marker="o", ls="", markersize=8, label=_family_label(f)) for f in families
    ]
    handles += [
        Line2D([], [], color="black", marker=m, ls="", fillstyle="none", label=f"{accum} grad_weight accumulation")
        for accum, m in ACCUM_MARKERS.items()
    ]
    handles += [
        Line2D([], [], color="black", ls="--", label="three-GEMM floor (right axis: x floor)"),
        Line2D([], [], color="gray", marker="o", ls="", alpha=0.4, label="faded: another point is faster and smaller"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), fontsize=9)
    fig.suptitle(_title(metadata), fontsize=11)
    fig.savefig(path, dpi=130)


def _plot_shape(ax: Any, shape: Shape, rows: Sequence[Record]) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    tokens, hidden, vocab = shape
    floor = next((r.median_ms for r in rows if r.family == "floor" and r.median_ms), None)
    # A zero peak (the floor's preallocated buffers) has no place on a log axis, and is not a choice anyway.
    points = [r for r in rows if r.family != "floor" and r.median_ms is not None and r.peak_bytes]

    for accum in ACCUM_MARKERS:
        curve = sorted((r for r in points if r.family == "ours fixed" and r.accum == accum), key=_chunk_key)
        if len(curve) > 1:  # our fixed chunks as a curve: what each doubling of the slab buys
            xs, ys = [r.peak_bytes / _GIB for r in curve], [r.median_ms for r in curve]
            ax.plot(xs, ys, color=_colour("ours fixed"), alpha=0.35, lw=1, zorder=1)
    # The Pareto picture: a point some other point beats on both time and memory is drawn faded. Fronts are
    # per accumulation, since fp32 accumulation is a precision choice, not a point on the bf16 trade-off.
    front = {id(r) for accum in ACCUM_MARKERS for r in _pareto([p for p in points if p.accum == accum])}
    for r in points:
        default = r.family == "ours default"
        xy = (r.peak_bytes / _GIB, r.median_ms)
        ax.scatter(
            *xy,
            color=_colour(r.family),
            marker=ACCUM_MARKERS.get(r.accum, "s"),
            s=90 if default else 40,
            edgecolors="black" if default else "none",
            alpha=1.0 if id(r) in front else 0.4,
            zorder=3,
        )
        label = _point_label(r, points)
        if label:
            # Each family labels on its own side, so labels of coinciding points (default = a fixed chunk,
            # Liger at the same chunk) do not print over each other.
            offset, align = _LABEL_PLACES.get(r.family, ((4, 3), "left"))
            style = {"fontsize": 7, "color": _colour(r.family), "ha": align}
            ax.annotate(label, xy, xytext=offset, textcoords="offset points", **style)

    title = f"BT={tokens} H={hidden} V={vocab}"
    if floor is not None:
        ax.axhline(floor, color="black", ls="--", lw=1, zorder=0)
        ax.secondary_yaxis("right", functions=(lambda y: y / floor, lambda k: k * floor)).set_ylabel("x floor")
        # From just under the floor, so the ratios are what the eye reads; room below for labels near it.
        top = max([floor, *(r.median_ms for r in points)])
        span = max(top - floor, 0.05 * floor)
        ax.set_ylim(floor - 0.07 * span, top + 0.05 * span)
        title += f"  (floor {floor:.1f} ms)"
    if points:
        # Peaks span orders of magnitude (a 256-row slab to the full logits): log base 2, ticks in plain GiB.
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.margins(x=0.12)  # room for the labels of the outermost points
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("fwd+bwd median (ms)")
    ax.set_xlabel(_xlabel(rows))
    ax.grid(True, alpha=0.3)


_LABEL_PLACES = {  # (offset in points, horizontal alignment) per family
    "ours fixed": ((5, 2), "left"),
    "ours default": ((6, -11), "left"),
    "liger": ((-5, 3), "right"),
    "cce": ((-5, -10), "right"),
}


def _point_label(r: Record, points: Sequence[Record]) -> str:
    """A short label: the chunk for our fixed rows, "default (2048)", "c16 (2048)" for Liger, else the name."""
    chunk = "" if r.chunk_size is None else str(r.chunk_size)
    if r.family == "ours fixed":
        if not r.method.startswith("ours_one_chunk"):
            return chunk
        same = [p for p in points if p.family == "ours fixed" and p is not r and p.chunk_size == r.chunk_size]
        return "" if any(p.accum == r.accum for p in same) else f"1 chunk ({chunk})"  # BT = a fixed chunk already
    if r.family == "ours default":
        return f"default ({chunk})"
    if r.family == "liger":
        return r.method.split("_")[1] + (f" ({chunk})" if chunk else "")  # liger_c16_bf16 -> c16 (2048)
    return r.method


def _chunk_key(r: Record) -> int:
    return r.chunk_size if r.chunk_size is not None else r.shape[0]


def _pareto(points: Sequence[Record]) -> list[Record]:
    """The points no other point beats: at most as much memory and time, and less of one (exact ties stay)."""

    def beats(p: Record, r: Record) -> bool:
        at_most = p.peak_bytes <= r.peak_bytes and p.median_ms <= r.median_ms
        return at_most and (p.peak_bytes, p.median_ms) != (r.peak_bytes, r.median_ms)

    return [r for r in points if not any(beats(p, r) for p in points)]


def _xlabel(rows: Sequence[Record]) -> str:
    missing: dict[str, list[str]] = {}
    for r in rows:
        if r.family != "floor" and (r.median_ms is None or r.peak_bytes is None):
            missing.setdefault(r.status, []).append(r.method)
    label = "peak memory over inputs (GiB)"
    if missing:
        text = "not measured: " + "; ".join(f"{', '.join(names)} ({why})" for why, names in missing.items())
        label += "\n" + "\n".join(textwrap.wrap(text, 110))
    return label


def _colour(family: str) -> str:
    return FAMILY_COLOURS.get(family, "tab:purple")


def _family_label(family: str) -> str:
    return {"ours default": "flce-policy, default policy", "ours fixed": "flce-policy, fixed chunk"}.get(family, family)


def _title(metadata: dict[str, Any]) -> str:
    parts = ["FLCE fwd+bwd: time vs peak memory"]
    for key, fmt in (("gpu", "{}"), ("logit_std", "logit std {}"), ("date", "{}")):
        if metadata.get(key) is not None:
            parts.append(fmt.format(metadata[key]))
    versions = ", ".join(f"{k} {metadata[k]}" for k in ("torch", "triton") if metadata.get(k))
    return " | ".join(parts) + (f"\n{versions}" if versions else "")
