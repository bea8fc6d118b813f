"""The GPU suite's chunked fp32 reference, checked on the CPU against autograd through F.cross_entropy."""

from __future__ import annotations

import torch
from gpu_reference import chunked_bf16_eager, chunked_fp32_reference, reference_loss_and_grads, rel_l2


def test_chunked_reference_equals_autograd_cross_entropy():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 16, generator=gen).to(torch.bfloat16)
    w = torch.randn(301, 16, generator=gen).to(torch.bfloat16)
    y = torch.randint(0, 301, (37,), generator=gen)
    y[[3, 11]] = -100
    # against autograd in float64: fp32 sums over 301 classes differ from any other fp32 order by
    # a few 1e-6 (the thread count changes CPU reduction order), so fp32-vs-fp32 at 1e-6 was flaky
    want = reference_loss_and_grads(x, w, y, compute_dtype=torch.float64)
    got = chunked_fp32_reference(x, w, y, rows=8)
    for g, r in zip(got, want, strict=True):
        assert rel_l2(g, r) < 1e-5


def test_chunked_bf16_eager_rounds_as_eager_pytorch_does():
    """The bf16 eager call by row blocks (the 32k-token test's eager, which would not fit whole on an 80 GB card)
    against the whole call: far closer to it than the bf16 call is to float64."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(67, 32, generator=gen).to(torch.bfloat16)
    w = (torch.randn(301, 32, generator=gen) * (4 / 32**0.5)).to(torch.bfloat16)
    y = torch.randint(0, 301, (67,), generator=gen)
    y[[5, 40]] = -100
    eager = reference_loss_and_grads(x, w, y, compute_dtype=torch.bfloat16)
    exact = reference_loss_and_grads(x, w, y, compute_dtype=torch.float64)
    got = chunked_bf16_eager(x, w, y, rows=16)
    assert abs(got[0].item() - eager[0].item()) <= 1e-6 * abs(eager[0].item())
    for name, g, e, r in zip(("grad_input", "grad_weight"), got[1:], eager[1:], exact[1:], strict=True):
        assert g.dtype == e.dtype == torch.bfloat16, name
        assert rel_l2(e, r) > 1e-3, name  # bf16's own error: what the emulation must reproduce
        assert rel_l2(g, e) < 0.05 * rel_l2(e, r), name
