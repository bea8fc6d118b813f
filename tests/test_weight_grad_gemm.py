"""The chunk grad_weight kernel (flce_policy.kernels.weight_grad_gemm) against float64 torch: ``acc (+)= G.T @ x``."""

from __future__ import annotations

import pytest
import torch
from test_loss_kernel import DEVICE, NEEDS_KERNEL_DEVICE

from flce_policy.kernels.weight_grad_gemm import WeightGradLaunch, weight_grad_gemm

pytestmark = NEEDS_KERNEL_DEVICE

SMALL = WeightGradLaunch(block_v=32, block_h=16, block_r=16, num_warps=4, num_stages=2)


def _operands(rows: int, vocab: int, hidden: int, dtype: torch.dtype, slab_cols: int | None = None):
    gen = torch.Generator().manual_seed(rows * 1000 + vocab + hidden)
    slab = torch.randn(rows, slab_cols or vocab, generator=gen, dtype=torch.float64)
    x = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    acc = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    return slab, x, acc


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab", "hidden"), [(40, 96, 48), (16, 32, 16), (37, 75, 23)])
def test_accumulates_the_chunk_product(first, dtype, rows, vocab, hidden):
    slab, x, acc = _operands(rows, vocab, hidden, dtype)
    g_dev, x_dev = slab.to(dtype).to(DEVICE), x.to(dtype).to(DEVICE)
    out = acc.to(dtype).to(DEVICE)
    weight_grad_gemm(out, g_dev, x_dev, first=first, launch=SMALL)
    expected = g_dev.double().cpu().t() @ x_dev.double().cpu() + (0 if first else acc.to(dtype).double())
    tol = 1e-4 if dtype == torch.float32 else 2**-7
    scale = expected.abs().max().item()
    assert (out.double().cpu() - expected).abs().max().item() <= tol * scale


def test_reads_a_row_strided_slab_and_leaves_other_columns():
    rows, vocab, hidden = 24, 40, 16
    slab, x, acc = _operands(rows, vocab, hidden, torch.float32, slab_cols=vocab + 8)
    g = slab.float().to(DEVICE)[:, :vocab]  # a view: rows vocab + 8 apart
    wide = torch.zeros(vocab, hidden + 4, device=DEVICE)
    wide[:, :hidden] = acc.float()
    weight_grad_gemm(wide[:, :hidden], g, x.float().to(DEVICE), first=False, launch=SMALL)
    expected = slab[:, :vocab].t() @ x + acc
    assert torch.allclose(wide[:, :hidden].double().cpu(), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(wide[:, hidden:].cpu(), torch.zeros(vocab, 4))


def test_refuses_operands_that_do_not_chain():
    g, x = torch.ones(8, 16, device=DEVICE), torch.ones(8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="do not chain"):
        weight_grad_gemm(torch.zeros(16, 5, device=DEVICE), g, x, first=True)
    with pytest.raises(ValueError, match="unit column strides"):
        weight_grad_gemm(torch.zeros(16, 4, device=DEVICE), torch.ones(16, 8, device=DEVICE).t(), x, first=True)
    with pytest.raises(ValueError, match="differ in dtype"):
        weight_grad_gemm(torch.zeros(16, 4, device=DEVICE), g, x.double(), first=True)


def test_the_benchmark_runs_every_method_on_the_same_operands():
    """benchmarks/weight_grad_gemm_bench.py's setup at a tiny shape (the interpreter on the CPU): each launch's
    result matches cuBLAS's (torch's) on the same operands, and each gets a time."""
    from flce_policy.benchmarks import weight_grad_gemm_bench as bench

    results = bench.run(hidden=16, vocab=40, rows=24, rounds=1, device=torch.device(DEVICE))
    assert set(results) == {
        "cublas_addmm",
        *(f"triton_{'{}x{}x{}_w{}_s{}'.format(*launch)}" for launch in bench.LAUNCHES),
    }
    for row in results.values():
        assert row["max_diff_rel"] < 1e-5 and row["ms"] > 0
