"""``return_entropy``: each token's entropy of softmax(logits), against plain torch on explicit logits.

Reference: ``logits = x @ W.T + b`` in float64 (softcapped when asked), entropy as
``-(softmax * log_softmax).sum(-1)``, 0 where the target is ignored; the loss and gradients from
``F.cross_entropy`` and autograd on the same logits (the entropy must not change them). Row-only
and vocab-tiled geometry, every reduction, eager and ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from flce_policy import Geometry, Problem, fused_linear_cross_entropy
from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED
from flce_policy.loss import FLCEOutput, FusedLinearCrossEntropyLoss

DEVICE = "cpu" if KERNELS_INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="the kernels were compiled and there is no CUDA GPU"
)

B, T, H, V = 2, 7, 16, 93  # 14 rows: chunks of 8 leave a 6-row tail; V=93 tiles of 40 leave a 13-column one
TOL = 1e-5  # fp32 kernel vs float64 reference, absolute on entropies of a few nats

#: (chunk_size, vocab_chunk): row-only in two chunks, vocab-tiled in 2x3 slabs, vocab-tiled in one row chunk
GEOMETRIES = {"rows": (8, V), "vocab_tiled": (8, 40), "vocab_tiled_one_chunk": (B * T, 64)}


def make_inputs(seed: int = 0, *, scale: float = 3.0, ignored: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * (scale / H**0.5)
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.5
    y = torch.randint(0, V, (B, T), generator=g)
    y.view(-1)[torch.randperm(B * T, generator=g)[:ignored]] = -100
    cw = torch.rand(V, generator=g, dtype=torch.float64) + 0.5
    return x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), y.to(DEVICE), cw.to(DEVICE)


def reference_logits(x, w, b, softcap=None):
    logits = x @ w.t() + b
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def reference_entropy(logits, y):
    ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    return torch.where(y != -100, ent, 0.0)


def geometry(name, dtype=torch.float32):
    rows, vocab_chunk = GEOMETRIES[name]
    return Geometry.for_problem(Problem(B * T, H, V, dtype), rows, vocab_chunk=vocab_chunk)


@pytest.mark.parametrize("geo", sorted(GEOMETRIES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("softcap", [None, 6.0])
def test_entropy_loss_and_gradients_against_reference(geo, reduction, softcap):
    x, w, b, y, _ = make_inputs()
    leaves = [t.float().requires_grad_() for t in (x, w, b)]
    out = fused_linear_cross_entropy(
        *leaves[:2], y, leaves[2], policy=geometry(geo), reduction=reduction, softcap=softcap, return_entropy=True
    )
    assert isinstance(out, FLCEOutput) and out.z_loss is None and out.predicted_tokens is None
    ent = out.entropy
    assert ent.dtype == torch.float32 and ent.shape == (B, T) and not ent.requires_grad

    ref_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    logits = reference_logits(*ref_leaves, softcap)
    flat_y = y.reshape(-1)
    want = reference_entropy(logits.detach(), y)
    assert (ent[y == -100] == 0).all()
    torch.testing.assert_close(ent.double(), want, rtol=0, atol=TOL)

    ref_loss = F.cross_entropy(logits.reshape(-1, V), flat_y, reduction=reduction)
    grad_out = torch.linspace(-1.0, 2.0, B * T, dtype=torch.float64, device=DEVICE) if reduction == "none" else None
    if reduction == "none":
        ref_loss = ref_loss.reshape(B, T)
        grad_out = grad_out.reshape(B, T)
    torch.testing.assert_close(out.loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.loss, leaves, None if grad_out is None else grad_out.float())
    want_grads = torch.autograd.grad(ref_loss, ref_leaves, grad_out)
    for got, expected, name in zip(grads, want_grads, "xwb", strict=True):
        err = (got.double() - expected).abs().max() / expected.abs().max()
        assert err < 1e-5, f"grad {name}: {err}"


def test_entropy_ignores_smoothing_class_weights_token_scaling_and_z_loss():
    """Every loss option changes the loss, none the entropy: it is softmax(z)'s alone."""
    x, w, b, y, cw = make_inputs(1)
    out = fused_linear_cross_entropy(
        x.float(), w.float(), y, b.float(), policy=geometry("vocab_tiled"), softcap=4.0, label_smoothing=0.2,
        class_weight=cw.float(), use_token_scaling=True, z_loss_scale=1e-2, return_entropy=True,
        return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True,
    )  # fmt: skip
    logits = reference_logits(x, w, b, 4.0).reshape(-1, V)
    flat_y = y.reshape(-1)
    torch.testing.assert_close(out.entropy.double().reshape(-1), reference_entropy(logits, flat_y), rtol=0, atol=TOL)
    valid = flat_y != -100
    predicted = torch.where(valid, logits.argmax(-1), -1).reshape(B, T)
    assert torch.equal(out.predicted_tokens, predicted)  # the other extras still come back with it
    assert out.z_loss is not None and out.token_accuracy is not None


