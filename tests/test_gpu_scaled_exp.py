"""The scaled-exp slab on CUDA at the accuracy shape: its errors against fp32, beside the logits slab's.

Run with the GPU suite (``bash benchmarks/run_gpu_suite.sh tests``); skipped without CUDA or before Hopper
(TMA). With ``FLCE_GPU_REPORT`` set, the errors are appended there as a JSON line.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from gpu_reference import chunked_fp32_reference, make_inputs, rel_l2

from flce_policy import fused_linear_cross_entropy
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU"
    ),
]

BT, H, V, CHUNK = 4096, 1024, 32768, 2048


def _call(x, w, y, slab_form, **options):
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    policy = Geometry.for_problem(Problem(BT, H, V, "bfloat16"), CHUNK, slab_form=slab_form)
    out = fused_linear_cross_entropy(xl, wl, y, policy=policy, **options)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return loss.detach(), xl.grad, wl.grad, out


def test_errors_against_fp32_beside_the_logits_slab():
    x, w, y = make_inputs(BT, H, V, torch.bfloat16)
    ref_loss, ref_gx, ref_gw = chunked_fp32_reference(x, w, y)
    errors = {}
    for form in ("logits", "scaled_exp", "scaled_exp_rows", "scaled_exp_ws"):
        loss, gx, gw, _ = _call(x, w, y, form)
        errors[form] = {
            "loss": abs(loss.item() - ref_loss.item()),
            "grad_input": rel_l2(gx, ref_gx),
            "grad_weight": rel_l2(gw, ref_gw),
        }
    report = os.environ.get("FLCE_GPU_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps({"test": "scaled_exp_accuracy", "shape": [BT, H, V], **errors}) + "\n")
    print(json.dumps(errors))
    for form in ("scaled_exp", "scaled_exp_rows", "scaled_exp_ws"):
        for name in ("grad_input", "grad_weight"):
            assert errors[form][name] < errors["logits"][name], (form, name)
        assert errors[form]["loss"] <= errors["logits"]["loss"] + 1e-4, form


@pytest.mark.parametrize("form", ["scaled_exp", "scaled_exp_rows"])
def test_extras_against_fp32_beside_the_logits_slab(form):
    x, w, y = make_inputs(BT, H, V, torch.bfloat16, seed=1)
    options = dict(return_predicted_tokens=True, return_entropy=True, return_z_loss=True, z_loss_scale=1e-4)
    logits = _call(x, w, y, "logits", **options)[3]
    scaled = _call(x, w, y, form, **options)[3]
    # the argmax of the same bf16-rounded logits (the GEMMs may round a near-tie apart: allow a few)
    assert (scaled.predicted_tokens != logits.predicted_tokens).sum().item() <= BT // 1000
    with torch.no_grad():
        z = x.float() @ w.float().T
        valid = y != -100
        want_entropy = torch.where(valid, -(z.softmax(-1) * z.log_softmax(-1)).sum(-1), 0.0)
        want_z_loss = 1e-4 * (torch.logsumexp(z, -1) ** 2)[valid].mean()
    errors = {
        slab: (out.entropy.float() - want_entropy).abs().max().item()
        for slab, out in (("logits", logits), (form, scaled))
    }
    print(json.dumps({"entropy_max_abs_error": errors}))
    # the stored exponentials carry no rounding of the logits: no worse than the logits slab, and close to fp32
    assert errors[form] <= errors["logits"]
    torch.testing.assert_close(scaled.entropy.float(), want_entropy, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(scaled.z_loss.float(), want_z_loss, rtol=1e-3, atol=1e-6)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs sm_90 (Gluon)"
)
@pytest.mark.parametrize("filtered", [False, True])
def test_the_gluon_gemm_gives_its_triton_stand_in_s_results(monkeypatch, filtered):
    """On Hopper "scaled_exp_ws" runs the Gluon GEMM, elsewhere its Triton stand-in (the same 128-column slots,
    slot-major). The slab is the same fma and exp2 of the same products: the loss and grad_input agree to fp32
    summation order, grad_weight too (and, filtered, the same tiles skipped)."""
    import flce_policy.kernels.gluon_exp_gemm as gluon_module
    import flce_policy.kernels.scaled_exp as scaled_exp_module

    x, w, y = make_inputs(BT, H, V, torch.bfloat16)
    options = {"grad_weight_filter": 2.0**-12} if filtered else {}
    calls = []
    real = gluon_module.launch_row_scaled_exp_gemm

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(scaled_exp_module, "launch_row_scaled_exp_gemm", counting)
    gluon = _call(x, w, y, "scaled_exp_ws", **options)
    assert len(calls) == BT // CHUNK  # every chunk's GEMM was the Gluon kernel
    monkeypatch.setattr(scaled_exp_module, "_runs_gluon", lambda device: False)
    triton_path = _call(x, w, y, "scaled_exp_ws", **options)
    assert len(calls) == BT // CHUNK
    assert abs(gluon[0].item() - triton_path[0].item()) <= 1e-6 * abs(triton_path[0].item())
    for got, want, name in zip(gluon[1:3], triton_path[1:3], ("grad_input", "grad_weight"), strict=True):
        assert rel_l2(got, want.float()) < 1e-3, name
