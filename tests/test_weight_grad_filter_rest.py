"""The filter's rest: a policy runs a problem's next filtered calls dense, without flags, after a call whose flags
bought nothing (so many tiles kept that its grad_weight ran the dense GEMM), then flags again
(flce_policy.plan.weight_filter.FilterRest).

The dense calls' results are the unfiltered call's, bit for bit; the call after the rest is filtered, against the
fp64 masked reference of tests/test_weight_grad_filter.py.
"""

from __future__ import annotations

import pytest
import torch
from test_loss_kernel import NEEDS_KERNEL_DEVICE, rel_err
from test_weight_grad_filter import (
    CHUNK_TILES,
    FLAT_EPS,
    FP32_TOL,
    assert_same,
    flat_inputs,
    geometry,
    leaves,
    peaked_inputs,
    reference,
    run,
)

from flce_policy import FLCEPolicy
from flce_policy.kernels import driver, weight_grad_filter
from flce_policy.kernels.driver import CEParams, GradRequest, run_geometry
from flce_policy.kernels.weight_grad_filter import observe_tiles
from flce_policy.plan import weight_filter
from flce_policy.plan.weight_filter import FILTER_REST_CALLS, FilterRest
from flce_policy.strategies import FixedChunkSize

pytestmark = NEEDS_KERNEL_DEVICE

#: the rest in these tests (the packaged one is FILTER_REST_CALLS): two calls keep them short
REST = 2
F32 = torch.float32


@pytest.fixture
def short_rest(monkeypatch):
    monkeypatch.setattr(weight_filter, "FILTER_REST_CALLS", REST)


@pytest.fixture
def flagged_chunks(monkeypatch):
    """Per row chunk the driver ran, whether its CE finish wrote flags."""
    seen: list[bool] = []
    ce_rows = driver.ce_rows

    def spy(*args, **kwargs):
        seen.append(kwargs["filter_flags"] is not None)
        return ce_rows(*args, **kwargs)

    monkeypatch.setattr(driver, "ce_rows", spy)
    return seen


def test_the_rest_counts_calls_at_its_eps_or_below():
    rest = FilterRest()
    assert rest.flags(FLAT_EPS)  # nothing recorded yet
    rest.went_dense(FLAT_EPS)
    assert rest.flags(2 * FLAT_EPS)  # a larger eps may skip where this one kept nearly all: it flags, uncounted
    calls = [rest.flags(FLAT_EPS / 2) for _ in range(FILTER_REST_CALLS + 2)]
    assert calls == [False] * FILTER_REST_CALLS + [True, True]


def test_a_policy_rests_after_flags_that_went_dense(short_rest, flagged_chunks):
    policy = FLCEPolicy(default=FixedChunkSize(64))  # BT=100: two chunks, as geometry(F32) gives
    flat, peaked = leaves(flat_inputs(), F32), leaves(peaked_inputs(), F32)
    dense = run(peaked, policy=policy)  # no filter: the rest is neither read nor started
    ref = reference(peaked, F32, eps=FLAT_EPS, chunk=64)
    assert ref["kept_share"] < 0.9  # something to skip at this eps

    flagged_chunks.clear()
    run(flat, policy=policy, grad_weight_filter=FLAT_EPS)
    assert flagged_chunks == [True, False]  # the first chunk went dense: so did the second, without flags
    for _ in range(REST):
        flagged_chunks.clear()
        with observe_tiles() as tiles:
            rested = run(peaked, policy=policy, grad_weight_filter=FLAT_EPS)
        assert flagged_chunks == [False, False]
        assert [int(c.kept) for c in tiles] == CHUNK_TILES == [c.total for c in tiles]  # counted, none skipped
        assert_same(rested, dense)
        assert torch.equal(rested[2]["w"], dense[2]["w"]) and torch.equal(rested[2]["b"], dense[2]["b"])

    flagged_chunks.clear()
    filtered = run(peaked, policy=policy, grad_weight_filter=FLAT_EPS)
    assert flagged_chunks == [True, True]  # the rest is over: the call flags, and finds tiles to skip
    assert_same(filtered, dense)
    off_masked = rel_err(filtered[2]["w"], ref["filtered_w"])
    assert off_masked < FP32_TOL
    assert rel_err(filtered[2]["w"], ref["dense_w"]) > 10 * off_masked  # the filter did skip
    flagged_chunks.clear()
    run(peaked, policy=policy, grad_weight_filter=FLAT_EPS)
    assert flagged_chunks == [True, True]  # tiles skipped start no rest


