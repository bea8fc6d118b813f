"""The rescue-scheme pricer (flce_policy.benchmarks.rescue_schemes) against fp64 torch and Monte Carlo draws."""

from __future__ import annotations

import math

import pytest
import torch

from flce_policy.benchmarks.rescue_schemes import Scheme, rescue_weights, scheme_row, tile_stats
from flce_policy.plan.weight_filter import FILTER_COLS, FILTER_ROWS

TOKENS, HIDDEN, VOCAB = 256, 16, 1024


def peaked(seed: int = 0):
    """A trained-like head: a frequency bias from 3 to -9 along the vocabulary (x's last column is 1), targets drawn
    from the model's own softmax, a few ignored."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    x[:, -1] = 1.0
    w = torch.randn(VOCAB, HIDDEN, generator=g) * (1.5 / HIDDEN**0.5)
    w[:, -1] = torch.linspace(3.0, -9.0, VOCAB)
    y = torch.multinomial((x @ w.T).softmax(-1), 1, generator=g).squeeze(1)
    y[:5] = -100
    return x, w, y


def grads64(x, w, y):
    g = (x.double() @ w.double().T).softmax(-1)
    valid = y >= 0
    g[~valid] = 0.0
    g[valid.nonzero().squeeze(1), y[valid]] -= 1.0
    return g


def tile_view(t: torch.Tensor, rows: int = FILTER_ROWS, cols: int = FILTER_COLS) -> torch.Tensor:
    return t.view(TOKENS // rows, rows, VOCAB // cols, cols)


def expand(mask: torch.Tensor, rows: int = FILTER_ROWS, cols: int = FILTER_COLS) -> torch.Tensor:
    return mask.repeat_interleave(rows, 0).repeat_interleave(cols, 1).double()


def kept_tiles(g: torch.Tensor, y: torch.Tensor, eps: float, rows: int = FILTER_ROWS, cols: int = FILTER_COLS):
    largest = tile_view(g.abs(), rows, cols).amax(dim=(1, 3))
    holds = torch.zeros_like(largest, dtype=torch.bool)
    valid = y >= 0
    holds[valid.nonzero().squeeze(1) // rows, y[valid] // cols] = True
    return (largest >= eps) | holds, largest


@pytest.mark.parametrize("tile", [(FILTER_ROWS, FILTER_COLS), (32, 64)], ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("eps", [2.0**-6, 2.0**-10])
def test_skip_error_and_share_against_fp64(eps, tile):
    """The default tile is the filter's; another tile shape (the pricer's --tiles) is priced on its own tiles."""
    x, w, y = peaked()
    rows, cols = tile
    stats = tile_stats(x, w, y, [eps], chunk_rows=128, tile_rows=rows, tile_cols=cols)
    row = scheme_row(stats, Scheme(eps, "skip"))
    g = grads64(x, w, y)
    kept, _ = kept_tiles(g, y, eps, rows, cols)
    assert stats.largest.shape == kept.shape
    ref = g.T @ x.double()
    dropped = (g * expand(~kept, rows, cols)).T @ x.double()
    assert 0.05 < 1 - kept.double().mean() < 0.95  # something dropped, something kept
    assert row["multiplied"] == pytest.approx(kept.double().mean().item(), abs=1e-9)
    assert row["filter_error"] == pytest.approx((dropped.norm() / ref.norm()).item(), rel=1e-4)


@pytest.mark.parametrize("scheme", [Scheme(2.0**-8, "uniform", 4), Scheme(2.0**-8, "level", 4)], ids=lambda s: s.label)
def test_rescue_expectations_against_monte_carlo(scheme):
    """Rescue each dropped tile with probability 1/weight, count it weight times, in fp64: the mean squared error over
    draws and the mean multiplied share match the expected ones the pricer computes from the tiles' Grams."""
    x, w, y = peaked(1)
    row = scheme_row(tile_stats(x, w, y, [scheme.eps], chunk_rows=128), scheme, dense_error=0.002)
    g = grads64(x, w, y)
    kept, largest = kept_tiles(g, y, scheme.eps)
    weights = rescue_weights(largest.float(), scheme).double()
    ref = g.T @ x.double()
    gen = torch.Generator().manual_seed(2)
    squared, shares, draws = 0.0, 0.0, 400
    for _ in range(draws):
        picked = torch.rand(kept.shape, generator=gen, dtype=torch.float64) < 1.0 / weights
        scale = torch.where(kept, 1.0, torch.where(picked, weights, 0.0))
        squared += ((g * expand(scale)).T @ x.double() - ref).norm().item() ** 2
        shares += (kept | picked).double().mean().item()
    assert row["filter_error"] == pytest.approx(math.sqrt(squared / draws) / ref.norm().item(), rel=0.1)
    assert row["multiplied"] == pytest.approx(shares / draws, abs=0.01)
    assert row["total_error"] == pytest.approx(math.hypot(0.002, row["filter_error"]))
    assert row["over_dense"] == pytest.approx(row["total_error"] / 0.002)


def test_level_weights_double_per_octave_under_eps_up_to_the_cap():
    eps = 2.0**-12
    largest = torch.tensor([0.75 * eps, 0.5 * eps, 0.3 * eps, 0.2 * eps, 1e-30, 0.0])
    assert rescue_weights(largest, Scheme(eps, "level", 3)).tolist() == [2.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert rescue_weights(largest, Scheme(eps, "uniform", 16)).tolist() == [16.0] * 6
    with pytest.raises(ValueError, match="rescues nothing"):
        rescue_weights(largest, Scheme(eps, "skip"))


def test_partial_tiles_are_refused():
    x, w, y = peaked()
    with pytest.raises(ValueError, match="whole tiles only"):
        tile_stats(x[:100], w, y[:100])


def test_command_line_on_a_cache_file_with_the_accuracy_json(tmp_path, capsys):
    """The GPU suite's call: a cache file, the dense error taken from the accuracy benchmark's JSON, rows written."""
    import json

    from flce_policy.benchmarks.rescue_schemes import DEFAULT_SCHEMES, main

    x, w, y = peaked()
    torch.save({"x": x.bfloat16(), "weight": w.bfloat16(), "target": y, "key": "tiny"}, tmp_path / "cache.pt")
    accuracy = [
        {"method": "liger_c16_bf16", "grad_weight_error": 0.5},
        {"method": "ours_default_bf16", "grad_weight_error": 0.002},
    ]
    (tmp_path / "accuracy.json").write_text(json.dumps(accuracy))
    out = tmp_path / "rows.json"
    args = ["--inputs", str(tmp_path / "cache.pt"), "--accuracy", str(tmp_path / "accuracy.json"), "--out", str(out)]
    assert main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["eps"], r["scheme"]) for r in rows] == [(s.eps, s.label) for s in DEFAULT_SCHEMES]
    assert all(r["total_error"] == pytest.approx(math.hypot(0.002, r["filter_error"])) for r in rows)
    assert "level 8" in capsys.readouterr().out
    assert main(args + ["--tiles", "64x128", "32x64"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tile"] for r in rows] == ["64x128"] * len(DEFAULT_SCHEMES) + ["32x64"] * len(DEFAULT_SCHEMES)
    with pytest.raises(SystemExit):
        main(args + ["--tiles", "64by128"])
    (tmp_path / "accuracy.json").write_text(json.dumps(accuracy[:1]))
    with pytest.raises(SystemExit):
        main(args)
