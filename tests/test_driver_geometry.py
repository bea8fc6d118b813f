"""The chunk driver runs exactly the geometry it is given, observed through ``observe_chunks()``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_loss_kernel import DEVICE, NEEDS_KERNEL_DEVICE

from flce_policy.kernels import driver
from flce_policy.kernels.driver import CEParams, ChunkEvent, GradRequest, observe_chunks, run_geometry
from flce_policy.loss import fused_linear_cross_entropy
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.strategies import FixedChunkSize

pytestmark = NEEDS_KERNEL_DEVICE

BT, H, V = 19, 24, 131  # few rows (the interpreter runs a program per row): chunk sizes up to BT - 1 and BT
ITEMSIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def make_inputs(bt: int = BT, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bt, H, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(V, H, generator=g) * (3.0 / H**0.5)).to(dtype).to(DEVICE)
    y = torch.randint(0, V, (bt,), generator=g).to(DEVICE)
    return x, w, y


def expected_events(tokens: int, chunk: int, vocab: int, itemsize: int) -> list[ChunkEvent]:
    """The chunk iterations of ``chunk`` rows over ``tokens``, computed here from first principles."""
    starts = list(range(0, tokens, chunk))
    return [
        ChunkEvent(i, start, min(chunk, tokens - start), (chunk, vocab), chunk * vocab * itemsize)
        for i, start in enumerate(starts)
    ]


def check_events(events: list[ChunkEvent], geometry: Geometry) -> None:
    """The events are exactly the geometry's chunks, in order, covering every row once."""
    p = geometry.problem
    assert len(events) == geometry.num_chunks
    assert [e.index for e in events] == list(range(geometry.num_chunks))
    for e in events:
        assert e.row_start == e.index * geometry.chunk_size
        assert e.slab_shape == (geometry.chunk_size, p.vocab)
        assert e.slab_bytes == geometry.slab_bytes
    assert all(e.rows == geometry.chunk_size for e in events[:-1])
    assert events[-1].rows == geometry.last_chunk_size
    assert sum(e.rows for e in events) == p.tokens
    assert events[-1].row_start + events[-1].rows == p.tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [1, 2, 5, 8, 16, 18, 19])
def test_driver_runs_exactly_the_given_geometry(chunk, dtype):
    problem = Problem(tokens=BT, hidden=H, vocab=V, dtype=dtype)
    geometry = Geometry.for_problem(problem, chunk)
    x, w, y = make_inputs(dtype=dtype)
    x.requires_grad_()
    with observe_chunks() as events:
        loss = fused_linear_cross_entropy(x, w, y, policy=geometry)
    check_events(events, geometry)
    assert events == expected_events(BT, chunk, V, ITEMSIZE[dtype])
    # mean: the gradients came with the forward pass; backward runs no chunk
    with observe_chunks() as backward_events:
        loss.backward()
    assert backward_events == []


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_reduction_none_backward_follows_the_same_geometry(chunk):
    geometry = Geometry.for_problem(Problem(tokens=BT, hidden=H, vocab=V, dtype=torch.float32), chunk)
    x, w, y = make_inputs()
    w.requires_grad_()
    with observe_chunks() as forward_events:
        loss = fused_linear_cross_entropy(x, w, y, policy=geometry, reduction="none")
    check_events(forward_events, geometry)
    with observe_chunks() as backward_events:
        loss.backward(torch.ones_like(loss))
    # backward may recompute the chunks (per-token grad_output); if it does, with the same geometry
    assert backward_events in ([], forward_events)


@pytest.mark.parametrize(
    ("strategy", "chunk"),
    [(FixedChunkSize(8), 8), (FixedChunkSize(6), 4), (FixedChunkSize(100), BT), (FixedChunkSize(1), 1)],
    ids=["fixed_8", "fixed_6_floored_to_4", "fixed_100_clamped_to_bt", "fixed_1"],
)
def test_strategy_geometry_is_run(strategy, chunk):
    problem = Problem(tokens=BT, hidden=H, vocab=V, dtype=torch.float32)
    x, w, y = make_inputs()
    with observe_chunks() as events:
        fused_linear_cross_entropy(x, w, y, policy=strategy)
    assert events == expected_events(BT, chunk, V, 4)
    check_events(events, strategy.geometry(problem, DeviceInfo.cpu()))


