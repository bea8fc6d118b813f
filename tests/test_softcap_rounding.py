"""``softcap_rounding="eager"``: the softcap rounded op by op as eager PyTorch computes it on bf16/fp16 logits.

Reference: HF's Gemma path written out in plain torch on low-precision leaves — ``logits = x @ W.T``
in the input dtype, then ``/ softcap``, ``tanh``, ``* softcap`` (each rounded to that dtype),
``.float()`` and ``F.cross_entropy``; gradients from autograd through those same ops. The eager
rounding must reproduce it to within a last-bit flip here and there, and be measurably closer to it
than the default fp32 softcap; on fp32 logits the two modes are the same computation. Row-only and
vocab-tiled geometry, every reduction, eager and ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flce_policy import Geometry, Problem, fused_linear_cross_entropy
from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED

DEVICE = "cpu" if KERNELS_INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="the kernels were compiled and there is no CUDA GPU"
)

BT, H, V = 13, 32, 93  # chunks of 8 leave a 5-row tail; tiles of 40 leave a 13-column one
SOFTCAP = 30.0
GEOMETRIES = {"rows": (8, V), "vocab_tiled": (8, 40)}


def make_inputs(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BT, H, generator=g)
    # logits of std ~25: the softcap bends them, and its roundings show in the loss
    w = torch.randn(V, H, generator=g) * (25.0 / H**0.5)
    y = torch.randint(0, V, (BT,), generator=g)
    y[torch.randperm(BT, generator=g)[:4]] = -100
    grad_rows = torch.rand(BT, generator=g) + 0.5  # reduction none's upstream gradient
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype), y.to(DEVICE), grad_rows.to(DEVICE)


def eager_reference(x, w, y, reduction, grad_rows):
    """Loss and (grad_x, grad_w) of HF's softcapped logits path, computed op by op in x's dtype."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = torch.mm(x, w.t())
    logits = logits / SOFTCAP
    logits = torch.tanh(logits)
    logits = logits * SOFTCAP
    loss = F.cross_entropy(logits.float(), y, reduction=reduction, ignore_index=-100)
    (loss * grad_rows).sum().backward() if reduction == "none" else loss.backward()
    return loss.detach(), x.grad, w.grad


def flce(x, w, y, reduction, grad_rows, rounding, geo="rows", fn=fused_linear_cross_entropy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    rows, vocab_chunk = GEOMETRIES[geo]
    geometry = Geometry.for_problem(Problem(BT, H, V, x.dtype), rows, vocab_chunk=vocab_chunk)
    loss = fn(x, w, y, policy=geometry, reduction=reduction, softcap=SOFTCAP, softcap_rounding=rounding)
    (loss * grad_rows).sum().backward() if reduction == "none" else loss.backward()
    return loss.detach(), x.grad, w.grad


def errors(got, ref):
    """Max relative loss error, and the mean |difference| of each gradient over the mean |reference|."""
    loss, gx, gw = got
    ref_loss, ref_gx, ref_gw = ref
    loss_err = ((loss - ref_loss).abs() / ref_loss.abs().clamp_min(1e-3)).max().item()
    grad_errs = [
        ((a.float() - b.float()).abs().mean() / b.float().abs().mean()).item() for a, b in ((gx, ref_gx), (gw, ref_gw))
    ]
    return loss_err, grad_errs


@pytest.mark.parametrize("geo", sorted(GEOMETRIES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eager_rounding_reproduces_the_eager_softcap(dtype, reduction, geo):
    x, w, y, grad_rows = make_inputs(dtype)
    ref = eager_reference(x, w, y, reduction, grad_rows)
    eager_loss_err, eager_grad_errs = errors(flce(x, w, y, reduction, grad_rows, "eager", geo), ref)
    # the same roundings: equal but for a rare last-bit flip (the loss sums in another order)
    assert eager_loss_err < 1e-5, eager_loss_err
    assert max(eager_grad_errs) < 2e-3, eager_grad_errs
    if dtype == torch.bfloat16:
        # and the option does something: the fp32 softcap is visibly further from this path (in fp16
        # the softcap's roundings are 8x finer, the same size as the GEMMs' on a GPU: no clear margin,
        # so no fp32 run there either: nothing would be asserted of it)
        fp32_loss_err, fp32_grad_errs = errors(flce(x, w, y, reduction, grad_rows, "fp32", geo), ref)
        assert fp32_loss_err > 10 * max(eager_loss_err, 1e-7), (eager_loss_err, fp32_loss_err)
        assert min(fp32_grad_errs) > 2 * max(eager_grad_errs), (eager_grad_errs, fp32_grad_errs)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_eager_rounding_is_a_no_op_on_fp32_logits(reduction):
    x, w, y, grad_rows = make_inputs(torch.float32)
    fp32 = flce(x, w, y, reduction, grad_rows, "fp32")
    eager = flce(x, w, y, reduction, grad_rows, "eager")
    for a, b in zip(fp32, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and both are the fp32 softcap of the fp32 reference path
    ref = eager_reference(x, w, y, reduction, grad_rows)
    for a, b in zip(eager, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_passes_the_rounding_through(reduction):
    x, w, y, grad_rows = make_inputs(torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(fused_linear_cross_entropy, fullgraph=True, backend="aot_eager")
    got = flce(x, w, y, reduction, grad_rows, "eager", fn=compiled)
    eager = flce(x, w, y, reduction, grad_rows, "eager")
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_rounding_names_the_choices():
    x, w, y, _ = make_inputs(torch.bfloat16)
    with pytest.raises(ValueError, match="softcap_rounding must be one of fp32, eager; got 'bf16'"):
        fused_linear_cross_entropy(x, w, y, softcap=SOFTCAP, softcap_rounding="bf16")
