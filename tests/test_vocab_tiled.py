"""Vocab-tiled geometry ([chunk_size, vocab_chunk] slabs, logits computed twice) against fp64 torch.

Independent reference: explicit logits, F.cross_entropy, z-loss and accuracy by hand, gradients
from autograd. Also: the same numbers as row-only geometry, and the driver walks exactly the tiles.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flce_policy import Geometry, Problem, fused_linear_cross_entropy
from flce_policy.kernels.driver import observe_chunks
from flce_policy.plan.accumulator import accumulator_layout

# odd on purpose: tails in both dimensions (small: the interpreter runs a program per row and tile)
BT, H, V = 13, 24, 101


def make_inputs(seed: int = 0, *, ignored: int = 3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BT, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64) * (3 / H**0.5)
    b = torch.randn(V, generator=gen, dtype=torch.float64) * 0.5
    y = torch.randint(0, V, (BT,), generator=gen)
    y[torch.randperm(BT, generator=gen)[:ignored]] = -100
    cw = torch.rand(V, generator=gen, dtype=torch.float64) + 0.5
    return x, w, b, y, cw


def reference(x, w, b, y, *, cw=None, reduction="mean", label_smoothing=0.0, softcap=None, z_loss_scale=0.0):
    logits = x @ w.t() + (0 if b is None else b)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, y, weight=cw, reduction=reduction, label_smoothing=label_smoothing)
    valid = y != -100
    z_rows = z_loss_scale * torch.logsumexp(logits, -1) ** 2 * valid
    z = {"none": z_rows, "sum": z_rows.sum(), "mean": z_rows.sum() / valid.sum()}[reduction]
    accuracy = ((logits.argmax(-1) == y) & valid).sum() / valid.sum()
    return loss + z, accuracy


def run(geometry_args, x, w, b, y, *, dtype=torch.float32, grad_output=None, **options):
    leaves = [t.to(dtype).requires_grad_() for t in (x, w) + (() if b is None else (b,))]
    geometry = Geometry.for_problem(Problem(BT, H, V, dtype), geometry_args[0], vocab_chunk=geometry_args[1])
    out = fused_linear_cross_entropy(
        leaves[0],
        leaves[1],
        y,
        None if b is None else leaves[2],
        policy=geometry,
        return_token_accuracy=True,
        **options,
    )
    grads = torch.autograd.grad(out.loss, leaves, grad_output)
    return out, grads


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


#: (chunk_size, vocab_chunk) over BT=13, V=101: one row chunk in 4 tiles (the last of 5 columns); 4 row
#: chunks (the last of 1 row) in 3 tiles (the last of 1 column); 3 row chunks (the last of 1 row) in 8 tiles
#: (the last of 10).
#: Each reduction on each, but sum on one only: to the kernels sum is mean's path with another scalar
#: grad_scale (reduction none is the per-row one), and that scalar is worked out before any geometry.
EVERY_OPTION_CASES = [
    pytest.param(geometry, reduction, id=f"{reduction}-{geometry}")
    for geometry in [(13, 32), (4, 50), (6, 13)]
    for reduction in ["mean", "none"] + (["sum"] if geometry == (6, 13) else [])
]


@pytest.mark.parametrize("geometry, reduction", EVERY_OPTION_CASES)
def test_every_option_against_the_reference(geometry, reduction):
    x, w, b, y, cw = make_inputs()
    options = dict(reduction=reduction, label_smoothing=0.1, softcap=8.0, z_loss_scale=1e-3, class_weight=cw.float())
    grad_output = (
        torch.randn(BT, dtype=torch.float64) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    )
    out, grads = run(geometry, x, w, b, y, grad_output=grad_output.float(), **options)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    ref_loss, ref_acc = reference(*leaves, y, cw=cw, **{k: v for k, v in options.items() if k != "class_weight"})
    ref_grads = torch.autograd.grad(ref_loss, leaves, grad_output)
    assert rel(out.loss, ref_loss) < 1e-5
    assert abs(float(out.token_accuracy) - float(ref_acc)) < 1e-6
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel(got, want) < 1e-5


def test_same_numbers_as_row_only_geometry():
    x, w, b, y, _ = make_inputs(1)
    tiled, tiled_grads = run((4, 32), x, w, b, y)
    rows, rows_grads = run((4, V), x, w, b, y)
    assert rel(tiled.loss, rows.loss) < 1e-6
    for got, want in zip(tiled_grads, rows_grads, strict=True):
        assert rel(got, want) < 1e-5


def test_plain_options_and_no_bias():
    x, w, _, y, _ = make_inputs(2)
    out, (gx, gw) = run((BT, 25), x, w, None, y)
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    ref_loss, _ = reference(*leaves, None, y)
    rgx, rgw = torch.autograd.grad(ref_loss, leaves)
    assert rel(out.loss, ref_loss) < 1e-6 and rel(gx, rgx) < 1e-5 and rel(gw, rgw) < 1e-5


def test_driver_walks_each_row_chunk_with_the_geometry_slab():
    x, w, b, y, _ = make_inputs(3)
    with observe_chunks() as events:
        run((5, 40), x, w, b, y)
    assert [(e.row_start, e.rows) for e in events] == [(0, 5), (5, 5), (10, 3)]
    assert {e.slab_shape for e in events} == {(5, 40)}
    assert {e.slab_bytes for e in events} == {5 * 40 * 4}


def test_no_grad_and_frozen_weight():
    x, w, b, y, _ = make_inputs(4)
    geometry = Geometry.for_problem(Problem(BT, H, V, torch.float32), 6, vocab_chunk=32)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x.float(), w.float(), y, b.float(), policy=geometry)
    ref_loss, _ = reference(x, w, b, y)
    assert rel(loss, ref_loss) < 1e-6
    xr = x.float().requires_grad_()
    loss = fused_linear_cross_entropy(xr, w.float(), y, policy=geometry)
    (gx,) = torch.autograd.grad(loss, [xr])
    leaf = x.clone().requires_grad_()
    (rgx,) = torch.autograd.grad(reference(leaf, w, None, y)[0], [leaf])
    assert rel(gx, rgx) < 1e-5


def test_bf16_single_row_chunk_rounds_weight_gradient_once():
    """One row chunk writes each grad_weight slice once: as accurate as eager bf16, no fp32 buffer."""
    x, w, _, y, _ = make_inputs(5, ignored=0)
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    ref_loss, _ = reference(*leaves, None, y)
    _, rgw = torch.autograd.grad(ref_loss, leaves)
    xe, we = (t.to(torch.bfloat16).requires_grad_() for t in (x, w))
    eager = F.cross_entropy((xe @ we.t()).float(), y)
    _, egw = torch.autograd.grad(eager, [xe, we])
    _, (_, gw) = run((BT, 32), x, w, None, y, dtype=torch.bfloat16)
    # the interpreter rounds fp32 -> bf16 by truncation (twice the error of the GPU's rounding)
    assert rel(gw, rgw) <= 4 * rel(egw, rgw)


# --- the fp32 grad_input accumulator in borrowed bytes (flce_policy.plan.accumulator) ---------------


def bf16_case(seed: int, hidden: int = H):
    """bf16 inputs, the fp64 reference gradients from the same rounded values, and eager bf16's."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BT, hidden, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    w = (torch.randn(V, hidden, generator=gen, dtype=torch.float64) * (3 / hidden**0.5)).to(torch.bfloat16)
    y = torch.randint(0, V, (BT,), generator=gen)
    leaves = [t.double().requires_grad_() for t in (x, w)]
    ref = torch.autograd.grad(F.cross_entropy(leaves[0] @ leaves[1].t(), y), leaves)
    eager_leaves = [t.clone().requires_grad_() for t in (x, w)]
    eager = torch.autograd.grad(F.cross_entropy((eager_leaves[0] @ eager_leaves[1].t()).float(), y), eager_leaves)
    return x, w, y, ref, eager


