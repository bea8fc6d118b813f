"""How much of a head's softmax carries nothing: CE, entropy, logit spread, and skippable tiles.

For logits ``x @ W.T`` (in fp32, from the bf16 inputs) and targets, per token: p = softmax, and
G = p - onehot(target), the gradient of that token's loss before any reduction's scale (ignored
tokens have G = 0). A tile of ``r`` tokens by ``c`` vocabulary columns (a square ``t`` or a pair
``(r, c)``; ``(64, 128)`` is :mod:`flce_policy.kernels.weight_grad_filter`'s) is *skippable* at ``eps``
when every |G| in it is below eps; a tile holding a target never is (|p - 1| is near 1 there).
Tiles are counted in the natural vocab order and, given a permutation, with the columns in that
order (most frequent token first). For each (order, tile, eps) the report also gives the share of
grad_weight = Gᵀx and of grad_input = G·W that the skippable tiles carry, as a ratio of Frobenius
norms: what a grad_weight filter would drop, and why grad_input cannot be filtered.

Everything is computed ``chunk_rows`` tokens at a time, so [T, V] never exists in fp32 at once;
the grad_weight accumulators are [V, H] fp32, one per (order, tile, eps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flce_policy.plan.weight_filter import FILTER_COLS, FILTER_ROWS

__all__ = ["DEFAULT_EPS", "DEFAULT_TILES", "logit_distribution"]

DEFAULT_EPS: tuple[float, ...] = (2.0**-8, 2.0**-12, 2.0**-16)
DEFAULT_TILES: tuple[int | tuple[int, int], ...] = (64, 128, (FILTER_ROWS, FILTER_COLS))
Tile = tuple[int, int]  # (token rows, vocab columns)


def _tile_shape(tile: int | Sequence[int]) -> Tile:
    return (tile, tile) if isinstance(tile, int) else (int(tile[0]), int(tile[1]))


def _tile_label(tile: Tile) -> int | str:
    """A square tile as its side (64), another as "64x128"."""
    return tile[0] if tile[0] == tile[1] else f"{tile[0]}x{tile[1]}"


def _tile_max(values: torch.Tensor, tile: Tile) -> torch.Tensor:
    """[R, C] -> [ceil(R/r), ceil(C/c)] maxima of r x c tiles (values >= 0; padding with 0 changes none)."""
    rows, cols = values.shape
    tr, tc = tile
    padded = torch.nn.functional.pad(values, (0, -cols % tc, 0, -rows % tr))
    r, c = padded.shape
    return padded.view(r // tr, tr, c // tc, tc).amax(dim=(1, 3))


def _expand(mask: torch.Tensor, tile: Tile, rows: int, cols: int) -> torch.Tensor:
    """A per-tile mask back to [rows, cols] elements."""
    return mask.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:rows, :cols]


def logit_distribution(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_order: torch.Tensor | None = None,
    eps: Sequence[float] = DEFAULT_EPS,
    tiles: Sequence[int | tuple[int, int]] = DEFAULT_TILES,
    chunk_rows: int = 1024,
    ignore_index: int = -100,
    gradient_shares: bool = True,
) -> dict[str, Any]:
    """The distribution report of ``x [T, H]``, ``weight [V, H]``, ``target [T]`` as a JSON-ready dict.

    ``vocab_order`` (a permutation of the V ids, e.g. by descending training frequency) adds the
    "frequency" order to the tile counts. CE and entropy are means over non-ignored tokens in nats;
    ``logit_std`` is over all their logits; ``below_eps`` the share of their softmax entries < eps.
    """
    tiles = [_tile_shape(t) for t in tiles]
    if any(chunk_rows % rows for rows, _ in tiles):
        raise ValueError(f"chunk_rows {chunk_rows} must be a multiple of every tile's rows {tuple(tiles)}")
    tokens, vocab = x.shape[0], weight.shape[0]
    w = weight.float()
    orders: dict[str, torch.Tensor | None] = {"natural": None}
    if vocab_order is not None:
        orders["frequency"] = vocab_order.to(weight.device)
    combos = [(o, t, e) for o in orders for t in tiles for e in eps]
    skippable = {c: 0 for c in combos}
    n_tiles = {t: -(-tokens // t[0]) * -(-vocab // t[1]) for t in tiles}
    gw_full = torch.zeros_like(w) if gradient_shares else None
    gw_skip = {c: torch.zeros_like(w) for c in combos} if gradient_shares else {}
    gi_full_sq, gi_skip_sq = 0.0, {c: 0.0 for c in combos}
    ce_sum = ent_sum = 0.0
    logit_sum = logit_sq = 0.0
    below = {e: 0 for e in eps}
    valid_count = 0
    for start in range(0, tokens, chunk_rows):
        xc = x[start : start + chunk_rows].float()
        tc = target[start : start + chunk_rows]
        valid = tc != ignore_index
        logits = xc @ w.t()
        lse = torch.logsumexp(logits, dim=1)
        p = torch.exp(logits - lse[:, None])
        rows_v = valid.nonzero().squeeze(1)
        tv = tc[rows_v]
        ce_sum += (lse[rows_v] - logits[rows_v, tv]).sum().item()
        ent_sum += (lse - (p * logits).sum(dim=1))[rows_v].sum().item()
        logit_sum += logits[rows_v].sum(dtype=torch.float64).item()
        logit_sq += logits[rows_v].square().sum(dtype=torch.float64).item()
        for e in eps:
            below[e] += (p[rows_v] < e).sum().item()
        valid_count += rows_v.numel()
        grad = p
        grad[~valid] = 0.0
        grad[rows_v, tv] -= 1.0
        del logits, p
        if gradient_shares:
            gw_full += grad.t() @ xc
            gi_full_sq += (grad @ w).square().sum(dtype=torch.float64).item()
        for order_name, perm in orders.items():
            g = grad if perm is None else grad[:, perm]
            w_o = w if perm is None else w[perm]
            magnitude = g.abs()
            for t in tiles:
                tile_max = _tile_max(magnitude, t)
                for e in eps:
                    skip = tile_max < e
                    key = (order_name, t, e)
                    skippable[key] += skip.sum().item()
                    if gradient_shares:
                        g_skip = g * _expand(skip, t, *g.shape)
                        gw_skip[key] += g_skip.t() @ xc
                        gi_skip_sq[key] += (g_skip @ w_o).square().sum(dtype=torch.float64).item()
    entries = valid_count * vocab
    mean = logit_sum / entries
    report: dict[str, Any] = {
        "tokens": tokens,
        "hidden": x.shape[1],
        "vocab": vocab,
        "scored_tokens": valid_count,
        "ce": ce_sum / valid_count,
        "entropy": ent_sum / valid_count,
        "logit_mean": mean,
        "logit_std": max(0.0, logit_sq / entries - mean * mean) ** 0.5,
        "below_eps": [{"eps": e, "share": below[e] / entries} for e in eps],
        "tiles": [],
    }
    gw_norm = gw_full.norm().item() if gradient_shares else None
    for key in combos:
        order_name, t, e = key
        row: dict[str, Any] = {
            "order": order_name,
            "tile": _tile_label(t),
            "eps": e,
            "skippable": skippable[key] / n_tiles[t],
        }
        if gradient_shares:
            row["grad_weight_share"] = gw_skip[key].norm().item() / gw_norm if gw_norm else 0.0
            row["grad_input_share"] = (gi_skip_sq[key] / gi_full_sq) ** 0.5 if gi_full_sq else 0.0
        report["tiles"].append(row)
    return report
