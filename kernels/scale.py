"""Scale gradients in place by a device scalar, skipping the pass when the scalar is 1.

Backward of a ``mean``/``sum`` loss multiplies the gradients computed in forward by
``grad_output``, which is 1 for a plain ``loss.backward()``. Reading it on the host to skip that
pass would stall the CPU until the GPU catches up; here each program reads it on the device and
does nothing when it is 1, so there is no sync, no traffic when 1, and no second copy otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["scale_unless_one_"]

_BLOCK = 4096
#: Programs launched at most: each walks blocks with a grid stride, so a parameter-sized gradient
#: is not thousands of waves of programs that only read the scale and exit.
_MAX_PROGRAMS = 1024


@triton.jit
def _scale_unless_one_kernel(data_ptr, scale_ptr, numel, num_programs, BLOCK: tl.constexpr):
    scale = tl.load(scale_ptr).to(tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    num_blocks = tl.cdiv(numel, BLOCK)
    blocks_here = tl.cdiv(num_blocks - pid, num_programs)
    blocks_here = tl.where(scale == 1.0, 0, blocks_here)
    for i in range(0, blocks_here):
        offsets = (pid + i * num_programs) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        values = tl.load(data_ptr + offsets, mask=mask)
        tl.store(data_ptr + offsets, (values.to(tl.float32) * scale).to(values.dtype), mask=mask)


def scale_unless_one_(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``tensor *= scale`` in place (fp32 product, rounded once), nothing when ``scale == 1``.

    ``tensor`` must be contiguous; ``scale`` is a one-element tensor on the same device.
    """
    if not tensor.is_contiguous():
        raise ValueError("scale_unless_one_ needs a contiguous tensor")
    if scale.numel() != 1:
        raise ValueError(f"scale must hold one element, got shape {tuple(scale.shape)}")
    numel = tensor.numel()
    if numel:
        programs = min(triton.cdiv(numel, _BLOCK), _MAX_PROGRAMS)
        _scale_unless_one_kernel[(programs,)](tensor, scale.reshape(1), numel, programs, BLOCK=_BLOCK)
    return tensor