@pytest.mark.parametrize("geo", ["rows", "vocab_tiled"])
def test_entropy_of_large_peaked_and_flat_logits(geo):
    """Logits of magnitude ~100 (online rescaling across blocks and tiles), a near one-hot row, a uniform row."""
    x, w, b, y, _ = make_inputs(2, scale=60.0)
    w[:, 0] = 0.0
    x[0, 0] = 0.0  # row 0: logits = b alone ...
    b_flat = torch.zeros_like(b)  # ... and b = 0: uniform, entropy log(V)
    x[0, 1, 0] = 1e3
    w[V - 1, 0] = 1.0  # row 1: class V-1 (in the last tile) ahead by 1000: entropy ~0
    y[0, :2] = torch.tensor([5, V - 1])
    out = fused_linear_cross_entropy(
        x.float(), w.float(), y, b_flat.float(), policy=geometry(geo), reduction="sum", return_entropy=True
    )
    want = reference_entropy(reference_logits(x, w, b_flat), y)
    assert abs(out.entropy[0, 0].item() - torch.log(torch.tensor(float(V))).item()) < TOL
    # ~0 as lse - sum(p z): two values ~1000 apart by nothing, so fp32 rounding of |z| ~ 1000 (6e-5) is its error
    assert out.entropy[0, 1].item() == pytest.approx(0.0, abs=2e-4)
    # relative: entropies here are exact to fp32 rounding of logits ~100
    torch.testing.assert_close(out.entropy.double(), want, rtol=0, atol=1e-4)


def test_entropy_bf16_against_upcast_reference():
    """bf16 operands: the slab holds bf16 logits; the reference is their fp32 entropy."""
    x, w, b, y, _ = make_inputs(3)
    xb, wb, bb = (t.to(torch.bfloat16) for t in (x, w, b))
    out = fused_linear_cross_entropy(
        xb, wb, y, bb, policy=geometry("vocab_tiled", torch.bfloat16), softcap=6.0, return_entropy=True
    )
    logits = F.linear(xb, wb, bb).float()
    want = reference_entropy(6.0 * torch.tanh(logits / 6.0), y)
    torch.testing.assert_close(out.entropy, want, rtol=0, atol=1e-4)


def test_entropy_of_an_empty_and_an_all_ignored_batch():
    x, w, b, y, _ = make_inputs()
    xe, we = x[:, :0].float().requires_grad_(), w.float().requires_grad_()
    empty = fused_linear_cross_entropy(xe, we, y[:, :0], return_entropy=True, reduction="none")
    assert empty.entropy.shape == (B, 0) and empty.entropy.dtype == torch.float32
    empty.loss.sum().backward()  # reduction none's backward of no rows: zero gradients
    assert xe.grad.shape == xe.shape and not we.grad.any()
    ignored = fused_linear_cross_entropy(x.float(), w.float(), torch.full_like(y, -100), return_entropy=True)
    assert torch.equal(ignored.entropy, torch.zeros(B, T, device=DEVICE))


def test_module_form_and_bad_option():
    x, w, b, y, _ = make_inputs()
    out = FusedLinearCrossEntropyLoss(policy=geometry("rows"), return_entropy=True)(x.float(), w.float(), y, b.float())
    torch.testing.assert_close(out.entropy.double(), reference_entropy(reference_logits(x, w, b), y), rtol=0, atol=TOL)
    with pytest.raises(TypeError, match="return_entropy must be True or False"):
        FusedLinearCrossEntropyLoss(return_entropy=1)
    assert isinstance(fused_linear_cross_entropy(x.float(), w.float(), y), torch.Tensor)  # not asked: a plain loss


def test_vocab_parallel_refuses_entropy_by_name():
    x, w, b, y, _ = make_inputs()
    with pytest.raises(NotImplementedError, match="return_entropy.*vocab-parallel"):
        fused_linear_cross_entropy(x.float(), w.float(), y, tp_group=object(), return_entropy=True)


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("geo", ["rows", "vocab_tiled"])
def test_compiled_fullgraph_entropy(geo, _fresh_dynamo):
    """One opaque node per call; entropy, losses and gradients as the reference, for mean and none."""
    x, w, b, y, _ = make_inputs(4)
    policy = geometry(geo)
    coeffs = torch.linspace(-1.0, 2.0, B * T, device=DEVICE).reshape(B, T)

    def step(xl, wl, bl):
        mean = fused_linear_cross_entropy(xl, wl, y, bl, policy=policy, softcap=5.0, return_entropy=True)
        rows = fused_linear_cross_entropy(
            xl, wl, y, bl, policy=policy, softcap=5.0, reduction="none", return_entropy=True
        )
        return 0.5 * mean.loss + (coeffs * rows.loss).sum(), mean.entropy, rows.entropy

    # the graphs Dynamo hands aot_eager, kept: what torch._dynamo.explain would show, without running the
    # kernels again for it
    recorded = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=recorded)
    leaves = [t.float().requires_grad_() for t in (x, w, b)]
    objective, ent_mean, ent_rows = compiled(*leaves)
    grads = torch.autograd.grad(objective, leaves)

    ref_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    logits = reference_logits(*ref_leaves, 5.0)
    flat_y = y.reshape(-1)
    rows_ref = F.cross_entropy(logits.reshape(-1, V), flat_y, reduction="none").reshape(B, T)
    ref_objective = 0.5 * rows_ref.sum() / (flat_y != -100).sum() + (coeffs.double() * rows_ref).sum()
    want = reference_entropy(logits.detach(), y)
    for ent in (ent_mean, ent_rows):
        assert ent.shape == (B, T) and ent.dtype == torch.float32 and not ent.requires_grad
        torch.testing.assert_close(ent.double(), want, rtol=0, atol=TOL)
    torch.testing.assert_close(objective.double(), ref_objective.detach(), rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, torch.autograd.grad(ref_objective, ref_leaves), strict=True):
        assert (got.double() - expected).abs().max() / expected.abs().max() < 1e-5

    # no graph break (fullgraph=True raises at one) and one graph
    assert recorded.frame_count == 1 and len(recorded.graphs) == 1
    # each call one opaque node, in the forward subgraph of its autograd.Function
    code = "".join(module.code for module in recorded.graphs[0].modules())
    assert code.count("flce_policy.fused_linear_cross_entropy.default(") == 2
