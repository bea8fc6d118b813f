"""The Gluon grad_weight GEMM on CUDA: ``grad_weight (+)= g.T @ x`` against fp32, beside cuBLAS's error, and where
the driver runs it.

Run with the GPU suite (``bash benchmarks/run_gpu_suite.sh tests``); skipped without a Hopper GPU or Gluon.
"""

from __future__ import annotations

import pytest
import torch
from gpu_reference import chunked_fp32_reference, make_inputs, rel_l2

from flce_policy import fused_linear_cross_entropy
from flce_policy.kernels import weight_grad_gemm as module
from flce_policy.kernels.gluon_exp_gemm import gluon_available
from flce_policy.plan.device import family_from_name
from flce_policy.plan.weight_grad_gemm import WEIGHT_GRAD_GEMM_ENV_VAR, weight_grad_gemm_for
from flce_policy.strategies import FixedChunkSize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or not gluon_available(),
        reason="needs a Hopper GPU (sm_90) and Triton's Gluon",
    ),
]


# rows below, at and past a 64-row K-step; V and H multiples of 8 but not of the 128-wide tile
@pytest.mark.parametrize("rows, vocab, hidden", [(1, 1024, 128), (37, 1000, 136), (256, 4096, 1024), (511, 2056, 520)])
@pytest.mark.parametrize("first, in_memory", [(True, False), (False, False), (False, True)],
                         ids=["first", "accumulate", "add-in-memory"])  # fmt: skip
def test_against_fp32_as_close_as_cublas(rows, vocab, hidden, first, in_memory):
    if in_memory and not module.reduce_add_available():
        pytest.skip("this Triton's Gluon has no TMA bulk reduce")
    gen = torch.Generator(device="cuda").manual_seed(rows + vocab)
    g = (torch.randn(rows, vocab, device="cuda", generator=gen) * 0.01).bfloat16()
    x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    old = torch.randn(vocab, hidden, device="cuda", generator=gen).bfloat16() * 0.05
    want = g.float().t() @ x.float() + (0 if first else old.float())
    ours = old.clone()
    module.weight_grad_gemm(ours, g, x, first=first, add_in_memory=in_memory)
    cublas = torch.addmm(old, g.t(), x, beta=0 if first else 1)
    # in memory the update is rounded to bf16 before the add rounds the sum: up to sqrt(2) times the error
    assert rel_l2(ours, want) <= (1.5 if in_memory else 1.2) * rel_l2(cublas, want) + 1e-6
    assert rel_l2(ours, want) < (6e-3 if in_memory else 4e-3)  # bf16's rounding of the sum (and of the update)


def test_bad_tensors_get_a_clear_error():
    g = torch.zeros(64, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros(64, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"grad_weight \[V, H\] needed"):
        module.weight_grad_gemm(torch.zeros(1024, 64, device="cuda", dtype=torch.bfloat16), g, x, first=True)
    with pytest.raises(ValueError, match="2-D bf16"):
        module.weight_grad_gemm(torch.zeros(1024, 128, device="cuda"), g, x, first=True)
    with pytest.raises(ValueError, match="multiples of 8"):
        module.weight_grad_gemm(torch.zeros(1020, 128, device="cuda", dtype=torch.bfloat16), g[:, :1020], x, first=True)


@pytest.mark.parametrize("rows, first, setting", [(256, True, "auto"), (384, False, "auto"), (385, False, "auto"),
                                                  (640, False, "auto"), (641, False, "auto"), (384, True, "auto"),
                                                  (256, False, "cublas"), (700, False, "reduce")])  # fmt: skip
def test_the_driver_runs_it_at_the_rule_s_rows_only(rows, first, setting, monkeypatch):
    monkeypatch.setenv(WEIGHT_GRAD_GEMM_ENV_VAR, setting)
    launched = []
    real = module.launch_weight_grad_gemm

    def record(*args, add_in_memory, **kwargs):
        launched.append("gluon_in_memory" if add_in_memory else "gluon")
        real(*args, add_in_memory=add_in_memory, **kwargs)

    monkeypatch.setattr(module, "launch_weight_grad_gemm", record)
    g = torch.randn(rows, 2048, device="cuda").bfloat16()
    x = torch.randn(rows, 256, device="cuda").bfloat16()
    out = torch.randn(2048, 256, device="cuda").bfloat16()
    want = g.float().t() @ x.float() + (0 if first else out.float())
    reduce_available = module.reduce_add_available()
    family = family_from_name(torch.cuda.get_device_name())
    gemm = weight_grad_gemm_for(family, rows, first=first, in_memory_available=reduce_available)
    if gemm == "gluon_in_memory" and not reduce_available:
        pytest.skip("this Triton's Gluon has no TMA bulk reduce")  # before the call: the pinned launch would raise
    module.accumulate_weight_grad(out, g, x, first=first)
    assert launched == ([] if gemm == "cublas" else [gemm])
    assert rel_l2(out, want) < (6e-3 if gemm == "gluon_in_memory" else 4e-3)


@pytest.mark.parametrize("rows", [256, 512])
def test_a_small_chunk_loss_matches_fp32_on_either_gemm(rows, monkeypatch):
    """The whole loss at small chunks, the Gluon kernel (where the rule runs it, reading the old block or adding in
    memory) and cuBLAS: errors against fp32 alike."""
    tokens, hidden, vocab = 2048, 1024, 32768
    x, w, y = make_inputs(tokens, hidden, vocab, torch.bfloat16)
    _, ref_gx, ref_gw = chunked_fp32_reference(x, w, y)
    errors = {}
    for setting in ("auto", "cublas") + (("reduce",) if module.reduce_add_available() else ()):
        monkeypatch.setenv(WEIGHT_GRAD_GEMM_ENV_VAR, setting)
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        fused_linear_cross_entropy(xl, wl, y, policy=FixedChunkSize(rows)).backward()
        errors[setting] = (rel_l2(xl.grad, ref_gx), rel_l2(wl.grad, ref_gw))
    assert errors["auto"][0] == errors["cublas"][0]  # grad_input's path is the same
    monkeypatch.delenv(WEIGHT_GRAD_GEMM_ENV_VAR)
    family = family_from_name(torch.cuda.get_device_name())
    added_in_memory = weight_grad_gemm_for(family, rows, first=False) == "gluon_in_memory"
    assert errors["auto"][1] <= (1.5 if added_in_memory else 1.1) * errors["cublas"][1]
    if "reduce" in errors:  # every chunk after the first added in memory: the update rounded once more
        assert errors["reduce"][0] == errors["cublas"][0]
        assert errors["reduce"][1] <= 1.5 * errors["cublas"][1]
