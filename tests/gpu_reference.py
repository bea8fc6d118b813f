"""Independent references for the GPU suite: plain torch on explicit logits, and relative L2 error."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The chunked fp32 reference lives with the accuracy benchmark that reports against it.
from flce_policy.benchmarks.reference import chunked_fp32_reference, rel_l2

__all__ = ["chunked_fp32_reference", "make_inputs", "reference_loss_and_grads", "rel_l2"]


def reference_loss_and_grads(
    x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, compute_dtype: torch.dtype, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean CE of ``x @ W.T`` and its input/weight gradients, with the GEMMs in ``compute_dtype``.

    ``compute_dtype=float32`` is the accuracy reference (TF32 off); ``bfloat16`` is what eager
    PyTorch does in a bf16 model: ``F.cross_entropy((x @ W.T).float(), y)``.
    """
    xr = x.detach().to(compute_dtype).requires_grad_()
    wr = weight.detach().to(compute_dtype).requires_grad_()
    loss = F.cross_entropy((xr @ wr.t()).float(), target, ignore_index=ignore_index)
    gx, gw = torch.autograd.grad(loss, (xr, wr))
    return loss.detach(), gx, gw


def make_inputs(
    tokens: int, hidden: int, vocab: int, dtype: torch.dtype, *, logit_std: float = 4.0, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random x, W (std chosen so x @ W.T has std ``logit_std``) and targets with ~1% ignored."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) * (logit_std / hidden**0.5)).to(dtype)
    y = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    y[torch.rand(tokens, device="cuda", generator=gen) < 0.01] = -100
    return x, w, y