def test_3d_input_geometry_counts_flattened_rows():
    B, T = 3, 11
    geometry = Geometry.for_problem(Problem(tokens=B * T, hidden=H, vocab=V, dtype=torch.float32), 4)
    x, w, y = make_inputs(bt=B * T)
    with observe_chunks() as events:
        fused_linear_cross_entropy(x.view(B, T, H), w, y.view(B, T), policy=geometry)
    check_events(events, geometry)
    assert events == expected_events(B * T, 4, V, 4)


def test_run_geometry_directly():
    geometry = Geometry.for_problem(Problem(tokens=BT, hidden=H, vocab=V, dtype=torch.float32), 8)
    x, w, y = make_inputs()
    y[3] = -100
    with observe_chunks() as events:
        out = run_geometry(x, w, None, y, geometry, CEParams(), GradRequest())
    check_events(events, geometry)
    ref = F.cross_entropy(x.double() @ w.double().T, y, reduction="none")
    assert out.loss_rows.shape == (BT,)
    assert (out.loss_rows.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    assert out.grad_input is None and out.grad_weight is None and out.grad_bias is None


# --------------------------------------------------------------------------- a geometry for another problem

OTHER_PROBLEMS = [
    pytest.param({"tokens": BT - 1}, id="fewer_tokens"),
    pytest.param({"tokens": BT + 1}, id="more_tokens"),
    pytest.param({"hidden": H + 1}, id="other_hidden"),
    pytest.param({"vocab": V - 1}, id="other_vocab"),
    pytest.param({"dtype": "bfloat16"}, id="other_dtype"),
]


@pytest.mark.parametrize("change", OTHER_PROBLEMS)
def test_geometry_for_another_problem_is_refused(change):
    problem = Problem(**{"tokens": BT, "hidden": H, "vocab": V, "dtype": "float32", **change})
    geometry = Geometry.for_problem(problem, 5)
    x, w, y = make_inputs()
    x.requires_grad_()
    with observe_chunks() as events:
        with pytest.raises(ValueError, match="geometry") as info:
            fused_linear_cross_entropy(x, w, y, policy=geometry)
        with pytest.raises(ValueError, match="geometry"):
            run_geometry(x, w, None, y, geometry, CEParams(), GradRequest())
    assert problem.describe() in str(info.value)  # says what it was made for
    assert events == []  # refused before any chunk ran


def test_vocab_tiled_geometry_walks_its_row_chunks():
    # Vocab tiles within a row chunk are checked against the reference in test_vocab_tiled.py.
    geometry = Geometry.for_problem(Problem(tokens=BT, hidden=H, vocab=V, dtype=torch.float32), 8, vocab_chunk=64)
    x, w, y = make_inputs()
    with observe_chunks() as events:
        fused_linear_cross_entropy(x, w, y, policy=geometry)
    assert [e.rows for e in events] == [8] * (BT // 8) + ([BT % 8] if BT % 8 else [])
    assert {e.slab_shape for e in events} == {(8, 64)}


# --------------------------------------------------------------------------- the observer hook


def test_observer_removed_after_the_block():
    before = list(driver._observers)
    x, w, y = make_inputs(bt=9)
    with observe_chunks() as events:
        fused_linear_cross_entropy(x, w, y, policy=FixedChunkSize(4))
    assert len(events) == 3
    assert driver._observers == before
    fused_linear_cross_entropy(x, w, y, policy=FixedChunkSize(4))
    assert len(events) == 3  # nothing more recorded after the block


def test_observer_removed_when_the_block_raises():
    before = list(driver._observers)
    with pytest.raises(RuntimeError, match="boom"):
        with observe_chunks():
            raise RuntimeError("boom")
    assert driver._observers == before


def test_nested_observers_each_see_their_chunks():
    before = list(driver._observers)
    x, w, y = make_inputs(bt=9)
    with observe_chunks() as outer:
        fused_linear_cross_entropy(x, w, y, policy=FixedChunkSize(8))
        with observe_chunks() as inner:
            fused_linear_cross_entropy(x, w, y, policy=FixedChunkSize(4))
        assert len(driver._observers) == len(before) + 1
        fused_linear_cross_entropy(x, w, y, policy=FixedChunkSize(2))
    assert [e.rows for e in inner] == [4, 4, 1]
    assert [e.rows for e in outer] == [8, 1, 4, 4, 1, 2, 2, 2, 2, 1]
    assert driver._observers == before
