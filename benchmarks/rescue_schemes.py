"""What a grad_weight filter's dropped tiles cost in error, per way of treating them, computed exactly.

For ``x [T, H]``, ``weight [V, H]`` and targets, per token G = softmax(x @ W.T) - onehot(target) (fp32, unscaled;
ignored tokens 0), tiled as the filter tiles it (:mod:`flce_policy.plan.weight_filter`: ``FILTER_ROWS`` tokens x
``FILTER_COLS`` classes; ``--tiles`` prices other shapes, what a finer tile would buy). Tile t has its largest
|G|, ``m_t`` (a tile holding a target is always kept), and its contribution to grad_weight = Gᵀx,
``c_t = G_tᵀ x_t``; ``||c_t||²`` comes from the two Grams ``G_t G_tᵀ`` and ``x_t x_tᵀ`` (no ``[FILTER_COLS, H]``
block per tile). A filter at ``eps`` keeps the tiles with ``m_t >= eps``;
the others, per scheme:

- ``skip``: dropped. The filter's error is the norm of the dropped tiles' sum (a bias: one masked GEMM per eps).
- ``uniform N``: each kept with probability 1/N and counted N times (``grad_weight_filter_rescue=N`` until
  2026-12-02; not in the kernel since). Unbiased; independent draws, so the expected squared error is
  ``sum (N - 1) ||c_t||²``.
- ``level K``: kept with probability 2^-L and counted 2^L times, L = min(K, max(1, ceil(log2(eps / m_t)))): the tiles
  just under eps, which carry most of the dropped mass, are kept often, the tiny ones rarely. Unbiased, exact in
  floating point; expected squared error ``sum (2^L - 1) ||c_t||²``. The kernel's rescue: ``grad_weight_filter_rescue
  =2^K`` (since 2026-12-02; its measured errors on the trained inputs within 3% of these predictions).

Each row gives the multiplied share of tiles (kept plus expected rescued: what the kernel's time follows), the
filter's own error relative to ||grad_weight|| and, with the dense call's measured error ``dense_error``, the
total predicted as ``hypot(dense_error, filter_error)`` (the rounding and the filter independent) and its ratio to
``dense_error``. Everything runs ``chunk_rows`` tokens at a time.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flce_policy.plan.weight_filter import FILTER_COLS, FILTER_ROWS

__all__ = ["DEFAULT_SCHEMES", "Scheme", "TileStats", "rescue_weights", "scheme_report", "tile_stats"]


@dataclass(frozen=True)
class Scheme:
    """``kind`` "skip", "uniform" (``arg`` = N) or "level" (``arg`` = K, the largest level) at ``eps``."""

    eps: float
    kind: str
    arg: int | None = None

    @property
    def label(self) -> str:
        return self.kind if self.arg is None else f"{self.kind} {self.arg}"


#: the accuracy benchmark's row whose grad_weight error is the dense call's
DENSE_METHOD = "ours_default_bf16"
#: 2^-13.5: between the two settings that each met one of issue 26's goals on one chunk
#: (results/2026-12-03-h200-trained-filters)
DEFAULT_EPS: tuple[float, ...] = (2.0**-11, 2.0**-12, 2.0**-13, 2.0**-13.5, 2.0**-14, 2.0**-16)
DEFAULT_SCHEMES: tuple[Scheme, ...] = tuple(
    Scheme(eps, kind, arg)
    for eps in DEFAULT_EPS
    for kind, arg in (("skip", None), ("uniform", 4), ("uniform", 16), ("level", 2), ("level", 4), ("level", 8))
)


@dataclass
class TileStats:
    """Per tile ``[row tiles, column blocks]``: ``largest`` |G|, ``has_target``, ``norm2`` = ||c_t||²; ``ref_norm`` =
    ||Gᵀx|| (fp32); ``dropped_norm[eps]`` = ||sum of c_t over the tiles a plain filter at eps drops||."""

    largest: torch.Tensor
    has_target: torch.Tensor
    norm2: torch.Tensor
    ref_norm: float
    dropped_norm: dict[float, float]


def _token_grads(xc: torch.Tensor, w: torch.Tensor, tc: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """[rows, V] fp32 softmax minus one-hot, 0 on ignored rows."""
    grad = (xc @ w.t()).softmax(dim=1)
    valid = tc != ignore_index
    grad[~valid] = 0.0
    rows = valid.nonzero().squeeze(1)
    grad[rows, tc[rows]] -= 1.0
    return grad


def tile_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    eps: Sequence[float] = DEFAULT_EPS,
    *,
    chunk_rows: int = 4096,
    ignore_index: int = -100,
    gram_bytes: int = 2**30,
    tile_rows: int = FILTER_ROWS,
    tile_cols: int = FILTER_COLS,
) -> TileStats:
    """The tiles' statistics of ``x [T, H]``, ``weight [V, H]``, ``target [T]`` (T a multiple of ``tile_rows``, V
    of ``tile_cols``: by default the filter's tile); ``gram_bytes`` bounds the G Grams held at once."""
    tokens, hidden = x.shape
    vocab = weight.shape[0]
    if tokens % tile_rows or vocab % tile_cols or chunk_rows % tile_rows:
        raise ValueError(
            f"tokens ({tokens}), chunk_rows ({chunk_rows}) must be multiples of {tile_rows} and the vocabulary "
            f"({vocab}) of {tile_cols}: whole tiles only"
        )
    blocks = vocab // tile_cols
    w = weight.float()
    ref = torch.zeros_like(w)
    dropped = {e: torch.zeros_like(w) for e in eps}
    largest, has_target, norm2 = [], [], []
    for start in range(0, tokens, chunk_rows):
        xc = x[start : start + chunk_rows].float()
        tc = target[start : start + chunk_rows]
        grad = _token_grads(xc, w, tc, ignore_index)
        tiles = xc.shape[0] // tile_rows
        ref += grad.t() @ xc
        g = grad.view(tiles, tile_rows, blocks, tile_cols)
        largest.append(g.abs().amax(dim=(1, 3)))
        holds = torch.zeros(tiles, blocks, dtype=torch.bool, device=x.device)
        rows = (tc != ignore_index).nonzero().squeeze(1)
        holds[rows // tile_rows, tc[rows] // tile_cols] = True
        has_target.append(holds)
        x_tiles = xc.view(tiles, tile_rows, hidden)
        x_gram = x_tiles @ x_tiles.transpose(1, 2)
        chunk_norm2 = torch.empty(tiles, blocks, device=x.device)
        step = max(1, gram_bytes // (tiles * tile_rows * tile_rows * 4))
        for b in range(0, blocks, step):
            part = g[:, :, b : b + step].permute(0, 2, 1, 3)  # [tiles, blocks, rows, cols]
            chunk_norm2[:, b : b + step] = ((part @ part.transpose(2, 3)) * x_gram[:, None]).sum(dim=(2, 3))
        norm2.append(chunk_norm2)
        for e in eps:
            drop = (largest[-1] < e) & ~holds
            mask = drop.repeat_interleave(tile_rows, 0).repeat_interleave(tile_cols, 1)
            dropped[e] += (grad * mask).t() @ xc
    return TileStats(
        torch.cat(largest),
        torch.cat(has_target),
        torch.cat(norm2),
        ref.norm().item(),
        {e: d.norm().item() for e, d in dropped.items()},
    )


def rescue_weights(largest: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Per tile, the count a rescued tile is multiplied by (the inverse of its probability), for a rescuing scheme."""
    if scheme.kind == "uniform":
        return torch.full_like(largest, float(scheme.arg))
    if scheme.kind == "level":
        octaves = torch.ceil(torch.log2(scheme.eps / largest.clamp_min(torch.finfo(torch.float32).tiny)))
        return 2.0 ** octaves.clamp(1, scheme.arg)
    raise ValueError(f"scheme {scheme.kind!r} rescues nothing")


def scheme_row(stats: TileStats, scheme: Scheme, dense_error: float | None = None) -> dict[str, Any]:
    """One scheme's multiplied share, filter error and (with ``dense_error``) predicted total error."""
    kept = (stats.largest >= scheme.eps) | stats.has_target
    if scheme.kind == "skip":
        share = kept.float().mean().item()
        filter_error = stats.dropped_norm[scheme.eps] / stats.ref_norm
    else:
        weights = rescue_weights(stats.largest, scheme)
        share = (kept.float() + (~kept).float() / weights).mean().item()
        filter_error = math.sqrt(((weights - 1.0) * stats.norm2)[~kept].sum().item()) / stats.ref_norm
    row: dict[str, Any] = {
        "eps": scheme.eps,
        "scheme": scheme.label,
        "multiplied": share,
        "filter_error": filter_error,
    }
    if dense_error is not None:
        row["total_error"] = math.hypot(dense_error, filter_error)
        row["over_dense"] = row["total_error"] / dense_error
    return row


def scheme_report(
    stats: TileStats, schemes: Sequence[Scheme] = DEFAULT_SCHEMES, dense_error: float | None = None
) -> list[dict[str, Any]]:
    return [scheme_row(stats, s, dense_error) for s in schemes]


def format_report(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'eps':>7} {'scheme':>10} {'multiplied':>10} {'filter err':>10} {'total err':>9} {'x dense':>7}"]
    for r in rows:
        total = f"{r['total_error']:>9.5f} {r['over_dense']:>7.2f}" if "total_error" in r else f"{'-':>9} {'-':>7}"
        lines.append(
            f"2^{math.log2(r['eps']):<5g} {r['scheme']:>10} {r['multiplied']:>10.1%} {r['filter_error']:>10.5f} "
            + total
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from .trained_inputs import inputs_from_spec

    parser = argparse.ArgumentParser(
        prog="python -m flce_policy.benchmarks.rescue_schemes",
        description="Price a grad_weight filter's ways of treating its dropped tiles on a head's inputs.",
    )
    parser.add_argument(
        "--inputs", default="trained", help="'trained' (the bench's cache, built when missing) or a cache file"
    )
    parser.add_argument("--dense-error", type=float, default=None, help="the dense call's measured grad_weight error")
    parser.add_argument(
        "--accuracy",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"or take it from the accuracy benchmark's JSON on the same inputs (its {DENSE_METHOD} row)",
    )
    parser.add_argument(
        "--tiles",
        nargs="+",
        type=_tile_shape,
        default=[(FILTER_ROWS, FILTER_COLS)],
        metavar="ROWSxCOLS",
        help=f"tile shapes to price (tokens x classes; default the filter's, {FILTER_ROWS}x{FILTER_COLS})",
    )
    parser.add_argument("--out", type=Path, default=None, metavar="FILE", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    dense_error = args.dense_error
    if args.accuracy is not None:
        rows = [r for r in json.loads(args.accuracy.read_text()) if r.get("method") == DENSE_METHOD]
        if not rows or rows[0].get("grad_weight_error") is None:
            parser.error(f"{args.accuracy} has no grad_weight error for {DENSE_METHOD}")
        dense_error = rows[0]["grad_weight_error"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs, label = inputs_from_spec(args.inputs, device)
    if inputs is None:
        parser.error("--inputs must name trained inputs (random logits have nothing to drop)")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for tile_rows, tile_cols in args.tiles:
        stats = tile_stats(inputs.x, inputs.weight, inputs.target, tile_rows=tile_rows, tile_cols=tile_cols)
        tile_report = [
            {"tile": f"{tile_rows}x{tile_cols}"} | row for row in scheme_report(stats, dense_error=dense_error)
        ]
        print(
            f"{label}, {tile_rows}x{tile_cols} tiles: {stats.largest.numel()} tiles, "
            f"{stats.has_target.float().mean().item():.1%} holding a target"
        )
        print(format_report(tile_report))
        rows += tile_report
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"inputs": label, "rows": rows}, indent=2) + "\n")
    return 0


def _tile_shape(text: str) -> tuple[int, int]:
    """``ROWSxCOLS`` as two positive ints (argparse's type: a clear error otherwise)."""
    try:
        rows, cols = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tile shape is ROWSxCOLS, e.g. 64x128, not {text!r}") from None
    if rows <= 0 or cols <= 0:
        raise argparse.ArgumentTypeError(f"tile sides must be positive, got {text!r}")
    return rows, cols


if __name__ == "__main__":
    raise SystemExit(main())
