"""grad_weight_filter on the other paths of the driver: vocab tiles, rows over several blocks and segments,
a bias gradient alone, autocast over fp32 master weights, the OOM fallback; against the same fp64 reference
as tests/test_weight_grad_filter.py."""

from __future__ import annotations

import pytest
import torch
from test_loss_kernel import DEVICE, NEEDS_KERNEL_DEVICE, rel_err
from test_weight_grad_filter import (
    BF16_TOL,
    BT,
    EPS,
    FP32_TOL,
    assert_same,
    geometry,
    leaves,
    peaked_inputs,
    reference,
    run,
)

from flce_policy import fused_linear_cross_entropy
from flce_policy.kernels.driver import inject_oom
from flce_policy.kernels.weight_grad_filter import observe_tiles
from flce_policy.plan.accumulator import accumulator_layout
from flce_policy.plan.oom import OOMFallbackWarning
from flce_policy.plan.weight_filter import FILTER_ROWS

pytestmark = NEEDS_KERNEL_DEVICE


@pytest.mark.parametrize("chunk", [64, BT])  # two row chunks, and one
def test_vocab_tiled_geometry(chunk):
    t = leaves(peaked_inputs(seed=6), torch.float32)
    policy = geometry(torch.float32, chunk=chunk, vocab_chunk=256)
    dense = run(t, policy=policy)
    filtered = run(t, policy=policy, grad_weight_filter=EPS)
    ref = reference(t, torch.float32, eps=EPS, chunk=chunk, vocab_chunk=256)
    assert ref["kept_share"] < 0.9
    assert_same(filtered, dense)
    assert rel_err(filtered[2]["w"], ref["filtered_w"]) < FP32_TOL
    assert rel_err(filtered[2]["b"], ref["filtered_b"]) < FP32_TOL


def test_oom_fallback_keeps_the_filter():
    """A slab that does not fit is retried at half the rows: the result is the filtered run at that size."""
    t = leaves(peaked_inputs(seed=8), torch.float32)
    with inject_oom(above_rows=64), pytest.warns(OOMFallbackWarning):
        retried = run(t, policy=geometry(torch.float32, chunk=BT), grad_weight_filter=EPS)
    direct = run(t, policy=geometry(torch.float32, chunk=64), grad_weight_filter=EPS)
    assert_same(retried, direct)
    assert torch.equal(retried[2]["w"], direct[2]["w"]) and torch.equal(retried[2]["b"], direct[2]["b"])


def test_bias_gradient_alone_is_filtered():
    """A frozen head with a trained bias: the filtered kernel runs for grad_bias alone."""
    t = leaves(peaked_inputs(seed=9), torch.float32)
    t["w"].requires_grad_(False)
    ref = reference(t, torch.float32, eps=EPS, chunk=64)
    loss = fused_linear_cross_entropy(
        t["x"], t["w"], t["y"], t["b"], policy=geometry(torch.float32), grad_weight_filter=EPS
    )
    grad_b = torch.autograd.grad(loss, t["b"])[0]
    assert ref["kept_share"] < 0.9
    assert rel_err(grad_b, ref["filtered_b"]) < FP32_TOL
    assert rel_err(grad_b, ref["dense_b"]) > 1e-4


@pytest.mark.parametrize("block", [128, 256])  # 4 blocks in 2 segments of a row; 2 blocks of 2 flags each
def test_rows_in_several_blocks_and_segments(monkeypatch, block):
    from flce_policy.kernels import ce_kernel

    monkeypatch.setattr(ce_kernel, "MAX_BLOCK_V", block)
    t = leaves(peaked_inputs(seed=10), torch.float32)
    filtered = run(t, policy=geometry(torch.float32), grad_weight_filter=EPS)
    ref = reference(t, torch.float32, eps=EPS, chunk=64)
    assert ref["kept_share"] < 0.9
    assert rel_err(filtered[2]["w"], ref["filtered_w"]) < FP32_TOL
    assert rel_err(filtered[2]["b"], ref["filtered_b"]) < FP32_TOL


def test_autocast_over_fp32_master_weights():
    t = leaves(peaked_inputs(seed=11), torch.float32)
    policy = geometry(torch.bfloat16)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        dense = run(t, policy=policy)
        filtered = run(t, policy=policy, grad_weight_filter=EPS)
    ref = reference(t, torch.bfloat16, eps=EPS, chunk=64)
    assert ref["kept_share"] < 0.9
    assert_same(filtered, dense)
    assert filtered[2]["w"].dtype == torch.float32
    assert rel_err(filtered[2]["w"], ref["filtered_w"]) < BF16_TOL


def test_late_vocab_tiles_of_one_bf16_chunk():
    """One bf16 row chunk, H even: grad_input's fp32 accumulator borrows grad_weight's last rows, whose vocab
    tiles (the late ones) write grad_weight after it is narrowed, one of them computed a third time."""
    t = leaves(peaked_inputs(seed=12, hidden=64), torch.bfloat16)
    policy = geometry(torch.bfloat16, chunk=BT, vocab_chunk=96, hidden=64)
    assert accumulator_layout(policy).late_tiles == 2
    with observe_tiles() as tiles:
        filtered = run(t, policy=policy, grad_weight_filter=EPS)
    ref = reference(t, torch.bfloat16, eps=EPS, chunk=BT, vocab_chunk=96)
    assert ref["kept_share"] < 0.9
    # every tile counted once (row tiles of FILTER_ROWS rows x 6 vocab tiles), the late ones at their late launch
    tiles_per_call = -(-BT // FILTER_ROWS) * 6
    assert sum(int(c.kept) for c in tiles) == ref["kept_tiles"] and sum(c.total for c in tiles) == tiles_per_call
    assert rel_err(filtered[2]["w"], ref["filtered_w"]) < BF16_TOL
    assert rel_err(filtered[2]["b"], ref["filtered_b"]) < BF16_TOL
