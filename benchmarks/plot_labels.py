"""The bench plot's point labels: which points get one, what it says, and a place where it overlaps nothing.

A reader looks for the Pareto frontier, our default and each peer's default; every other point is
told apart by its colour and marker in the legend, and by name in the table and ``bench.csv``.
Labels are placed one at a time, the defaults first: at the nearest of rings of offsets around
the point where the text stays inside the axes and overlaps no marker and no label placed before
it. A frontier label that finds no such place is left out; a default's takes the place that
overlaps least. Points of one family that coincide on the plot share a label.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .methods import PEER_DEFAULTS
from .suite import Record

__all__ = ["LABEL_GID", "Label", "label_text", "place_labels"]

#: The gid of every label artist, so tests (and readers of the figure) can find them.
LABEL_GID = "point-label"
_RINGS = (5, 11, 18, 27, 38, 52, 70)  # offsets from the point, in points
_DIRECTIONS = ((1, 0), (-1, 0), (1, 1), (1, -1), (-1, 1), (-1, -1), (0, 1), (0, -1))
_LEADER_FROM = 18  # labels this far from their point get a thin line back to it
_SAME_SPOT_PX = 4  # markers closer than this look like one point
_PAD_PX = 2.5


@dataclass
class Label:
    """One label to place: the point (data coordinates), its text and colour, the marker's size."""

    xy: tuple[float, float]
    text: str
    colour: str
    marker: str
    marker_area: float  # scatter's s, in points squared
    must: bool  # a default: placed even where every place overlaps something


def is_default(r: Record) -> bool:
    """Our default policy's rows and each peer's default (:data:`~.methods.PEER_DEFAULTS`)."""
    return r.family == "ours default" or r.method in PEER_DEFAULTS


def label_text(r: Record) -> str:
    """A short name: "default (4096)", "2048", "1 chunk (8192)", "tiles 16384", "fastest 1GiB", "Liger c1 (256)"."""
    chunk = "" if r.chunk_size is None else f" ({r.chunk_size})"
    if r.family == "ours default":
        return f"default{chunk}"
    if r.family == "ours fixed":
        return f"1 chunk{chunk}" if r.method.startswith("ours_one_chunk") else str(r.chunk_size)
    tiles = re.fullmatch(r"ours_vtile(\d+)_(?:bf16|fp32)", r.method)
    if tiles:
        return f"tiles {tiles[1]}"
    fastest = re.fullmatch(r"ours_fastest(\w+?)(?:_peak(\w+))?_(?:bf16|fp32)", r.method)
    if fastest:
        return f"fastest {fastest[1]}" + (f", peak {fastest[2]}" if fastest[2] else "")
    if r.family == "liger":
        return f"Liger {r.method.split('_')[1]}{chunk}"  # liger_c16_bf16 -> Liger c16 (2048)
    if r.family == "ours filtered":
        return f"filter 2^-{r.method.removeprefix('ours_filter').split('_')[0]}{chunk}"
    if r.family == "ours within peak":
        rows = ", row-scaled" if "_rows_" in r.method else ""
        return f"within Liger c16's peak{rows}{chunk}"
    return {"cce": "CCE", "cce_nofilter": "CCE, no filter", "quack": "QuACK"}.get(r.method, r.method)


def place_labels(
    ax: Any, labels: Sequence[Label], markers: Sequence[Label], renderer: Any, *, hlines: Sequence[float] = ()
) -> None:
    """Annotate ``ax`` with ``labels`` (in order), clear of one another, of every marker in ``markers``, of
    the horizontal lines at ``hlines`` (data y) and of the axes' edges. Needs the figure laid out (drawn
    once) so data map to their final pixels."""
    from matplotlib.transforms import Bbox

    px_per_pt = ax.figure.dpi / 72
    inside = ax.get_window_extent(renderer).padded(-_PAD_PX)
    taken = [_marker_box(ax, m, px_per_pt, Bbox) for m in markers]
    for y in hlines:
        at = ax.transData.transform((1.0, y))[1]
        taken.append(Bbox([[inside.x0, at - 1], [inside.x1, at + 1]]))
    for label in _merged(ax, labels):
        best: tuple[float, tuple[float, float], float] | None = None
        for radius in _RINGS:
            for dx, dy in _DIRECTIONS:
                scale = radius * (0.75 if dx and dy else 1.0)
                offset = (dx * scale, dy * scale)
                trial = _draw(ax, label, offset)
                box = _text_box(trial, renderer)
                trial.remove()
                if not _within(box, inside):
                    continue
                clash = sum(_overlap(box, other) for other in taken)
                if best is None or clash < best[0]:
                    best = (clash, offset, radius)
                if clash == 0:
                    break
            if best is not None and best[0] == 0:
                break
        if best is None or (best[0] > 0 and not label.must):
            continue  # no clean place: the legend and the table name it
        _, offset, radius = best
        taken.append(_text_box(_draw(ax, label, offset, leader=radius >= _LEADER_FROM), renderer))


def _merged(ax: Any, labels: Sequence[Label]) -> list[Label]:
    """``labels`` with those of coinciding points of one family (same marker and colour, a few pixels
    apart) joined into the first."""
    merged: list[Label] = []
    for label in labels:
        at = ax.transData.transform(label.xy)
        for kept in merged:
            near = abs(ax.transData.transform(kept.xy) - at).max() < _SAME_SPOT_PX
            if near and (kept.marker, kept.colour) == (label.marker, label.colour):
                kept.text += f" = {label.text}"
                kept.must = kept.must or label.must
                break
        else:
            merged.append(Label(**vars(label)))
    return merged


def _draw(ax: Any, label: Label, offset: tuple[float, float], *, leader: bool = False) -> Any:
    dx, dy = offset
    style = {
        "fontsize": 7.5,
        "color": label.colour,
        "ha": "left" if dx > 0 else "right" if dx < 0 else "center",
        "va": "bottom" if dy > 0 else "top" if dy < 0 else "center",
        "gid": LABEL_GID,
        "zorder": 4,
    }
    if leader:
        style["arrowprops"] = {"arrowstyle": "-", "color": label.colour, "lw": 0.6, "alpha": 0.7, "shrinkB": 3}
    return ax.annotate(label.text, label.xy, xytext=offset, textcoords="offset points", **style)


def _text_box(artist: Any, renderer: Any) -> Any:
    """The text's own box, without its leader line (an Annotation's extent includes the arrow)."""
    from matplotlib.text import Text

    artist.update_positions(renderer)
    return Text.get_window_extent(artist, renderer).padded(_PAD_PX)


def _marker_box(ax: Any, marker: Label, px_per_pt: float, bbox: Any) -> Any:
    x, y = ax.transData.transform(marker.xy)
    half = marker.marker_area**0.5 * px_per_pt / 2
    return bbox([[x - half, y - half], [x + half, y + half]])


def _within(box: Any, outer: Any) -> bool:
    return box.x0 >= outer.x0 and box.x1 <= outer.x1 and box.y0 >= outer.y0 and box.y1 <= outer.y1


def _overlap(a: Any, b: Any) -> float:
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return width * height if width > 0 and height > 0 else 0.0