def run_bf16(x, w, y, chunk_size, vocab_chunk, *, weight_grad=True):
    problem = Problem(BT, x.shape[1], V, torch.bfloat16)
    geometry = Geometry.for_problem(problem, chunk_size, vocab_chunk=vocab_chunk)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(weight_grad)]
    loss = fused_linear_cross_entropy(leaves[0], leaves[1], y, policy=geometry)
    wanted = leaves if weight_grad else leaves[:1]
    return geometry, torch.autograd.grad(loss, wanted)


def worst_row_error(got, want):
    """The largest per-row relative error: one row left in fp32 bytes or never narrowed stands out."""
    got, want = got.double(), want.double()
    return float(((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)).max())


@pytest.mark.parametrize(
    "chunk_size, vocab_chunk, hidden, expected",
    [
        # one row chunk, grad_weight lends its last 14 rows (7 fp32 rows): the last 3 tiles of 8 are late
        (BT, 8, H, dict(in_grad_input=6, separate=0, in_grad_weight=7, late_tiles=3)),
        # one late tile (the last, of 17 columns), still in the slab when its rows are free
        (BT, 28, H, dict(in_grad_input=6, separate=0, in_grad_weight=7, late_tiles=1)),
        # two late tiles of 50 columns would recompute half of V: a buffer instead
        (BT, 50, H, dict(in_grad_input=6, separate=7, in_grad_weight=0, late_tiles=0)),
        # several row chunks accumulate into grad_weight: the tail rows get a buffer
        (6, 32, H, dict(in_grad_input=3, separate=3, in_grad_weight=0, late_tiles=0)),
        # odd H: a bf16 row does not hold whole fp32 values at every row start
        (BT, 8, 25, dict(in_grad_input=0, separate=BT, in_grad_weight=0, late_tiles=0)),
    ],
    ids=["late-3", "late-1", "recompute-too-wide", "row-chunks", "odd-hidden"],
)
def test_bf16_accumulator_layouts_match_the_reference(chunk_size, vocab_chunk, hidden, expected):
    x, w, y, (rgx, rgw), (egx, egw) = bf16_case(7, hidden)
    geometry, (gx, gw) = run_bf16(x, w, y, chunk_size, vocab_chunk)
    layout = accumulator_layout(geometry)
    assert {k: getattr(layout, k) for k in expected} == expected
    # the interpreter rounds fp32 -> bf16 by truncation (twice the error of the GPU's rounding)
    assert rel(gx, rgx) <= 4 * rel(egx, rgx)
    assert worst_row_error(gx, rgx) <= 4 * worst_row_error(egx, rgx)
    assert worst_row_error(gw, rgw) <= 4 * worst_row_error(egw, rgw) + 0.02  # several row chunks: bf16 sums


