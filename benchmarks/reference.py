"""The fp32 reference every accuracy figure is taken against: plain torch, a block of rows at a time."""

from __future__ import annotations

import torch

__all__ = ["chunked_fp32_reference", "rel_l2"]


def rel_l2(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference||, computed in float64."""
    value, reference = value.double(), reference.double()
    return float((value - reference).norm() / reference.norm().clamp_min(1e-300))


def chunked_fp32_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    rows: int = 4096,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean CE of ``x @ W.T`` (``softcap``: of ``softcap * tanh(x @ W.T / softcap)``) and its input/weight
    gradients in fp32 (TF32 off), ``rows`` at a time.

    For shapes whose full fp32 logits (and their autograd copies) would not fit: softmax minus
    one-hot by hand, grad_weight summed in fp32 over the row blocks.
    """
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
        if softcap is not None:
            tanh = torch.tanh(logits / softcap)
            logits = tanh * softcap
        lse = torch.logsumexp(logits, dim=-1)
        loss += ((lse - logits.gather(1, safe_y[:, None])[:, 0]) * valid).sum()
        grad_logits = logits.sub_(lse[:, None]).exp_()
        grad_logits[torch.arange(len(yc), device=x.device), safe_y] -= 1.0
        grad_logits *= (valid.float() / valid_count)[:, None]
        if softcap is not None:
            grad_logits *= 1.0 - tanh.square()
        grad_x[start : start + rows] = grad_logits @ w
        grad_w += grad_logits.t() @ xc
    return loss / valid_count, grad_x, grad_w
