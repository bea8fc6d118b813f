"""The Pareto picture: fwd+bwd time against peak memory, one panel per shape, the GEMM floor as a line.

Labelled are the points a reader looks for, the Pareto frontier, our default and each peer's
default (:mod:`.plot_labels` places them clear of each other); every other point is told apart
by colour and marker in the legend, and by name in the table and ``bench.csv``. The legend takes
as many columns as fit the figure's width, so nothing is cut off at its edges.

matplotlib is imported when plotting, not with the package, so the CLI's other paths work without it.
Drawn on a bare ``Figure`` (the Agg canvas), so no pyplot state or display backend is involved.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .plot_labels import Label, is_default, label_text, place_labels
from .suite import Record

__all__ = ["plot_results", "draw_results"]

Shape = tuple[int, int, int]

_GIB = 2**30
_DPI = 130
_PANEL_INCHES = (8.0, 6.0)
FAMILY_COLOURS = {
    "ours default": "tab:red",
    "ours fixed": "tab:blue",
    "ours vocab-tiled": "tab:purple",
    "ours fastest": "tab:brown",
    "ours within peak": "tab:pink",
    "ours filtered": "tab:olive",
    "liger": "tab:orange",
    "cce": "tab:green",
    "quack": "tab:cyan",
    "eager": "tab:gray",
}
_OTHER_COLOURS = ("black",)  # families the table above does not know
ACCUM_MARKERS = {"bf16": "o", "fp32": "^"}  # fp32 grad_weight accumulation: a triangle
_SIZES = {"default": 90, "point": 40}  # scatter areas, points squared: a default stands out


def plot_results(records: Sequence[Record], metadata: dict[str, Any], path: Path) -> None:
    """Write the PNG to ``path``; ImportError when matplotlib is missing."""
    draw_results(records, metadata).savefig(path, dpi=_DPI)


def draw_results(records: Sequence[Record], metadata: dict[str, Any]) -> Any:
    """The figure, laid out, labelled and ready to save; ImportError when matplotlib is missing."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shapes = list(dict.fromkeys(r.shape for r in records))
    ncols = 1 if len(shapes) == 1 else 2
    nrows = max(1, math.ceil(len(shapes) / ncols))
    fig = Figure(figsize=(_PANEL_INCHES[0] * ncols, _PANEL_INCHES[1] * nrows + 1.5), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)  # a renderer to measure text with
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    panels = [
        (ax, _plot_shape(ax, shape, [r for r in records if r.shape == shape]))
        for ax, shape in zip(axes, shapes, strict=False)  # a 2-column grid may have one panel more than shapes
    ]
    for ax in axes[len(shapes) :]:
        ax.set_visible(False)
    fig.suptitle(_title(metadata), fontsize=11)
    _fitted_legend(fig, records)
    # Labels go where the laid-out figure has room, so the layout is fixed first and kept as it is.
    fig.canvas.draw()
    fig.set_layout_engine("none")
    renderer = fig.canvas.get_renderer()
    for ax, (labels, markers, floor) in panels:
        place_labels(ax, labels, markers, renderer, hlines=[] if floor is None else [floor])
    return fig


def _plot_shape(ax: Any, shape: Shape, rows: Sequence[Record]) -> tuple[list[Label], list[Label], float | None]:
    """Draw one panel; returns the labels it wants (most important first), every marker drawn, the floor."""
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
    markers = []
    for r in points:
        size = _SIZES["default"] if r.family == "ours default" else _SIZES["point"]
        marker = ACCUM_MARKERS.get(r.accum, "s")
        xy = (r.peak_bytes / _GIB, r.median_ms)
        ax.scatter(
            *xy,
            color=_colour(r.family),
            marker=marker,
            s=size,
            edgecolors="black" if r.family == "ours default" else "none",
            alpha=1.0 if id(r) in front else 0.4,
            zorder=3,
        )
        markers.append(Label(xy, label_text(r), _colour(r.family), marker, size, is_default(r)))
    wanted = [m for m, r in zip(markers, points, strict=True) if m.must or id(r) in front]
    labels = sorted(wanted, key=lambda m: (not m.must, m.xy[1]))  # defaults first, then the frontier by time

    title = f"BT={tokens} H={hidden} V={vocab}"
    if floor is not None:
        ax.axhline(floor, color="black", ls="--", lw=1, zorder=0)
        ax.secondary_yaxis("right", functions=(lambda y: y / floor, lambda k: k * floor)).set_ylabel("x floor")
        # From just under the floor, so the ratios are what the eye reads; room around for labels.
        top = max([floor, *(r.median_ms for r in points)])
        span = max(top - floor, 0.05 * floor)
        ax.set_ylim(floor - 0.07 * span, top + 0.08 * span)
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
    return labels, markers, floor


def _fitted_legend(fig: Any, records: Sequence[Record]) -> Any:
    """The legend under the panels, in as many columns as fit the figure's width (fewer, taller, if need be)."""
    from matplotlib.lines import Line2D

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
    title = "labelled: the Pareto frontier and the defaults; every row by name in the table and bench.csv"
    width = fig.get_window_extent().width
    for ncols in range(min(len(handles), 5), 0, -1):
        legend = fig.legend(
            handles=handles, loc="outside lower center", ncols=ncols, fontsize=9, title=title, title_fontsize=9
        )
        fig.canvas.draw()
        box = legend.get_window_extent()
        if box.x0 >= 0 and box.x1 <= width:
            return legend
        legend.remove()
    return fig.legend(handles=handles, loc="outside lower center", ncols=1, fontsize=9, title=title, title_fontsize=9)


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
        label += "\n" + "\n".join(textwrap.wrap(text, 100))
    return label


def _colour(family: str) -> str:
    if family in FAMILY_COLOURS:
        return FAMILY_COLOURS[family]
    return _OTHER_COLOURS[sum(map(ord, family)) % len(_OTHER_COLOURS)]


def _family_label(family: str) -> str:
    names = {
        "ours default": "flce-policy, default policy",
        "ours fixed": "flce-policy, fixed chunk (labelled: its rows)",
        "ours vocab-tiled": "flce-policy, vocab tiles",
        "ours fastest": "flce-policy, Fastest strategy",
    }
    return names.get(family, family)


def _title(metadata: dict[str, Any]) -> str:
    """Two lines, each short enough for one panel: what and where, then when and with what."""
    first = ["FLCE fwd+bwd: time vs peak memory"]
    for key, fmt in (("gpu", "{}"), ("logit_std", "logit std {}")):
        if metadata.get(key) is not None:
            first.append(fmt.format(metadata[key]))
    versions = ", ".join(f"{k} {metadata[k]}" for k in ("torch", "triton") if metadata.get(k))
    second = [part for part in (metadata.get("date"), versions) if part]
    return " | ".join(first) + ("\n" + " | ".join(second) if second else "")