def test_bf16_frozen_weight_keeps_the_tail_in_a_buffer():
    x, w, y, (rgx, _), (egx, _) = bf16_case(8)
    geometry, (gx,) = run_bf16(x, w, y, BT, 8, weight_grad=False)
    assert accumulator_layout(geometry, weight_grad=False).separate == BT - BT // 2
    assert worst_row_error(gx, rgx) <= 4 * worst_row_error(egx, rgx)


@pytest.mark.parametrize(
    "vocab, vocab_chunk, tied",
    [
        # segments of 8192: the last tile's second one is empty; ties in slots 1, 0 and 1 again
        (40000, 16384, (9000, 17000, 25000)),
        # 9 blocks of 4096 in 4 segments of 3: every tile's fourth segment is empty
        (41864, 36864, (13000, 37000)),
    ],
    ids=["last-tile-empty-segment", "every-tile-empty-segment"],
)
def test_tiles_merge_into_segment_slots_with_empty_segments_and_ties(vocab, vocab_chunk, tied):
    """Wide tiles over few rows: several segments per tile, later tiles merging into the slots.

    An empty segment must not turn into nan, and an exact tie for the maximum between columns
    in different tiles and segments goes to the lowest column, as torch.argmax does.
    """
    rows, hidden = 4, 8
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.01
    x[:, 0] = 10.0
    w[list(tied)] = torch.nn.functional.one_hot(torch.tensor(0), hidden).double() * 5.0  # logit 50 exactly
    y = torch.tensor([tied[0], tied[0], tied[1], 123])
    geometry = Geometry.for_problem(Problem(rows, hidden, vocab, torch.float32), rows, vocab_chunk=vocab_chunk)
    leaves = [t.float().requires_grad_() for t in (x, w)]
    out = fused_linear_cross_entropy(*leaves, y, policy=geometry, return_token_accuracy=True)
    grads = torch.autograd.grad(out.loss, leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w)]
    logits = ref_leaves[0] @ ref_leaves[1].t()
    ref_loss = F.cross_entropy(logits, y)
    ref_grads = torch.autograd.grad(ref_loss, ref_leaves)
    assert float(out.token_accuracy) == float((logits.argmax(-1) == y).double().mean()) == 0.5
    assert rel(out.loss, ref_loss) < 1e-6
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel(got, want) < 1e-5


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16_borrowed_accumulator_with_every_option(reduction):
    """The borrowing layout (3 late tiles) with bias, class weights, smoothing, softcap and z-loss in bf16."""
    x, w, b, y, cw = make_inputs(10)
    x, w, b = (t.to(torch.bfloat16).double() for t in (x, w, b))  # the reference sees the rounded inputs
    options = dict(reduction=reduction, label_smoothing=0.1, softcap=8.0, z_loss_scale=1e-3)
    geometry = Geometry.for_problem(Problem(BT, H, V, torch.bfloat16), BT, vocab_chunk=8)
    assert accumulator_layout(geometry).late_tiles == 3
    grad_output = torch.randn(BT, dtype=torch.float64) if reduction == "none" else torch.tensor(1.0).double()
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (x, w, b)]
    out = fused_linear_cross_entropy(*leaves[:2], y, leaves[2], policy=geometry, class_weight=cw.float(), **options)
    grads = torch.autograd.grad(out, leaves, grad_output.float())
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    ref_loss, _ = reference(*ref_leaves, y, cw=cw, **options)
    ref_grads = torch.autograd.grad(ref_loss, ref_leaves, grad_output)
    assert rel(out, ref_loss) < 1e-2
    # bf16 logits and gradients: about 2**-8 relative per row; a misplaced row or tile is O(1)
    for got, want in zip(grads[:2], ref_grads[:2], strict=True):
        assert worst_row_error(got, want) < 0.03
    assert rel(grads[2], ref_grads[2]) < 0.03  # grad_bias: sums over rows, many near zero
