"""Independent references for the GPU suite: plain torch on explicit logits, and relative L2 error."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The chunked fp32 reference lives with the accuracy benchmark that reports against it.
from flce_policy.benchmarks.reference import chunked_fp32_reference, rel_l2

__all__ = [
    "chunked_bf16_eager",
    "chunked_fp32_reference",
    "make_inputs",
    "reference_loss_and_grads",
    "reference_loss_and_grads_bytes",
    "chunked_bf16_eager_bytes",
    "chunked_fp32_reference_bytes",
    "rel_l2",
]

FP32, BF16 = 4, 2


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


def reference_loss_and_grads_bytes(tokens: int, hidden: int, vocab: int) -> int:
    """The most :func:`reference_loss_and_grads` holds at once, in either compute dtype: three ``[BT, V]`` fp32
    blocks in its backward (the log-softmax it saved, the loss's gradient, the log-softmax's gradient), beside
    fp32 copies of x and W (bf16 ones in bf16) and their gradients."""
    return 3 * tokens * vocab * FP32 + 2 * (tokens + vocab) * hidden * FP32


def chunked_bf16_eager(
    x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, rows: int = 4096, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference_loss_and_grads(..., compute_dtype=torch.bfloat16)`` (eager PyTorch in a bf16 model) ``rows`` at
    a time, for shapes whose ``[BT, V]`` fp32 logits and their gradients would not fit beside the test.

    The same roundings as eager: the logits from a bf16 GEMM, rounded to bf16, then softmax in fp32; the
    logits' gradient ``(softmax - onehot) / N`` rounded to bf16; grad_input from a bf16 GEMM per row (a row's
    product does not depend on the other rows); grad_weight, eager's one GEMM over all BT rows, as the exact
    products of the bf16 values summed in fp32 (TF32 off) over the blocks and rounded to bf16 once.
    """
    x, w = x.detach().to(torch.bfloat16), weight.detach().to(torch.bfloat16)
    valid_count = (target != ignore_index).sum().clamp_min(1)
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    grad_x = torch.empty_like(x)
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=x.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for start in range(0, x.shape[0], rows):
            xc, yc = x[start : start + rows], target[start : start + rows]
            valid = yc != ignore_index
            safe_y = torch.where(valid, yc, 0)
            logits = (xc @ w.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            loss += ((lse - logits.gather(1, safe_y[:, None])[:, 0]) * valid).sum().double()
            grad_logits = logits.sub_(lse[:, None]).exp_()
            grad_logits[torch.arange(len(yc), device=x.device), safe_y] -= 1.0
            grad_logits *= (valid.float() / valid_count)[:, None]
            grad_bf16 = grad_logits.to(torch.bfloat16)
            del logits, grad_logits
            grad_x[start : start + rows] = grad_bf16 @ w
            grad_w.addmm_(grad_bf16.t().float(), xc.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return (loss / valid_count).float(), grad_x, grad_w.to(torch.bfloat16)


def chunked_bf16_eager_bytes(tokens: int, hidden: int, vocab: int, *, rows: int = 4096) -> int:
    """The most :func:`chunked_bf16_eager` holds at once: the fp32 grad_weight sum, a block's fp32 logits
    (their gradient in place) beside its bf16 gradient, then that gradient in fp32 for the exact products."""
    block = min(rows, tokens) * vocab
    return vocab * hidden * FP32 + block * (FP32 + BF16) + tokens * hidden * BF16


def chunked_fp32_reference_bytes(tokens: int, hidden: int, vocab: int, *, rows: int = 4096) -> int:
    """The most ``chunked_fp32_reference`` holds at once: W in fp32, the fp32 grad_weight sum and a block's
    product added to it, a block's fp32 logits, and the fp32 grad_input."""
    return 3 * vocab * hidden * FP32 + min(rows, tokens) * vocab * FP32 + tokens * hidden * FP32


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
