"""fp32 values rounded to a 16-bit dtype as the GPU rounds them, in a kernel (the interpreter truncates)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["rounded"]


@triton.jit
def rounded(value, dtype: tl.constexpr):
    """fp32 ``value`` rounded to ``dtype`` (to nearest, ties to even) and back to fp32."""
    if dtype == tl.bfloat16:
        # By hand: the Triton interpreter truncates fp32 -> bf16 casts (the GPU rounds to nearest even).
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return value.to(dtype).to(tl.float32)
