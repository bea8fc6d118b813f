"""The target's one-hot term of dL/dlogits, applied beside the GEMMs instead of through the bf16 slab.

With a scaled-exp slab the CE finish kernel writes ``coef_p * p`` (and the smoothing's terms) but not the
target's ``-coef_y``, and keeps ``coef_y`` per row (:attr:`.row_partials.CEWorkspace.target_coef`). Rounded
into the slab, that entry (``~ -1`` on a row whose target is not confident) carries most of a bf16
gradient's error: 0.0035 of grad_input's 0.0039 at logit std 4, against 0.0005 when it is applied exactly
(results/2026-12-02-h200-scaled-exp/cpu-scaled-exp-numerics.log). After the chunk's grad_input GEMM:

- ``grad_input[r] -= coef_y[r] * W[y_r]``, in fp32, rounded once;
- into an fp32 grad_weight (an fp32 accumulator, an fp32 master's gradient): after its GEMM,
  ``grad_weight[c] -= sum(coef_y[r] * x[r] for r with y_r = c)`` and ``grad_bias[c] -= sum(coef_y[r])``, the
  rows sorted by target, one program per target's run of rows summing in fp32 and writing its row (no
  atomics: the same result on every run);
- into a 16-bit grad_weight, where that read-modify-write would round each target's row once more, the
  term goes back into the slab before the grad_weight GEMM, rounded there as on the logits slab.

In the row-scaled form the slab holds ``E`` with ``f * E`` the gradient (``f`` per row): the same kernel then
scales grad_input's rows by ``f`` before the term, writes ``x_c`` times ``f`` (grad_weight's GEMM takes it beside
``E``) and puts ``coef_y / f`` into the slab for a 16-bit grad_weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import KERNELS_INTERPRETED
from .rounding import rounded
from .row_partials import CEWorkspace

__all__ = ["TargetTerms"]

_MAX_BLOCK_H = 1024
#: Rows and hidden columns per program of the grad_input / slab kernel, its grid over both: 512 rows of H = 5376 in
#: 9 µs a chunk, against 74 µs with a program looping over the hidden size (H100).
_ROWS, _ROW_BLOCK_H = 16, 128


@triton.jit
def _target_weight_grad_kernel(
    sorted_target_ptr,
    order_ptr,
    coef_ptr,
    x_ptr,
    x_stride,
    grad_weight_ptr,
    grad_weight_stride,
    grad_bias_ptr,
    n_rows,
    hidden,
    ignore_index,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0)
    pid_h = tl.program_id(1)
    target = tl.load(sorted_target_ptr + i)
    before = tl.load(sorted_target_ptr + i - 1, mask=i > 0, other=-1)
    # the first row of a target's run sums the run; an ignored row's run is skipped
    if (target != ignore_index) & ((i == 0) | (before != target)):
        hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = hs < hidden
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        total = 0.0
        j = i
        current = target
        while current == target:
            row = tl.load(order_ptr + j).to(tl.int64)
            coef = tl.load(coef_ptr + row)
            if HAS_WEIGHT:
                acc += coef * tl.load(x_ptr + row * x_stride + hs, mask=h_mask, other=0.0).to(tl.float32)
            total += coef
            j += 1
            current = tl.load(sorted_target_ptr + j, mask=j < n_rows, other=-1)  # -1: no class, ends the run
        if HAS_WEIGHT:
            out = grad_weight_ptr + target.to(tl.int64) * grad_weight_stride + hs
            kept = tl.load(out, mask=h_mask, other=0.0).to(tl.float32)
            tl.store(out, (kept - acc).to(grad_weight_ptr.dtype.element_ty), mask=h_mask)
        if HAS_BIAS:
            if pid_h == 0:
                tl.store(grad_bias_ptr + target, tl.load(grad_bias_ptr + target) - total)


@triton.jit
def _target_rows_kernel(
    target_ptr, coef_ptr, scale_ptr, weight_ptr, weight_stride, grad_input_ptr, grad_input_stride, slab_ptr,
    slab_stride, x_ptr, x_stride, x_scaled_ptr, n_rows, vocab, hidden, INPUT: tl.constexpr, SLAB: tl.constexpr,
    ROW_SCALED: tl.constexpr, X_OUT: tl.constexpr, IEEE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    # one program per block of rows and of hidden columns: a chunk of a few hundred rows still fills the GPU
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_in = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_in, other=-1)
    holds = row_in & (target >= 0) & (target < vocab)  # an ignored row's coef is 0: nothing to add
    target = tl.where(holds, target, 0).to(tl.int64)
    coef = tl.load(coef_ptr + rows, mask=holds, other=0.0)
    scale = tl.zeros([BLOCK_R], dtype=tl.float32)
    if ROW_SCALED:
        scale = tl.load(scale_ptr + rows, mask=row_in, other=0.0)
    rows = rows.to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = (h < hidden)[None, :]
    if INPUT:
        # the row-scaled form's GEMM gave slab @ W: every row is scaled, not only the targets' ones
        ok = holds[:, None] & in_h
        if ROW_SCALED:
            ok = row_in[:, None] & in_h
        w = tl.load(weight_ptr + target[:, None] * weight_stride + h[None, :], mask=holds[:, None] & in_h, other=0.0)
        out = grad_input_ptr + rows[:, None] * grad_input_stride + h[None, :]
        g = tl.load(out, mask=ok, other=0.0).to(tl.float32)
        if ROW_SCALED:
            g = g * scale[:, None]
        g = g - coef[:, None] * w.to(tl.float32)
        if IEEE:  # the interpreter truncates a cast to 16 bits: round to nearest first, as the GPU does
            g = rounded(g, grad_input_ptr.dtype.element_ty)
        tl.store(out, g.to(grad_input_ptr.dtype.element_ty), mask=ok)
    if X_OUT:  # x_c times each row's scale: the other operand of grad_weight's GEMM
        ok = row_in[:, None] & in_h
        xv = tl.load(x_ptr + rows[:, None] * x_stride + h[None, :], mask=ok, other=0.0).to(tl.float32)
        xs = xv * scale[:, None]
        if IEEE:
            xs = rounded(xs, x_scaled_ptr.dtype.element_ty)
        out = x_scaled_ptr + rows[:, None] * hidden + h[None, :]
        tl.store(out, xs.to(x_scaled_ptr.dtype.element_ty), mask=ok)
    if SLAB:
        if tl.program_id(1) == 0:  # one entry a row: the first column block's program writes it
            entry = slab_ptr + rows * slab_stride + target
            term = coef
            if ROW_SCALED:  # grad_weight's GEMM multiplies the slab's row by its scale again
                live = holds & (scale != 0.0)  # a zero scale has a zero coef: no term
                term = tl.where(live, coef / tl.where(live, scale, 1.0), 0.0)
            value = tl.load(entry, mask=holds, other=0.0).to(tl.float32) - term
            if IEEE:
                value = rounded(value, slab_ptr.dtype.element_ty)
            tl.store(entry, value.to(slab_ptr.dtype.element_ty), mask=holds)


class TargetTerms:
    """One chunk's one-hot terms: its ``target [n]`` and the workspace's ``coef_y`` (0 on ignored rows)."""

    def __init__(self, target: torch.Tensor, workspace: CEWorkspace, ignore_index: int) -> None:
        self.target = target
        self.coef = workspace.target_coef[: target.shape[0]]
        self.ignore_index = ignore_index

    @staticmethod
    def exact_for(grad_weight: torch.Tensor | None) -> bool:
        """Whether the grad_weight (and grad_bias) terms go beside the GEMM: an fp32 buffer, or none."""
        return grad_weight is None or grad_weight.dtype == torch.float32

    def into_chunk(
        self,
        grad_input: torch.Tensor | None,
        weight: torch.Tensor,
        slab: torch.Tensor | None,
        *,
        row_scale: torch.Tensor | None = None,
        x_chunk: torch.Tensor | None = None,
        x_scaled: torch.Tensor | None = None,
    ) -> None:
        """In one launch, each as given: ``grad_input [n, H] -= coef_y * W[y]`` (after the GEMM wrote the rest;
        fp32, rounded once) and ``slab[r, y_r] -= coef_y[r]`` (the term back in the chunk's gradient, for a
        16-bit grad_weight; before its GEMM).

        With ``row_scale`` (``f [n]``, the row-scaled form: the slab times ``f`` per row is the gradient),
        ``grad_input = f * grad_input - coef_y * W[y]`` on every row, ``x_scaled [n, H] = f * x_chunk`` where given
        (grad_weight's GEMM takes it beside the slab) and ``slab[r, y_r] -= coef_y[r] / f[r]``."""
        if grad_input is None and slab is None and row_scale is None:
            return
        n_rows = self.target.shape[0]
        vocab, hidden = weight.shape
        h_blocks = triton.cdiv(hidden, _ROW_BLOCK_H) if grad_input is not None or x_scaled is not None else 1
        _target_rows_kernel[(triton.cdiv(n_rows, _ROWS), h_blocks)](
            self.target, self.coef, row_scale, weight, weight.stride(0),
            grad_input, 0 if grad_input is None else grad_input.stride(0),
            slab, 0 if slab is None else slab.stride(0),
            x_chunk, 0 if x_chunk is None else x_chunk.stride(0), x_scaled,
            n_rows, vocab, hidden, INPUT=grad_input is not None, SLAB=slab is not None,
            ROW_SCALED=row_scale is not None, X_OUT=x_scaled is not None, IEEE=KERNELS_INTERPRETED,
            BLOCK_R=_ROWS, BLOCK_H=_ROW_BLOCK_H,
        )  # fmt: skip

    def into_weight_grads(
        self, grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None, x_chunk: torch.Tensor
    ) -> None:
        """``grad_weight [V, H]`` (fp32) and ``grad_bias [V]`` (fp32) minus the chunk's terms, after their GEMMs."""
        if grad_weight is None and grad_bias is None:
            return
        sorted_target, order = torch.sort(self.target, stable=True)
        n_rows, hidden = x_chunk.shape
        block_h = min(_MAX_BLOCK_H, triton.next_power_of_2(hidden))
        h_blocks = triton.cdiv(hidden, block_h) if grad_weight is not None else 1
        _target_weight_grad_kernel[(n_rows, h_blocks)](
            sorted_target,
            order,
            self.coef,
            x_chunk,
            x_chunk.stride(0),
            grad_weight,
            0 if grad_weight is None else grad_weight.stride(0),
            grad_bias,
            n_rows,
            hidden,
            self.ignore_index,
            HAS_WEIGHT=grad_weight is not None,
            HAS_BIAS=grad_bias is not None,
            BLOCK_H=block_h,
        )
