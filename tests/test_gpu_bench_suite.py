"""The bench's measurement on CUDA: a known allocation's peak, and interleaved rounds as back-to-back ones.

Run with the GPU suite (``bash benchmarks/run_gpu_suite.sh tests``); skipped without CUDA. No timing is
asserted beyond "positive": speeds are benchmark outputs.
"""

from __future__ import annotations

import pytest
import torch

from flce_policy.benchmarks import suite
from flce_policy.benchmarks.methods import Method

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: what the allocating row holds at its peak: 4 MiB (a multiple of the caching allocator's 512-byte rounding)
HELD = 4 << 20


def _floor(_inputs):
    a = torch.randn(256, 256, device="cuda")

    def step():
        a @ a

    return step


def _allocating(_inputs):
    def step():
        held = torch.empty(HELD // 4, device="cuda")
        held.fill_(1.0)

    return step


@pytest.mark.parametrize("interleave", [False, True])
def test_rows_measure_their_own_peak_and_positive_times(interleave):
    rows = [Method("gemm_floor", "floor", step=_floor), Method("allocating", "test", step=_allocating)]
    records = suite.run_suite(
        [(1, 1, 1)], rows, warmup=1, repeats=5, inputs_for=lambda shape: None, interleave=interleave
    )
    by_name = {r.method: r for r in records}
    assert [r.status for r in records] == ["ok", "ok"]
    assert all(len(r.times_ms) == 5 and min(r.times_ms) > 0 for r in records)
    assert by_name["allocating"].peak_bytes == HELD
    assert by_name["gemm_floor"].peak_bytes < HELD  # a 256x256 product's result, nothing held over
    assert by_name["allocating"].x_floor == pytest.approx(
        by_name["allocating"].median_ms / by_name["gemm_floor"].median_ms
    )


@pytest.mark.parametrize("interleave", [False, True])
def test_sustained_samples_are_per_call_times_of_a_busy_window(interleave):
    """A 256x256 product's mean call over a 50 ms window: positive, and well under the window itself."""
    rows = [Method("gemm_floor", "floor", step=_floor), Method("allocating", "test", step=_allocating)]
    records = suite.run_suite(
        [(1, 1, 1)], rows, warmup=1, repeats=5, inputs_for=lambda shape: None, interleave=interleave, sustained_s=0.05
    )
    assert [r.status for r in records] == ["ok", "ok"]
    assert all(len(r.times_ms) == 5 and 0 < min(r.times_ms) and max(r.times_ms) < 50.0 for r in records)
    assert {r.method: r.peak_bytes for r in records}["allocating"] == HELD
