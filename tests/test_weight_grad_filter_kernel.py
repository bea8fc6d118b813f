"""The filtered grad_weight kernel alone, on both of its launches, against fp64 torch over the kept tiles.

``filtered_weight_grad`` runs its TMA launch where descriptors can load both operands (16-bit, rows
16-byte aligned: the interpreter runs it too) and its two pointer-based launches otherwise. The flags are
set here by hand, so every kind of column block occurs: all row tiles kept, none, some (the last row tile
ragged), and the result is checked over two chunks (the first overwrites, the second adds).
"""

from __future__ import annotations

import pytest
import torch
from test_loss_kernel import DEVICE, rel_err

from flce_policy.kernels.tma import tma_tensors
from flce_policy.kernels.weight_grad_filter import filter_scratch, filtered_weight_grad
from flce_policy.plan.weight_filter import FILTER_COLS, FILTER_ROWS

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(),
    reason="the kernels were compiled (TRITON_INTERPRET unset) and there is no CUDA GPU",
)

ROWS = 150  # row tiles of 64, 64 and 22 rows
#: fp32 accumulation of bf16 products against fp64
TOL = 1e-5


def chunk_inputs(seed: int, hidden: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's G and x in bf16 and its kept-tile mask [row tiles, column blocks]: column block 0 keeps
    every row tile, block 1 none, the others a random half (the last row tile always kept somewhere)."""
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(ROWS, cols, generator=g).to(torch.bfloat16)
    x = torch.randn(ROWS, hidden, generator=g).to(torch.bfloat16)
    row_tiles, col_blocks = -(-ROWS // FILTER_ROWS), -(-cols // FILTER_COLS)
    mask = torch.rand(row_tiles, col_blocks, generator=g) < 0.5
    mask[:, 0], mask[:, 1], mask[-1, 2] = True, False, True
    return grad.to(DEVICE), x.to(DEVICE), mask


def set_flags(scratch, mask: torch.Tensor, cols: int) -> None:
    """Flags per row and column block from the tile mask, one kept row per kept tile (the kernel keeps a
    tile when any of its rows is flagged)."""
    flags = torch.zeros(ROWS, mask.shape[1], dtype=torch.uint8)
    for r, c in mask.nonzero().tolist():
        flags[min(r * FILTER_ROWS + 7, ROWS - 1), c] = 1
    scratch.flags[:ROWS, : mask.shape[1]].copy_(flags.to(DEVICE))


def expand(mask: torch.Tensor, cols: int) -> torch.Tensor:
    return mask.repeat_interleave(FILTER_ROWS, 0)[:ROWS].repeat_interleave(FILTER_COLS, 1)[:, :cols].double()


@pytest.mark.parametrize(
    ("hidden", "cols", "tma"),
    # 60 x 2 bytes, 500 x 2 bytes: rows not 16-byte aligned; 256 and 192 hidden: the TMA launch's wide blocks and
    # its narrow ones for a hidden size that is not a multiple of 256 (two blocks of 128, the second half masked)
    [(64, 512, True), (256, 384, True), (192, 384, True), (60, 512, False), (64, 500, False)],
    ids=["tma", "tma-wide", "tma-narrow", "pointer-x", "pointer-grad"],
)
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight+bias", "bias"])
def test_two_chunks_against_fp64(hidden, cols, tma, with_weight):
    scratch = filter_scratch(ROWS, cols, torch.device(DEVICE))
    grad_weight = torch.full((cols, hidden), float("nan"), device=DEVICE) if with_weight else None
    grad_bias = torch.zeros(cols, device=DEVICE)
    want_w = torch.zeros(cols, hidden, dtype=torch.float64)
    want_b = torch.zeros(cols, dtype=torch.float64)
    for index, seed in enumerate((0, 1)):
        grad, x, mask = chunk_inputs(seed, hidden, cols)
        assert tma_tensors(grad, x) == tma
        set_flags(scratch, mask, cols)
        filtered_weight_grad(grad_weight, grad, x, scratch, first=index == 0, grad_bias=grad_bias)
        kept = grad.cpu().double() * expand(mask, cols)
        want_w += kept.T @ x.cpu().double()
        want_b += kept.sum(0)
    if with_weight:
        assert not grad_weight.isnan().any(), "a block with no kept tile was left unwritten on the first chunk"
        assert rel_err(grad_weight.cpu().double(), want_w) < TOL
        assert torch.all(grad_weight[FILTER_COLS : 2 * FILTER_COLS] == 0)  # column block 1: nothing kept
    assert rel_err(grad_bias.cpu().double(), want_b) < TOL


def test_an_ignored_row_clears_its_flags_in_every_block_of_the_row():
    """The CE finish kernel flags nothing on an ignored row, in each of its column blocks (V = 9000: three
    blocks of 4096 columns), whatever the flags held before (here all set)."""
    from flce_policy.kernels.ce_kernel import ce_rows, ce_workspace

    rows, vocab = 4, 9000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    target = torch.full((rows,), -100, dtype=torch.int64, device=DEVICE)
    workspace = ce_workspace(rows, vocab, logits.device)
    flags = filter_scratch(rows, vocab, logits.device).flags.fill_(1)
    loss = torch.empty(rows, device=DEVICE)
    grad_scale = torch.ones(2, device=DEVICE)
    ce_rows(
        logits, target, loss, workspace, ignore_index=-100, grad_scale=grad_scale, filter_flags=flags, filter_eps=0.5
    )
    assert workspace.block_v < vocab  # several blocks per row
    assert not flags.any()
