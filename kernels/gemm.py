"""One GEMM helper shared by the drivers: accumulate a product into a buffer of any float dtype."""

from __future__ import annotations

import torch

__all__ = ["accumulate_mm"]


def accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool) -> None:
    """``out (+)= a @ b`` written straight into ``out``; ``first`` overwrites (beta=0, ``out`` unread).

    ``out`` may be wider than ``a``/``b`` (an fp32 accumulator for bf16 operands): on CUDA cuBLAS
    accumulates the low-precision product into it with no temporary.
    """
    beta = 0 if first else 1
    if out.dtype == a.dtype:
        torch.addmm(out, a, b, beta=beta, out=out)
    elif out.is_cuda:
        torch.addmm(out, a, b, beta=beta, out_dtype=out.dtype, out=out)
    else:
        # CPU (interpreter tests only, small shapes): no mixed-dtype GEMM there.
        torch.addmm(out, a.to(out.dtype), b.to(out.dtype), beta=beta, out=out)