def test_no_rest_without_a_policy_nor_after_clear_cache(short_rest, flagged_chunks):
    flat, peaked = leaves(flat_inputs(), F32), leaves(peaked_inputs(), F32)
    given = geometry(F32)  # a Geometry: nothing remembered between calls
    run(flat, policy=given, grad_weight_filter=FLAT_EPS)
    flagged_chunks.clear()
    run(peaked, policy=given, grad_weight_filter=FLAT_EPS)
    assert flagged_chunks == [True, True]

    policy = FLCEPolicy(default=FixedChunkSize(64))
    run(flat, policy=policy, grad_weight_filter=FLAT_EPS)
    policy.clear_cache()
    flagged_chunks.clear()
    run(peaked, policy=policy, grad_weight_filter=FLAT_EPS)
    assert flagged_chunks == [True, True]


def test_a_call_at_a_larger_eps_flags_during_a_rest(short_rest, flagged_chunks):
    policy = FLCEPolicy(default=FixedChunkSize(64))
    flat, peaked = leaves(flat_inputs(), F32), leaves(peaked_inputs(), F32)
    run(flat, policy=policy, grad_weight_filter=FLAT_EPS)
    flagged_chunks.clear()
    run(peaked, policy=policy, grad_weight_filter=4 * FLAT_EPS)
    assert flagged_chunks == [True, True]
    flagged_chunks.clear()
    run(peaked, policy=policy, grad_weight_filter=FLAT_EPS)  # the rest at FLAT_EPS still holds its calls
    assert flagged_chunks == [False, False]


def test_a_captured_call_flags_whatever_the_rest(short_rest, flagged_chunks, monkeypatch):
    """A CUDA graph captured during a rest would replay without flags for good: capture ignores the rest (and
    reads no count, so it neither starts one). Capture is simulated: the interpreter has no CUDA stream."""
    policy = FLCEPolicy(default=FixedChunkSize(64))
    flat, peaked = leaves(flat_inputs(), F32), leaves(peaked_inputs(), F32)
    ref = reference(peaked, F32, eps=FLAT_EPS, chunk=64)
    run(flat, policy=policy, grad_weight_filter=FLAT_EPS)
    with monkeypatch.context() as capture:
        capture.setattr(weight_grad_filter, "capturing", lambda device: True)
        flagged_chunks.clear()
        captured = run(peaked, policy=policy, grad_weight_filter=FLAT_EPS)
    assert flagged_chunks == [True, True]
    assert rel_err(captured[2]["w"], ref["filtered_w"]) < FP32_TOL
    flagged_chunks.clear()
    run(peaked, policy=policy, grad_weight_filter=FLAT_EPS)  # the rest's calls are all still there
    assert flagged_chunks == [False, False]


@pytest.mark.parametrize("peaked", [False, True])
def test_the_vocab_tiled_driver_starts_a_rest_only_when_every_vocab_tile_went_dense(peaked):
    t = (peaked_inputs if peaked else flat_inputs)()
    x, w, b, y = t["x"], t["w"], t.get("b"), t["y"]  # the peaked inputs' bias makes them peaked
    rest = FilterRest()
    params = CEParams(grad_weight_filter=FLAT_EPS, grad_weight_filter_rest=rest)
    scale = torch.tensor([1.0 / len(y), 0.0], device=x.device)
    run_geometry(x, w, b, y, geometry(F32, vocab_chunk=256), params, GradRequest(weight=True), grad_scale=scale)
    assert rest.flags(FLAT_EPS) == peaked  # resting (no flags) after the flat logits only
