"""The fp32 grad_input accumulator of vocab tiles, in borrowed bytes (layout: flce_policy.plan.accumulator)."""

from __future__ import annotations

import torch

from flce_policy.plan.accumulator import AccumulatorLayout, narrow_step_rows

from .gemm import accumulate_mm

__all__ = ["InputAccumulator"]


def _as_fp32(buffer: torch.Tensor, rows: int, hidden: int) -> torch.Tensor:
    """The first ``rows x hidden`` fp32 values that fit in a contiguous ``buffer`` (half precision, or an
    fp32 master's grad_weight under autocast)."""
    elements = rows * hidden * 4 // buffer.element_size()
    return buffer.reshape(-1)[:elements].view(torch.float32).view(rows, hidden)


class InputAccumulator:
    """``acc [rows, H]`` fp32 for one row chunk, split into parts that live where ``layout`` says.

    ``out`` is the chunk's grad_input rows (the result lands there); ``grad_weight`` lends its last
    rows when the layout borrows them; ``separate`` is the caller's reusable buffer for the rest.
    """

    def __init__(
        self,
        out: torch.Tensor,
        layout: AccumulatorLayout,
        *,
        grad_weight: torch.Tensor | None,
        separate: torch.Tensor | None,
    ) -> None:
        self.out = out
        rows, hidden = out.shape
        if out.dtype == torch.float32:
            self.parts = [(0, out)]
            self.head_rows = 0
            return
        self.head_rows = rows // 2 if layout.in_grad_input else 0
        tail_rows = rows - self.head_rows
        self.parts = []
        if self.head_rows:
            self.parts.append((0, _as_fp32(out, self.head_rows, hidden)))
        if layout.in_grad_weight:
            tail = _as_fp32(grad_weight[-layout.borrowed_weight_rows :], tail_rows, hidden)
        else:
            tail = separate[:tail_rows]
        self.parts.append((self.head_rows, tail))

    def add(self, grad_logits: torch.Tensor, weight_tile: torch.Tensor, *, first: bool) -> None:
        """``acc (+)= grad_logits @ weight_tile``; ``first`` overwrites."""
        for start, part in self.parts:
            accumulate_mm(part, grad_logits[start : start + part.shape[0]], weight_tile, first=first)

    def finish(self) -> None:
        """Round the accumulator into ``out`` (in place where it lives there); its borrowed bytes are free after."""
        if self.out.dtype == torch.float32:
            return
        hidden = self.out.shape[1]
        if self.head_rows:
            head = self.parts[0][1]
            # Output row r overwrites fp32 rows r/2 .. (r+1)/2, all read by the time row r is written
            # when walking upward; the bounce buffer keeps each step's read ahead of its write.
            step = narrow_step_rows(hidden, self.out.element_size())
            for start in range(0, self.head_rows, step):
                stop = min(start + step, self.head_rows)
                self.out[start:stop].copy_(head[start:stop].to(self.out.dtype))
        # The tail lives elsewhere; its output rows cover only head rows already narrowed.
        start, tail = self.parts[-1]
        self.out[start:].copy_(tail)
