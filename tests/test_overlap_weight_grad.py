"""``Geometry.overlap_weight_grad``: grad_weight's GEMM on a second CUDA stream (kernels/side_stream.py).

On CPU there are no streams: the driver runs the same calls in order, so here the loss and gradients of an
overlapped geometry are held against the float64 torch reference, and the field's validation, its passage through
the OOM fallback, the vocab-parallel agreement and the compiled op are checked. tests/test_gpu_overlap_weight_grad.py
compares the overlapped run with the serial one on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from test_loss_kernel import (
    DEVICE,
    FP32_TOL,
    NEEDS_KERNEL_DEVICE,
    _eager_factor,
    assert_close,
    grads,
    leaves,
    make_inputs,
    rel_l2,
    run_flce,
    run_reference,
)

from flce_policy import fused_linear_cross_entropy
from flce_policy.call.autograd import FLCEFunction
from flce_policy.call.options import LossOptions
from flce_policy.distributed import vocab_parallel
from flce_policy.kernels import driver
from flce_policy.kernels.driver import CEParams, GradRequest, inject_oom, observe_chunks, run_geometry
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.oom import OOMFallback
from flce_policy.plan.problem import Problem

pytestmark = NEEDS_KERNEL_DEVICE

BT, H, V = 13, 61, 509  # test_loss_kernel's inputs: chunks of 4 leave a 1-row tail


def overlapped(dtype: torch.dtype, chunk: int, **fields) -> Geometry:
    problem = Problem(tokens=BT, hidden=H, vocab=V, dtype=dtype)
    return Geometry.for_problem(problem, chunk, **{"overlap_weight_grad": True, **fields})


@pytest.mark.parametrize("reduction", ["mean", "none"])  # none: the gradients come from backward's second run
@pytest.mark.parametrize("chunk", [1, 4, 8, BT])
def test_overlapped_loss_and_gradients_equal_the_reference(chunk, reduction):
    inputs = make_inputs(bias=True, n_ignored=3, ignore_index=-1)
    options = dict(reduction=reduction, ignore_index=-1, label_smoothing=0.1)
    t, exact = leaves(inputs, torch.float32), leaves(inputs, torch.float64)
    with observe_chunks() as events:
        loss = run_flce(t, policy=overlapped(torch.float32, chunk), **options)
        grad_output = None if reduction == "mean" else torch.linspace(-1.0, 2.0, BT, device=DEVICE)
        got = grads(loss, t, grad_output)
    ref_loss = run_reference(exact, **options)[0]
    assert_close(loss, ref_loss, FP32_TOL, "loss")
    want = grads(ref_loss, exact, grad_output)
    assert set(got) == {"x", "w", "b"}
    for k in want:
        assert_close(got[k], want[k], FP32_TOL, f"grad {k}")
    runs = 1 if reduction == "mean" else 2  # none runs the chunks again in backward
    assert len(events) == runs * -(-BT // chunk)


def test_overlapped_bf16_with_an_fp32_accumulator_within_eager_error():
    """bf16 inputs, grad_weight accumulated in fp32 over 4 chunks: within the error bound of test_loss_kernel's
    low-precision test (a multiple of eager torch's own error against the exact reference)."""
    inputs = make_inputs(bias=True, n_ignored=2)
    low = leaves(inputs, torch.bfloat16)
    exact, eager = leaves(low, torch.float64), leaves(low, torch.bfloat16)
    ref_loss, eager_loss = run_reference(exact)[0], run_reference(eager, upcast=torch.float32)[0]
    want, eager_grads = grads(ref_loss, exact, None), grads(eager_loss, eager, None)
    geometry = overlapped(torch.bfloat16, 4, accum_dtype="float32")

    loss = run_flce(low, policy=geometry)
    got = grads(loss, low, None)
    floor = torch.finfo(torch.bfloat16).eps / 16
    assert rel_l2(loss, ref_loss) <= max(2 * rel_l2(eager_loss, ref_loss), floor)
    for k in want:
        assert got[k].dtype == torch.bfloat16
        tol = max(_eager_factor(torch.bfloat16) * rel_l2(eager_grads[k], want[k]), floor)
        assert rel_l2(got[k], want[k]) <= tol, f"grad {k}"


# --- validation --------------------------------------------------------------------------------------


def test_vocab_tiles_are_refused():
    with pytest.raises(ValidationError, match=r"overlap_weight_grad=True cannot run .*runs row-only geometry"):
        overlapped(torch.float32, 4, vocab_chunk=128)


def test_a_filter_on_the_geometry_is_refused():
    with pytest.raises(ValidationError, match="the grad_weight filter's flagged GEMM runs on one stream only"):
        overlapped(torch.float32, 4, grad_weight_filter=2**-12)
    with pytest.raises(ValueError, match="the grad_weight filter's flagged GEMM runs on one stream only"):
        overlapped(torch.float32, 4).with_filter(2**-12)
    assert overlapped(torch.float32, 4, grad_weight_filter=0.0).overlap_weight_grad  # eps 0: the dense path


def test_a_filter_given_to_the_call_is_refused():
    t = leaves(make_inputs(), torch.float32)
    with pytest.raises(ValueError, match=r"grad_weight_filter=0\.000244141 with overlap_weight_grad=True"):
        run_flce(t, policy=overlapped(torch.float32, 4), grad_weight_filter=2**-12)
    # and by the driver itself, for a caller that builds its parameters by hand
    x, w, y = t["x"].detach(), t["w"].detach(), t["y"]
    with pytest.raises(ValueError, match="with a grad_weight filter"):
        run_geometry(
            x, w, None, y, overlapped(torch.float32, 4), CEParams(grad_weight_filter=2**-12), GradRequest(weight=True),
            grad_scale=torch.ones(2, device=DEVICE),
        )  # fmt: skip


@pytest.mark.parametrize("slab_form", ["scaled_exp", "scaled_exp_rows", "scaled_exp_ws"])
def test_scaled_exp_forms_are_refused(slab_form):
    """The target's term goes into the slab between the two GEMMs (kernels/target_grad.py): nothing to overlap."""
    problem = Problem(tokens=64, hidden=64, vocab=512, dtype="bfloat16")  # a problem the scaled-exp slab runs
    with pytest.raises(ValidationError, match=f"slab_form='{slab_form}' writes the target's term into the slab"):
        Geometry.for_problem(problem, 16, slab_form=slab_form, overlap_weight_grad=True)
    geometry = Geometry.for_problem(problem, 16, overlap_weight_grad=True)
    with pytest.raises(ValidationError, match="so the two GEMMs cannot overlap"):
        geometry.with_slab_form(slab_form)
    with pytest.raises(ValidationError, match="so the two GEMMs cannot overlap"):
        Geometry.for_problem(problem, 16, slab_form=slab_form).with_overlap_weight_grad()


def test_only_a_bool_switches_it():
    with pytest.raises(ValidationError, match="overlap_weight_grad\n  Input should be a valid boolean"):
        overlapped(torch.float32, 4, overlap_weight_grad=1)


def test_the_default_geometry_is_unchanged_and_the_field_shows_when_on():
    problem = Problem(tokens=BT, hidden=H, vocab=V, dtype="float32")
    plain, on = Geometry.for_problem(problem, 4), overlapped(torch.float32, 4)
    assert "overlap_weight_grad" not in plain.model_dump()  # records and explain --json as before
    assert "side stream" not in plain.describe()
    assert on.describe() == "4 chunks of 4 rows, slab 7.95 KiB, grad_weight GEMM on a side stream (manual)"
    assert Geometry.model_validate({**on.model_dump(), "problem": problem}) == on
    assert on != plain and on.with_overlap_weight_grad(False) == plain
    assert hash(on.with_overlap_weight_grad(False)) == hash(plain)


# --- every path keeps it ----------------------------------------------------------------------------


def test_the_oom_fallback_keeps_the_field():
    """Chunks of 8 rows fail; the call completes at 4, still on the side stream, with the reference's result."""
    inputs = make_inputs(n_ignored=2)
    t, exact = leaves(inputs, torch.float32, ("x", "w")), leaves(inputs, torch.float64, ("x", "w"))
    completed: list[Geometry] = []
    fallback = OOMFallback(min_chunk_size=1, remember=completed.append)
    with inject_oom(above_rows=4) as faults, pytest.warns(UserWarning, match="completed at 4 rows"):
        args = (t["x"], t["w"], None, t["y"], None, overlapped(torch.float32, 8), LossOptions(), True, fallback)
        loss = FLCEFunction.apply(*args)[0]
    assert faults == [(8, 0)]
    assert [(g.chunk_size, g.overlap_weight_grad) for g in completed] == [(4, True)]
    ref_loss = run_reference(exact)[0]
    assert_close(loss, ref_loss, FP32_TOL, "loss")
    got, want = grads(loss, t, None), grads(ref_loss, exact, None)
    for k in want:
        assert_close(got[k], want[k], FP32_TOL, f"grad {k}")


def test_the_vocab_parallel_agreement_keeps_the_field():
    """A rank's geometry moved to the group's smallest chunk keeps its side stream."""
    geometry = overlapped(torch.float32, 8)
    agreed = vocab_parallel._with_rows(geometry, 4, [8, 4])
    assert (agreed.chunk_size, agreed.overlap_weight_grad) == (4, True)


@pytest.fixture
def geometries_run(monkeypatch):
    """The geometries the row driver ran, seen where it asks for its grad_weight stream."""
    seen: list[Geometry] = []
    real = driver.weight_grad_stream

    def spy(geometry, device, filtered):
        seen.append(geometry)
        return real(geometry, device, filtered)

    monkeypatch.setattr(driver, "weight_grad_stream", spy)
    return seen


def test_the_compiled_op_keeps_the_field(geometries_run):
    torch._dynamo.reset()
    inputs = make_inputs(bias=True, n_ignored=2)
    t, exact = leaves(inputs, torch.float32), leaves(inputs, torch.float64)
    geometry = overlapped(torch.float32, 4)
    compiled = torch.compile(
        lambda x, w, y, b: fused_linear_cross_entropy(x, w, y, b, policy=geometry), fullgraph=True, backend="aot_eager"
    )
    try:
        loss = compiled(t["x"], t["w"], t["y"], t["b"])
        got = grads(loss, t, None)
    finally:
        torch._dynamo.reset()
    assert geometries_run and all(g.overlap_weight_grad and g.chunk_size == 4 for g in geometries_run)
    ref_loss = run_reference(exact)[0]
    assert_close(loss, ref_loss, FP32_TOL, "loss")
    want = grads(ref_loss, exact, None)
    for k in want:
        assert_close(got[k], want[k], FP32_TOL, f"grad {k}")
