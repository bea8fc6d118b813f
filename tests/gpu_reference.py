"""Independent references for the GPU suite: plain torch on explicit logits, and relative L2 error."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rel_l2(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference||, computed in float64."""
    value, reference = value.double(), reference.double()
    return float((value - reference).norm() / reference.norm().clamp_min(1e-300))


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


def chunked_fp32_reference(
    x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, rows: int = 4096, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`reference_loss_and_grads` in fp32, ``rows`` at a time: for shapes whose full fp32
    logits (and their autograd copies) would not fit. Softmax minus one-hot by hand, grad_weight
    summed in fp32 over the row blocks."""
    w = weight.detach().float()
    valid_count = (target != ignore_index).sum().clamp_min(1).float()
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    grad_x = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], rows):
        xc, yc = x[start : start + rows].detach().float(), target[start : start + rows]
        valid = yc != ignore_index
        safe_y = torch.where(valid, yc, 0)
        logits = xc @ w.t()
        lse = torch.logsumexp(logits, dim=-1)
        loss += ((lse - logits.gather(1, safe_y[:, None])[:, 0]) * valid).sum()
        grad_logits = logits.sub_(lse[:, None]).exp_()
        grad_logits[torch.arange(len(yc), device=x.device), safe_y] -= 1.0
        grad_logits *= (valid.float() / valid_count)[:, None]
        grad_x[start : start + rows] = grad_logits @ w
        grad_w += grad_logits.t() @ xc
    return loss / valid_count, grad_x, grad_w
