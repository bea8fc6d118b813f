"""grad_weight_filter on CUDA at a moderate shape: the compiled kernels against plain torch.

Run with the GPU suite (``bash benchmarks/run_gpu_suite.sh tests``); skipped without CUDA. The
reference is fp32 torch on the kernel's own bf16 logits: dL/dlogits by autograd, the skip rule applied
to its per-token ``|softmax - onehot|`` (tests/test_weight_grad_filter.py's ``_tile_mask``).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from gpu_reference import rel_l2
from test_weight_grad_filter import _tile_mask

from flce_policy import fused_linear_cross_entropy
from flce_policy.kernels.weight_grad_filter import observe_tiles
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.plan.weight_filter import FILTER_COLS, FILTER_ROWS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BT, H, V, CHUNK = 4096, 1024, 32768, 1024
#: bf16 gradients against the fp32 reference (rel L2): the dense path's own error is ~0.4%
BF16_L2 = 1e-2


def _inputs(peaked: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Peaked: class frequencies falling along the vocabulary, targets drawn from the model; else logit std 4."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(BT, H, device="cuda", generator=gen)
    if peaked:
        w = torch.randn(V, H, device="cuda", generator=gen) * (1.5 / H**0.5)
        w[:, -1] = torch.linspace(4.0, -12.0, V, device="cuda")  # the last feature a bias, falling along V
        x[:, -1] = 1.0
        p = (x @ w.T).softmax(-1)
        y = torch.multinomial(p, 1, generator=gen).squeeze(1)
    else:
        w = torch.randn(V, H, device="cuda", generator=gen) * (4.0 / H**0.5)
        y = torch.randint(0, V, (BT,), device="cuda", generator=gen)
    y[torch.rand(BT, device="cuda", generator=gen) < 0.01] = -100
    return x.bfloat16(), w.bfloat16(), y


def _call(x, w, y, eps):
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    policy = Geometry.for_problem(Problem(tokens=BT, hidden=H, vocab=V, dtype="bfloat16"), CHUNK)
    loss = fused_linear_cross_entropy(xl, wl, y, policy=policy, grad_weight_filter=eps)
    loss.backward()
    return loss.detach(), xl.grad, wl.grad


def _reference(x, w, y, eps):
    """fp32 dense and filtered grad_weight, and the kept share of the tiles."""
    logits = (x @ w.T).float().requires_grad_()  # the kernel's bf16 GEMM
    (grad,) = torch.autograd.grad(F.cross_entropy(logits, y), logits)
    valid = y != -100
    onehot = F.one_hot(y.clamp_min(0), V).float() * valid[:, None]
    keep = (((logits.detach().softmax(-1) - onehot).abs() >= eps) | (onehot > 0)) & valid[:, None]
    mask = _tile_mask(keep, CHUNK, V)
    xf = x.float()
    return grad.T @ xf, (grad * mask).T @ xf, mask.float().mean().item()


@pytest.mark.parametrize(("peaked", "eps"), [(True, 2.0**-12), (True, 2.0**-8), (False, 2.0**-12)])
def test_filter_on_cuda(peaked, eps):
    x, w, y = _inputs(peaked)
    dense_loss, dense_gx, dense_gw = _call(x, w, y, None)
    with observe_tiles() as tiles:
        loss, gx, gw = _call(x, w, y, eps)
    skipped = 1 - sum(int(c.kept) for c in tiles) / sum(c.total for c in tiles)
    assert torch.equal(loss, dense_loss) and torch.equal(gx, dense_gx)  # bit for bit
    dense_ref, filtered_ref, kept = _reference(x, w, y, eps)
    print(json.dumps({
        "test": "grad_weight_filter", "peaked": peaked, "eps": eps, "kept_share": kept, "skipped_tiles": skipped,
        "gw_err_filtered_vs_masked_ref": rel_l2(gw, filtered_ref),
        "gw_err_filtered_vs_dense_ref": rel_l2(gw, dense_ref),
        "gw_err_dense_vs_dense_ref": rel_l2(dense_gw, dense_ref),
    }))  # fmt: skip
    assert rel_l2(gw, filtered_ref) < BF16_L2
    if peaked:
        assert kept < 0.9
    else:
        assert kept == 1.0
        assert rel_l2(gw, dense_gw) < BF16_L2


@pytest.mark.parametrize("slab_form", ["logits", "scaled_exp", "scaled_exp_rows"])
def test_the_rescue_keeps_each_tile_by_its_level_on_cuda(slab_form):
    """With rescue 16 the kernel rescues about sum(2^-L) of the skipped tiles, L from fp32's largest |p - onehot| per
    tile (1 to 4): within 5 sampling standard errors of that, and far from the 1/16 of a rescue blind to levels. On
    each slab form (the scaled-exp ones take their flags from other kernels: Hopper only)."""
    if slab_form != "logits" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the scaled-exp slab needs a Hopper GPU")
    eps, rescue, max_level = 2.0**-12, 16, 4
    x, w, y = _inputs(True, seed=1)
    policy = Geometry.for_problem(Problem(tokens=BT, hidden=H, vocab=V, dtype="bfloat16"), CHUNK, slab_form=slab_form)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    with observe_tiles() as tiles:
        loss = fused_linear_cross_entropy(
            xl, wl, y, policy=policy, grad_weight_filter=eps, grad_weight_filter_rescue=rescue
        )
        loss.backward()
    rescued = sum(int(c.rescued) for c in tiles)
    logits = (x @ w.T).float()
    valid = y != -100
    onehot = F.one_hot(y.clamp_min(0), V).float() * valid[:, None]
    deviation = (logits.softmax(-1) - onehot).abs() * valid[:, None]
    keep = ((deviation >= eps) | (onehot > 0)) & valid[:, None]
    tiles = (BT // FILTER_ROWS, FILTER_ROWS, V // FILTER_COLS, FILTER_COLS)  # the filter's tile, from its constants
    top = deviation.view(tiles).amax(dim=(1, 3))
    kept = keep.view(tiles).any(3).any(1)
    level = torch.log2(eps / top).ceil().clamp(1, max_level)[~kept]
    chance = 2.0 ** -level.double()
    expected, noise = float(chance.sum()), float((chance * (1 - chance)).sum().sqrt())
    blind = level.numel() / rescue
    print(json.dumps({
        "test": "rescue_levels", "slab_form": slab_form, "skipped": level.numel(), "rescued": rescued,
        "expected": expected, "noise": noise, "blind_to_levels": blind,
    }))  # fmt: skip
    assert abs(rescued - expected) < 5 * noise + 0.002 * expected
    assert abs(blind - expected) > 10 * noise  # the case tells levels apart (16 standard errors on the H200)
