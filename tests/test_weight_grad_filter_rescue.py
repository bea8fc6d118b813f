"""grad_weight_filter_rescue at the loss: the rescued tiles are the hash rule's at each tile's level (both written out
in torch), counted 2^L times in grad_weight and grad_bias against fp64; the loss, the extras and grad_input stay the
dense call's."""

from __future__ import annotations

import pytest
import torch
from test_loss_kernel import NEEDS_KERNEL_DEVICE, rel_err
from test_weight_grad_filter import (
    BT,
    EPS,
    FP32_TOL,
    V,
    _tiles_kept,
    assert_same,
    geometry,
    leaves,
    peaked_inputs,
    reference,
    run,
)
from test_weight_grad_filter_kernel import rescue_state, tile_scale

from flce_policy import Geometry, Problem, fused_linear_cross_entropy
from flce_policy.kernels.weight_grad_filter import observe_tiles
from flce_policy.plan.weight_filter import FILTER_COLS, FILTER_ROWS

pytestmark = NEEDS_KERNEL_DEVICE


def tile_levels(deviation: torch.Tensor, eps: float) -> torch.Tensor:
    """Per tile of one chunk and vocab tile: ceil(log2(eps / its largest per-token |p - onehot|)), at least 1."""
    n, c = deviation.shape
    padded = torch.nn.functional.pad(deviation, (0, -c % FILTER_COLS, 0, -n % FILTER_ROWS))
    top = padded.view(padded.shape[0] // FILTER_ROWS, FILTER_ROWS, -1, FILTER_COLS).amax(dim=(1, 3))
    return torch.log2(eps / top).ceil().clamp(1, 254).long()


def rescue_scale(
    keep: torch.Tensor,
    deviation: torch.Tensor,
    x: torch.Tensor,
    *,
    chunk: int,
    vocab_chunk: int,
    rescue: int,
    eps: float = EPS,
) -> torch.Tensor:
    """[BT, V] fp64: 1 on kept tiles, 2^L on ones rescued at level L, 0 on skipped, per chunk and vocab tile."""
    scale = torch.zeros(keep.shape, dtype=torch.float64)
    for start in range(0, keep.shape[0], chunk):
        rows = slice(start, min(start + chunk, keep.shape[0]))
        for col in range(0, keep.shape[1], vocab_chunk):
            cols = slice(col, min(col + vocab_chunk, keep.shape[1]))
            tiles = _tiles_kept(keep[rows, cols], chunk, vocab_chunk)[0]
            state = rescue_state(tiles, x[rows], rescue, tile_levels(deviation[rows, cols], eps))
            n, c = rows.stop - rows.start, cols.stop - cols.start
            per_tile = tile_scale(state)
            scale[rows, cols] = per_tile.repeat_interleave(FILTER_ROWS, 0)[:n].repeat_interleave(FILTER_COLS, 1)[:, :c]
    return scale


@pytest.mark.parametrize(
    ("chunk", "vocab_chunk", "seed"),
    # the first rescues a tile of level 1 (counted twice), the second two of level 2 and more (four times)
    [(64, V, 12), (BT, 256, 4)],
    ids=["row-chunks", "vocab-tiles"],
)
def test_rescued_tiles_counted_2_to_their_level_times(chunk, vocab_chunk, seed):
    rescue = 4  # levels 1 and 2 (deeper ones counted as 2): a half and a quarter of the skipped tiles rescued
    t = leaves(peaked_inputs(seed=seed), torch.float32)
    problem = Problem(tokens=BT, hidden=t["x"].shape[1], vocab=V, dtype="float32")
    policy = Geometry.for_problem(problem, chunk, vocab_chunk=vocab_chunk)
    dense = run(t, policy=policy)
    with observe_tiles() as tiles:
        rescued = run(t, policy=policy, grad_weight_filter=EPS, grad_weight_filter_rescue=rescue)
    ref = reference(t, torch.float32, eps=EPS, chunk=chunk, vocab_chunk=vocab_chunk)
    scale = rescue_scale(
        ref["keep"].cpu(), ref["deviation"].cpu(), t["x"].detach().cpu(), chunk=chunk, vocab_chunk=vocab_chunk,
        rescue=rescue,
    )  # fmt: skip
    assert (scale == {12: 2, 4: 4}[seed]).any() and (scale == 0).any()
    assert_same(rescued, dense)
    part = ref["grad"].cpu() * scale
    assert rel_err(rescued[2]["w"].cpu(), part.T @ t["x"].detach().cpu().double()) < FP32_TOL
    assert rel_err(rescued[2]["b"].cpu(), part.sum(0)) < FP32_TOL
    assert sum(int(c.rescued) for c in tiles) > 0


def test_rescue_needs_a_filter_and_a_power_of_two():
    t = leaves(peaked_inputs(), torch.float32)
    with pytest.raises(ValueError, match="grad_weight_filter_rescue=4 needs a grad_weight_filter eps"):
        run(t, policy=geometry(torch.float32), grad_weight_filter_rescue=4)
    for bad, error in ((3, ValueError), (1, ValueError), (2**17, ValueError), (4.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="grad_weight_filter_rescue must be"):
            fused_linear_cross_entropy(t["x"], t["w"], t["y"], grad_weight_filter=EPS, grad_weight_filter_rescue=bad)


def test_zero_eps_switches_the_rescue_off_with_the_filter():
    """eps 0 is the dense path; a rescue beside it has nothing to rescue and changes nothing."""
    t = leaves(peaked_inputs(), torch.float32)
    policy = geometry(torch.float32)
    dense = run(t, policy=policy)
    off = run(t, policy=policy, grad_weight_filter=0.0, grad_weight_filter_rescue=16)
    assert_same(off, dense)
    assert torch.equal(off[2]["w"], dense[2]["w"]) and torch.equal(off[2]["b"], dense[2]["b"])
