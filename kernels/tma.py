"""Whether the kernels can load through TMA descriptors: the Triton, the GPU and the tensors, in one place.

The grad_weight filter's kernel (:mod:`.weight_grad_filter`) and the scaled-exp slab's GEMM (:mod:`.scaled_exp`)
load through Triton's host-side TMA descriptors; the call's routing (:mod:`flce_policy.call.resolve`) asks here
whether a device can run them.
"""

from __future__ import annotations

import functools

import torch

from flce_policy.plan.device import TMA_COMPUTE_CAPABILITY

from .interpreter import KERNELS_INTERPRETED

try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the Triton installed
    TensorDescriptor = None

__all__ = ["TensorDescriptor", "tma_device", "tma_tensors"]


@functools.cache
def tma_device(device: torch.device) -> bool:
    """Whether this Triton has TMA descriptors and ``device`` runs them (Hopper or later; the interpreter too)."""
    if TensorDescriptor is None:
        return False
    if KERNELS_INTERPRETED:
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= TMA_COMPUTE_CAPABILITY


def tma_tensors(*tensors: torch.Tensor) -> bool:
    """Whether descriptors can load these 2-D 16-bit tensors on their device: rows contiguous, row strides and
    addresses 16-byte aligned."""
    return tma_device(tensors[0].device) and all(
        t.element_size() == 2 and t.stride(1) == 1 and (t.stride(0) * 2) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in tensors
    )
