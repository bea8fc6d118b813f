"""TRL's options (token scaling, predicted tokens) and autocast, against plain torch on explicit logits.

Token scaling's reference multiplies each token's loss (cross-entropy and z-loss) by the detached
softmax probability of its target, computed in float64 from the same logits; predicted tokens are
``logits.argmax(-1)`` with -1 at ignored targets.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_loss_kernel import BT, DEVICE, FP32_TOL, REDUCTIONS, H, V, assert_close, default_grad_output, make_inputs

from flce_policy.loss import fused_linear_cross_entropy
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.strategies import FixedChunkSize

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="the kernels were compiled and there is no CUDA GPU"
)

IGNORE = -100


def scaled_reference(
    x, w, y, b=None, *, reduction="mean", softcap=None, label_smoothing=0.0, z_loss_scale=0.0, cw=None
):
    """Per-token (CE + z-loss) times detached p_target, reduced like the loss (mean over non-ignored tokens)."""
    logits = F.linear(x, w, b).double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ce = F.cross_entropy(
        logits,
        y,
        weight=None if cw is None else cw.double(),
        ignore_index=IGNORE,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    valid = y != IGNORE
    lse = torch.logsumexp(logits, dim=-1)
    rows = ce + torch.where(valid, z_loss_scale * lse**2, 0.0)
    p_target = torch.softmax(logits, dim=-1).gather(1, torch.where(valid, y, 0)[:, None])[:, 0]
    rows = rows * torch.where(valid, p_target, 0.0).detach()
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    mass = valid.sum() if cw is None else torch.where(valid, cw.double()[torch.where(valid, y, 0)], 0.0).sum()
    # the z-loss part is averaged over the count, the CE part over the class-weight mass (as without scaling)
    z_part = (torch.where(valid, z_loss_scale * lse**2, 0.0) * torch.where(valid, p_target, 0.0).detach()).sum()
    return (rows.sum() - z_part) / mass + z_part / valid.sum()


OPTION_SETS = [
    pytest.param({}, id="plain"),
    pytest.param({"softcap": 5.0}, id="softcap"),
    pytest.param({"label_smoothing": 0.1}, id="smoothing"),
    pytest.param({"z_loss_scale": 1e-3}, id="z_loss"),
    pytest.param({"class_weight": True, "label_smoothing": 0.05, "softcap": 8.0}, id="weights_smoothing_softcap"),
]


#: Every option set and reduction in row chunks; vocab-tiled with mean and none only: to the kernels sum
#: is mean's path with another scalar grad_scale (none is the per-row one), worked out before any geometry.
TOKEN_SCALING_CASES = [
    pytest.param(policy, options.values[0], reduction, id=f"{policy_id}-{options.id}-{reduction}")
    for policy, policy_id in ((FixedChunkSize(8), "rows"), ("vocab_tiled", "vocab_tiled"))
    for options in OPTION_SETS
    for reduction in REDUCTIONS
    if not (policy_id == "vocab_tiled" and reduction == "sum")
]


@pytest.mark.parametrize("policy, options, reduction", TOKEN_SCALING_CASES)
def test_token_scaling_matches_scaled_reference(reduction, options, policy):
    options = dict(options)
    inputs = make_inputs(bias=True, class_weight=options.pop("class_weight", False), n_ignored=5)
    if policy == "vocab_tiled":
        policy = Geometry.for_problem(Problem(BT, H, V, "float32"), 8, vocab_chunk=128)  # 2 row chunks x 4 tiles
    x, w, b = (inputs[k].clone().requires_grad_() for k in ("x", "w", "b"))
    xr, wr, br = (inputs[k].double().requires_grad_() for k in ("x", "w", "b"))
    cw = inputs.get("cw")
    loss = fused_linear_cross_entropy(
        x, w, inputs["y"], b, policy=policy, reduction=reduction, use_token_scaling=True, class_weight=cw, **options
    )
    ref = scaled_reference(xr, wr, inputs["y"], br, reduction=reduction, cw=cw, **options)
    assert_close(loss, ref, FP32_TOL, "loss")
    grad_output = default_grad_output(reduction, loss.shape)
    got = torch.autograd.grad(loss, (x, w, b), grad_outputs=grad_output)
    want = torch.autograd.grad(ref, (xr, wr, br), grad_outputs=None if grad_output is None else grad_output.double())
    for name, g, e in zip("xwb", got, want, strict=True):
        assert_close(g, e, FP32_TOL, f"grad {name}")


def test_token_scaling_changes_the_loss():
    # the scaled loss is not the plain one: the option does something
    inputs = make_inputs(n_ignored=3)
    plain = fused_linear_cross_entropy(inputs["x"], inputs["w"], inputs["y"], policy=FixedChunkSize(8))
    scaled = fused_linear_cross_entropy(
        inputs["x"], inputs["w"], inputs["y"], policy=FixedChunkSize(8), use_token_scaling=True
    )
    assert scaled.item() < 0.9 * plain.item()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignore_index", [-100, -1, 3])
def test_predicted_tokens_are_the_argmax(reduction, ignore_index):
    inputs = make_inputs(n_ignored=6, ignore_index=ignore_index)
    x, w, y = inputs["x"].view(1, BT, H), inputs["w"], inputs["y"].view(1, BT)
    out = fused_linear_cross_entropy(
        x,
        w,
        y,
        policy=FixedChunkSize(8),
        reduction=reduction,
        ignore_index=ignore_index,
        return_predicted_tokens=True,
        return_token_accuracy=True,
        softcap=4.0,
    )
    logits = F.linear(x.double(), w.double())
    valid = y != ignore_index
    expected = torch.where(valid, logits.argmax(-1), -1)
    assert out.predicted_tokens.dtype == torch.int64 and out.predicted_tokens.shape == y.shape
    assert torch.equal(out.predicted_tokens, expected)
    accuracy = ((expected == y) & valid).sum() / valid.sum()
    assert abs(out.token_accuracy.item() - accuracy.item()) < 1e-6
    assert out.z_loss is None


def test_predicted_tokens_vocab_tiled_ties_go_to_the_lowest_class():
    inputs = make_inputs(n_ignored=2)
    w = inputs["w"].clone()
    w[300] = w[7]  # class 300 ties class 7 in every row, in another vocab tile
    geometry = Geometry.for_problem(Problem(BT, H, V, "float32"), 8, vocab_chunk=128)
    out = fused_linear_cross_entropy(inputs["x"], w, inputs["y"], policy=geometry, return_predicted_tokens=True)
    logits = F.linear(inputs["x"].double(), w.double())
    expected = torch.where(inputs["y"] != IGNORE, logits.argmax(-1), -1)
    assert torch.equal(out.predicted_tokens, expected)
    assert (out.predicted_tokens != 300).all()


# --------------------------------------------------------------------------- autocast


def _autocast():
    return torch.autocast(DEVICE, dtype=torch.bfloat16)


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "policy", [FixedChunkSize(8), FixedChunkSize(64), "vocab_tiled"], ids=["chunks", "one_chunk", "vocab_tiled"]
)
def test_autocast_fp32_master_weight(hidden_dtype, reduction, policy):
    inputs = make_inputs(bias=True, n_ignored=4)
    if policy == "vocab_tiled":
        policy = Geometry.for_problem(Problem(BT, H, V, "bfloat16"), BT, vocab_chunk=128)
    x = inputs["x"].to(hidden_dtype, copy=True).requires_grad_()
    w = inputs["w"].clone().requires_grad_()  # fp32 master
    b = inputs["b"].clone().requires_grad_()
    with _autocast():
        loss = fused_linear_cross_entropy(x, w, inputs["y"], b, policy=policy, reduction=reduction, softcap=6.0)
    grad_output = default_grad_output(reduction, loss.shape)
    loss.backward(grad_output)
    assert loss.dtype == torch.float32
    assert x.grad.dtype == hidden_dtype and w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32

    # reference: what autocast's F.linear computes (bf16 operands), the rest in float64
    xr = inputs["x"].to(hidden_dtype).to(torch.bfloat16).double().requires_grad_()
    wr = inputs["w"].to(torch.bfloat16).double().requires_grad_()
    br = inputs["b"].to(torch.bfloat16).double().requires_grad_()
    logits = F.linear(xr, wr, br)
    logits = 6.0 * torch.tanh(logits / 6.0)
    ref = F.cross_entropy(logits, inputs["y"], ignore_index=IGNORE, reduction=reduction)
    ref.backward(None if grad_output is None else grad_output.double())
    tol = 2e-2  # bf16 logits and gradients
    assert_close(loss, ref, tol, "loss")
    assert_close(x.grad, xr.grad, tol, "grad x")
    assert_close(w.grad, wr.grad, tol, "grad w")
    assert_close(b.grad, br.grad, tol, "grad b")


def test_autocast_gradient_is_accumulated_in_fp32_not_cast_from_bf16():
    # Many chunks: a bf16 accumulator then a cast would round every partial sum; fp32 accumulation
    # equals the float64 sum of the bf16 per-chunk products to fp32 precision.
    inputs = make_inputs(bt=64)
    w = inputs["w"].clone().requires_grad_()
    x = inputs["x"][:64].to(torch.bfloat16)
    y = inputs["y"][:64]
    with _autocast():
        fused_linear_cross_entropy(x, w, y, policy=FixedChunkSize(4), reduction="sum").backward()
    with _autocast():
        one = w.detach().clone().requires_grad_()
        fused_linear_cross_entropy(x, one, y, policy=FixedChunkSize(64), reduction="sum").backward()
    # the chunks' bf16 dL/dlogits are identical either way; only the accumulation differs
    assert w.grad.dtype == torch.float32
    assert_close(w.grad, one.grad, 1e-5, "16 chunks vs one chunk")


def test_autocast_same_dtype_is_the_plain_call():
    inputs = make_inputs()
    x, w = inputs["x"].to(torch.bfloat16), inputs["w"].to(torch.bfloat16)
    plain = fused_linear_cross_entropy(x, w, inputs["y"], policy=FixedChunkSize(8))
    with _autocast():
        inside = fused_linear_cross_entropy(x, w, inputs["y"], policy=FixedChunkSize(8))
    assert torch.equal(plain, inside)


def test_mismatched_dtypes_outside_autocast_are_an_error():
    inputs = make_inputs()
    with pytest.raises(TypeError, match=r"weight dtype torch.float32 must equal input dtype torch.bfloat16.*autocast"):
        fused_linear_cross_entropy(inputs["x"].to(torch.bfloat16), inputs["w"], inputs["y"])
