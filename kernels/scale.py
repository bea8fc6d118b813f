"""Scale gradients in place by a device scalar, skipping the pass when the scalar is 1.

Backward of a ``mean``/``sum`` loss multiplies the gradients computed in forward by
``grad_output``, which is 1 for a plain ``loss.backward()``. Reading it on the host to skip that
pass would stall the CPU until the GPU catches up; here each program reads it on the device and
does nothing when it is 1, so there is no sync, no traffic when 1, and no second copy otherwise.
A call's gradients (input, weight, bias) are scaled in one launch: at small shapes the host's
time to issue a launch, not the GPU, sets the pace.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__ = ["MAX_TENSORS", "scale_all_unless_one_", "scale_unless_one_"]

_BLOCK = 4096
#: Programs launched at most: each walks blocks with a grid stride, so a parameter-sized gradient
#: is not thousands of waves of programs that only read the scale and exit.
_MAX_PROGRAMS = 1024


@triton.jit
def _scale_blocks(data_ptr, numel, scale, pid, num_programs, BLOCK: tl.constexpr):
    num_blocks = tl.cdiv(numel, BLOCK)
    blocks_here = tl.cdiv(num_blocks - pid, num_programs)  # <= 0 for a program past the last block
    blocks_here = tl.where(scale == 1.0, 0, blocks_here)
    for i in range(0, blocks_here):
        offsets = (pid + i * num_programs) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        values = tl.load(data_ptr + offsets, mask=mask)
        tl.store(data_ptr + offsets, (values.to(tl.float32) * scale).to(values.dtype), mask=mask)


@triton.jit
def _scale_unless_one_kernel(
    a_ptr, a_numel, b_ptr, b_numel, c_ptr, c_numel, scale_ptr, num_programs, BLOCK: tl.constexpr
):  # fmt: skip
    # grid (num_programs, tensors): axis 1 picks the tensor, so one launch scales them all
    scale = tl.load(scale_ptr).to(tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    if which == 0:
        _scale_blocks(a_ptr, a_numel, scale, pid, num_programs, BLOCK)
    elif which == 1:
        _scale_blocks(b_ptr, b_numel, scale, pid, num_programs, BLOCK)
    else:
        _scale_blocks(c_ptr, c_numel, scale, pid, num_programs, BLOCK)


#: Tensors one launch scales at most (a call's gradients: input, weight, bias).
MAX_TENSORS = 3


def scale_all_unless_one_(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> Sequence[torch.Tensor]:
    """``t *= scale`` in place for each of up to three tensors (fp32 product, rounded once), in one launch;
    nothing when ``scale == 1``.

    Each tensor must be contiguous, on ``scale``'s device; ``scale`` holds one element.
    """
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"scale_all_unless_one_ takes at most {MAX_TENSORS} tensors, got {len(tensors)}")
    if scale.numel() != 1:
        raise ValueError(f"scale must hold one element, got shape {tuple(scale.shape)}")
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError("scale_all_unless_one_ needs contiguous tensors")
    live = [t for t in tensors if t.numel()]
    if live:
        programs = min(max(triton.cdiv(t.numel(), _BLOCK) for t in live), _MAX_PROGRAMS)
        slots = [(t, t.numel()) for t in live] + [(scale, 0)] * (MAX_TENSORS - len(live))
        args = [value for slot in slots for value in slot]
        _scale_unless_one_kernel[(programs, len(live))](*args, scale.reshape(1), programs, BLOCK=_BLOCK)
    return tensors


def scale_unless_one_(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``tensor *= scale`` in place (fp32 product, rounded once), nothing when ``scale == 1``.

    ``tensor`` must be contiguous; ``scale`` is a one-element tensor on the same device.
    """
    scale_all_unless_one_((tensor,), scale)
    return tensor
