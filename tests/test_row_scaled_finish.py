"""The row-scaled finish kernel alone (kernels/row_scaled_finish.py) against torch in fp64, on partials set by hand.

The loss-level tests reach this kernel through small vocabularies, where a row's slots fit in one block of the
kernel's loop. Here a row has more slots than a block (so the sums, the argmax and the flags merge over blocks),
the rows are more than a block of rows with a ragged last one, and every per-row option is on: class weights,
z-loss, token scaling, the entropy, the argmax (with ties across blocks), per-row scales, ignored rows, and the
filter's flags at one and at two flag groups per slot.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_loss_kernel import DEVICE, NEEDS_KERNEL_DEVICE

from flce_policy.kernels import row_scaled_finish as finish_module
from flce_policy.kernels.ce_kernel import ce_workspace
from flce_policy.kernels.weight_grad_filter import filter_scratch
from flce_policy.plan.weight_filter import FILTER_COLS, KEPT_FLAG

pytestmark = NEEDS_KERNEL_DEVICE

ROWS = 37
IGNORE = -100
EPS = 2.0**-10


def slot_major(ws, plane: int, values: torch.Tensor) -> None:
    """Write ``values [slots, rows]`` into ``plane`` as the row-scaled GEMMs do (slot s of row r at s * stride + r)."""
    stride = ws.partials.shape[1]
    flat = ws.partials[plane].view(-1)
    slots, rows = values.shape
    at = (torch.arange(slots)[:, None] * stride + torch.arange(rows)[None, :]).reshape(-1)
    flat[at.to(flat.device)] = values.reshape(-1).to(flat)


def reference_flags(e_max, shift, lse, target, live):
    """Flag bytes [rows, groups] from the maxima [groups, rows] by the kernels' rule, in fp64."""
    gap_scale = (shift - lse).double()
    p_top = e_max.double() * torch.exp(gap_scale)[None, :]
    groups = torch.arange(e_max.shape[0])[:, None]
    keep = (p_top >= EPS) | (groups == (target // FILTER_COLS)[None, :])
    log2_top = torch.log2(e_max.double()) + gap_scale[None, :] / math.log(2)
    log2_top = torch.where(live[None, :], log2_top, torch.tensor(-math.inf, dtype=torch.float64))
    gap = math.log2(EPS) - log2_top
    level = torch.where(gap < KEPT_FLAG - 1, torch.clamp(torch.ceil(gap), min=1.0), float(KEPT_FLAG - 1))
    codes = torch.where(keep & live[None, :], KEPT_FLAG, KEPT_FLAG - level.long())
    return codes.t()


@pytest.mark.parametrize("tile", [128, 256])
def test_row_scaled_finish_merges_many_slot_blocks(tile, monkeypatch):
    monkeypatch.setattr(finish_module, "_LAUNCH", (16, 64, 4))  # 3 row blocks, and several slot blocks per row
    vocab = tile * 150 - 37  # 150 slots, the last one ragged
    slots = -(-vocab // tile)
    g = torch.Generator().manual_seed(7)
    ws = ce_workspace(ROWS, vocab, DEVICE, entropy=True, scaled_exp=True, slot_cols=tile)
    ws.partials.zero_()
    ws.best_index.zero_()

    target = torch.randint(0, vocab, (ROWS,), generator=g)
    target[[3, 20, 36]] = IGNORE
    live = target != IGNORE
    shift = torch.randn(ROWS, generator=g) * 3
    d = torch.rand(slots, ROWS, generator=g) + 0.05
    best = torch.randn(slots, ROWS, generator=g)
    index = (torch.arange(slots)[:, None] * tile + torch.randint(0, tile, (slots, ROWS), generator=g)).clamp(
        max=vocab - 1
    )
    # ties for the maximum: in two blocks (the later block's column lower), and within one block
    best[5, 0], best[140, 0], index[5, 0], index[140, 0] = 9.0, 9.0, 900, 7
    best[70, 1], best[71, 1], index[70, 1], index[71, 1] = 9.0, 9.0, 9100, 9000
    entropy_sums = torch.randn(slots, ROWS, generator=g)
    groups = -(-vocab // FILTER_COLS)
    e_max = torch.rand(groups, ROWS, generator=g) * torch.exp(torch.randn(groups, ROWS, generator=g) * 6)
    z_y = torch.randn(ROWS, generator=g)
    class_weight = torch.rand(vocab, generator=g) + 0.5
    scale = torch.rand(ROWS, generator=g)

    slot_major(ws, 1, d)
    slot_major(ws, 4, best)
    slot_major(ws, 6, entropy_sums)
    per_slot = tile // FILTER_COLS
    for part in range(per_slot):  # a slot's flag groups: its maxima in planes 2 (and 3)
        slot_major(
            ws,
            2 + part,
            torch.zeros(slots, ROWS).index_copy(
                0, torch.arange(part, groups, per_slot) // per_slot, e_max[part::per_slot]
            ),
        )
    flat_index = ws.best_index.view(-1)
    at = (torch.arange(slots)[:, None] * ws.partials.shape[1] + torch.arange(ROWS)[None, :]).reshape(-1)
    flat_index[at.to(flat_index.device)] = index.reshape(-1).to(flat_index)
    ws.partials[5, :, 0] = z_y.to(DEVICE)
    ws.row_shift.copy_(torch.where(live, shift, torch.tensor(math.inf)).to(DEVICE))
    flags = filter_scratch(ROWS, vocab, DEVICE).flags
    loss, z_loss, entropy = (torch.full((ROWS,), float("nan"), device=DEVICE) for _ in range(3))
    argmax = torch.full((ROWS,), -7, dtype=torch.int64, device=DEVICE)
    finish_module.row_scaled_finish(
        target.to(DEVICE), loss, ws, n_cols=vocab, ignore_index=IGNORE, z_loss_scale=1e-3,
        class_weight=class_weight.to(DEVICE), z_loss_rows=z_loss, argmax_rows=argmax, token_scaling=True,
        grad_scale=scale.to(DEVICE), scale_per_row=True, entropy_rows=entropy, filter_flags=flags, filter_eps=EPS,
    )  # fmt: skip

    lse = shift.double() + torch.log(d.double().sum(0))
    w_y = torch.where(live, class_weight[target.clamp(min=0)], 0.0).double()
    token = torch.exp(z_y.double() - lse)
    want_loss = torch.where(live, w_y * (lse - z_y) * token, 0.0)
    want_z = torch.where(live, 1e-3 * lse * lse * token, 0.0)
    top = best.max(0).values
    want_argmax = torch.where(live, torch.where(best == top, index, vocab).min(0).values, -1)
    want_entropy = torch.where(live, lse - entropy_sums.double().sum(0) / d.double().sum(0), 0.0)
    coef = scale.double() * token * w_y
    want_coef_p = coef + scale.double() * token * 2e-3 * lse
    want_scale = torch.where(live, want_coef_p * torch.exp(shift.double() - lse), 0.0)

    torch.testing.assert_close(loss.cpu().double(), want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z_loss.cpu().double(), want_z, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(entropy.cpu().double(), want_entropy, rtol=1e-5, atol=1e-5)
    assert argmax.cpu().tolist() == want_argmax.tolist()
    assert argmax[0] == 7 and argmax[1] == 9000
    torch.testing.assert_close(ws.target_coef[:ROWS].cpu().double(), torch.where(live, coef, 0.0), rtol=1e-5, atol=0)
    torch.testing.assert_close(ws.row_scale[:ROWS].cpu().double(), want_scale, rtol=1e-5, atol=0)
    want_flags = reference_flags(e_max, shift, lse, target, live)
    got_flags = flags[:ROWS, :groups].cpu().long()
    assert (got_flags == want_flags).all(), (got_flags != want_flags).nonzero()[:5].tolist()
    assert (got_flags[live] == KEPT_FLAG).any() and (got_flags[live] < KEPT_FLAG).any()  # both kinds occur
    assert (got_flags[~live] == 1).all()  # an ignored row: the largest level everywhere
