"""OOM resilience: a slab that runs out of memory is retried at half the rows, with a clean result.

Faults come through the driver's seam (``inject_oom``: an OutOfMemoryError right before a chunk
fills the slab, for chunks of more than N rows), never by patching torch. Each result is compared
with an uninterrupted run at the geometry the fallback completed at, bit for bit, and with a
float64 torch reference on explicit logits.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_loss_kernel import DEVICE, NEEDS_KERNEL_DEVICE

from flce_policy import FLCEPolicy, OOMFallbackWarning, fused_linear_cross_entropy
from flce_policy.call.autograd import FLCEFunction
from flce_policy.call.options import LossOptions
from flce_policy.engine.probe import device_for_tensor_device
from flce_policy.kernels.driver import CEParams, GradRequest, inject_oom, observe_chunks
from flce_policy.kernels.resilient import run_with_oom_fallback
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.oom import OOMFallback
from flce_policy.plan.problem import Problem
from flce_policy.strategies import FixedChunkSize

pytestmark = NEEDS_KERNEL_DEVICE
HERE = device_for_tensor_device(DEVICE)  # the device the loss resolves (and remembers) for these tensors

# Small: chunks of 16 rows are 3 (16, 16, 5), so chunk 1 is a middle one. The policy's floor is set
# to 1 row for these; the default floor (64 rows) gets the larger problem below.
BT, H, V = 37, 24, 131
# Large enough for the default floor: 128 rows fall back to 64 (2 chunks of 64 and a tail of 2).
BIG_BT, BIG_V = 130, 67
TOL = 1e-5  # fp32 kernel against the float64 reference (see test_loss_kernel.py)


def make_inputs(tokens: int = BT, vocab: int = V, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(DEVICE)
    w = (torch.randn(vocab, H, generator=g) * (3.0 / H**0.5)).to(DEVICE)
    y = torch.randint(0, vocab, (tokens,), generator=g).to(DEVICE)
    y[3] = -100
    return x, w, y


def problem_of(x: torch.Tensor, w: torch.Tensor) -> Problem:
    return Problem(tokens=x.shape[0], hidden=x.shape[1], vocab=w.shape[0], dtype=x.dtype)


def reference(x, w, y, reduction="mean", grad_output=None):
    """Loss and (grad_x, grad_w) of F.cross_entropy on explicit float64 logits."""
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    loss = F.cross_entropy(xr @ wr.t(), y, reduction=reduction)
    grads = torch.autograd.grad(loss, (xr, wr), grad_output.double() if grad_output is not None else None)
    return loss.detach(), grads


def loss_and_grads(x, w, y, *, policy=None, fallback="default", reduction="mean", grad_output=None):
    """Loss and grads through FLCEFunction, given the fallback the loss hands it (``"default"``: none given).

    ``policy`` is an FLCEPolicy (its geometry and fallback are used, as the loss does with one)
    or a Geometry.
    """
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    if isinstance(policy, FLCEPolicy):
        device = HERE
        geometry = policy.resolve(problem_of(x, w), device)
        fallback = policy.oom_fallback_for(problem_of(x, w), device)
    else:
        geometry = policy
    args = (xr, wr, None, y, None, geometry, LossOptions(reduction=reduction), True)
    loss, *_ = FLCEFunction.apply(*args) if fallback == "default" else FLCEFunction.apply(*args, fallback)
    loss.backward(grad_output)
    return loss.detach(), (xr.grad, wr.grad)


def public_loss_and_grads(x, w, y, policy, **options):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fused_linear_cross_entropy(xr, wr, y, policy=policy, **options)
    loss.backward(torch.ones_like(loss) if options.get("reduction") == "none" else None)
    return loss.detach(), (xr.grad, wr.grad)


def assert_identical(got, want):
    (loss, (gx, gw)), (want_loss, (want_gx, want_gw)) = got, want
    assert torch.equal(loss, want_loss)
    assert torch.equal(gx, want_gx)
    assert torch.equal(gw, want_gw)


def assert_matches_reference(got, ref):
    (loss, grads), (ref_loss, ref_grads) = got, ref
    torch.testing.assert_close(loss.double(), ref_loss, rtol=TOL, atol=TOL)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=TOL, atol=TOL)


def fallback_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, OOMFallbackWarning)]


def policy_of(chunk: int, **settings) -> FLCEPolicy:
    return FLCEPolicy(default=FixedChunkSize(chunk), **{"min_chunk_size": 1, **settings})


# --- through the public loss (a Geometry: the default floor, nothing remembered) ---------------------


def test_oom_at_the_first_chunk_completes_as_a_clean_run_at_half_the_rows():
    x, w, y = make_inputs(BIG_BT, BIG_V)
    problem = problem_of(x, w)
    clean = public_loss_and_grads(x, w, y, Geometry.for_problem(problem, 64))
    with warnings.catch_warnings(record=True) as record, inject_oom(at_chunk=0, above_rows=64) as faults:
        warnings.simplefilter("always")
        result = public_loss_and_grads(x, w, y, Geometry.for_problem(problem, 128))
    assert faults == [(128, 0)]
    assert_identical(result, clean)
    assert_matches_reference(result, reference(x, w, y))
    (message,) = fallback_warnings(record)
    assert f"out of memory on {x.device} at 128 rows" in message and "completed at 64 rows" in message
    assert "not remembered" in message


def test_a_geometry_at_the_default_floor_is_not_halved():
    x, w, y = make_inputs(BIG_BT, BIG_V)
    with inject_oom(above_rows=0) as faults, pytest.raises(torch.cuda.OutOfMemoryError) as info:
        public_loss_and_grads(x, w, y, Geometry.for_problem(problem_of(x, w), 64))
    assert faults == [(64, 0)]
    assert "min_chunk_size=64" in str(info.value) and "(64 rows)" in str(info.value)


# --- through the autograd Function, with a policy's fallback -----------------------------------------


def test_oom_at_a_middle_chunk_leaves_nothing_half_accumulated():
    x, w, y = make_inputs()
    clean = loss_and_grads(x, w, y, policy=Geometry.for_problem(problem_of(x, w), 8))
    with observe_chunks() as events, inject_oom(at_chunk=1, above_rows=8) as faults, pytest.warns(OOMFallbackWarning):
        result = loss_and_grads(x, w, y, policy=policy_of(16))
    assert faults == [(16, 1)]
    # chunk 0 of the failed attempt (its grad_weight was written), then all 5 chunks of 8 afresh
    assert [(e.index, e.rows) for e in events] == [(0, 16), (0, 8), (1, 8), (2, 8), (3, 8), (4, 5)]
    assert_identical(result, clean)
    assert_matches_reference(result, reference(x, w, y))


def test_halves_again_until_a_size_fits_and_warns_once_naming_both_ends():
    x, w, y = make_inputs()
    clean = loss_and_grads(x, w, y, policy=Geometry.for_problem(problem_of(x, w), 4))
    with warnings.catch_warnings(record=True) as record, inject_oom(above_rows=4) as faults:
        warnings.simplefilter("always")
        result = loss_and_grads(x, w, y, policy=policy_of(16))
    assert faults == [(16, 0), (8, 0)]
    assert_identical(result, clean)
    (message,) = fallback_warnings(record)
    assert "at 16 rows" in message and "then at 8 rows" in message and "completed at 4 rows" in message


def test_the_policy_remembers_what_completed_so_the_next_call_does_not_fail_again():
    x, w, y = make_inputs()
    policy, problem = policy_of(16), problem_of(x, w)
    with warnings.catch_warnings(record=True) as record, inject_oom(above_rows=8) as faults:
        warnings.simplefilter("always")
        first = loss_and_grads(x, w, y, policy=policy)
        remembered = policy.resolve(problem, HERE)
        with observe_chunks() as second_events:
            second = loss_and_grads(x, w, y, policy=policy)
    assert faults == [(16, 0)]  # the second call made no attempt at 16 rows
    assert (remembered.chunk_size, remembered.rule) == (8, "default")
    assert remembered.strategy == "oom fallback from 16 rows (FixedChunkSize(chunk_size=16))"
    assert [e.rows for e in second_events] == [8, 8, 8, 8, 5]
    assert len(fallback_warnings(record)) == 1
    assert "later calls of this problem on this device start from it" in fallback_warnings(record)[0]
    assert_identical(second, first)
    # another problem on the same device is not affected
    assert policy.resolve(problem_of(x[:20], w), HERE).chunk_size == 16


def test_the_floor_reached_raises_naming_every_size_tried():
    x, w, y = make_inputs()
    policy = policy_of(16, min_chunk_size=4)
    with inject_oom(above_rows=0) as faults, pytest.raises(torch.cuda.OutOfMemoryError) as info:
        loss_and_grads(x, w, y, policy=policy)
    assert faults == [(16, 0), (8, 0), (4, 0)]
    message = str(info.value)
    assert "(16, 8, 4 rows)" in message and "the smallest, 4 rows" in message and "min_chunk_size=4" in message
    assert "injected" in message  # the last OOM's own text
    assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)
    assert policy.resolve(problem_of(x, w), HERE).chunk_size == 16  # nothing completed, nothing remembered


def test_the_floor_is_never_undershot_when_halving_skips_past_it():
    x, w, y = make_inputs()
    clean = loss_and_grads(x, w, y, policy=Geometry.for_problem(problem_of(x, w), 6))
    with inject_oom(above_rows=6) as faults, pytest.warns(OOMFallbackWarning, match="completed at 6 rows"):
        result = loss_and_grads(x, w, y, policy=policy_of(16, min_chunk_size=6))
    assert faults == [(16, 0), (8, 0)]  # 16 -> 8 -> 6 (not 4: below the floor)
    assert_identical(result, clean)


def test_fallback_switched_off_in_the_policy_lets_the_oom_propagate():
    x, w, y = make_inputs()
    policy = policy_of(16, oom_fallback=False)
    assert policy.oom_fallback_for(problem_of(x, w), HERE) is None
    with inject_oom(above_rows=8) as faults, pytest.raises(torch.cuda.OutOfMemoryError, match="injected"):
        loss_and_grads(x, w, y, policy=policy)
    assert faults == [(16, 0)]


def test_reduction_none_backward_runs_at_the_geometry_the_forward_completed_at():
    x, w, y = make_inputs()
    g = torch.linspace(-1.0, 2.0, BT, device=DEVICE)
    clean = loss_and_grads(x, w, y, policy=Geometry.for_problem(problem_of(x, w), 8), reduction="none", grad_output=g)
    with observe_chunks() as events, inject_oom(above_rows=8) as faults, pytest.warns(OOMFallbackWarning):
        result = loss_and_grads(x, w, y, policy=policy_of(16), reduction="none", grad_output=g)
    assert faults == [(16, 0)]  # backward never tried 16 rows
    # forward: 5 chunks of 8 (the attempt at 16 failed before its chunk 0 ran); backward: the same 5
    assert [e.rows for e in events] == [8, 8, 8, 8, 5] * 2
    assert_identical(result, clean)
    assert_matches_reference(result, reference(x, w, y, "none", g))


def test_reduction_none_backward_falls_back_on_its_own():
    x, w, y = make_inputs()
    policy, g = policy_of(16), torch.linspace(-1.0, 2.0, BT, device=DEVICE)
    clean = loss_and_grads(x, w, y, policy=Geometry.for_problem(problem_of(x, w), 8), reduction="none", grad_output=g)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    problem = problem_of(x, w)
    geometry, fallback = policy.resolve(problem, HERE), policy.oom_fallback_for(problem, HERE)
    loss, *_ = FLCEFunction.apply(xr, wr, None, y, None, geometry, LossOptions(reduction="none"), True, fallback)
    with warnings.catch_warnings(record=True) as record, inject_oom(above_rows=8) as faults:
        warnings.simplefilter("always")
        loss.backward(g)  # the forward had the memory; the recomputation in backward does not
    assert faults == [(16, 0)]
    assert len(fallback_warnings(record)) == 1
    assert_identical((loss.detach(), (xr.grad, wr.grad)), clean)
    assert policy.resolve(problem, HERE).chunk_size == 8


def test_run_with_oom_fallback_without_a_fallback_runs_once():
    x, w, y = make_inputs()
    geometry = Geometry.for_problem(problem_of(x, w), 16)
    with inject_oom(above_rows=8) as faults, pytest.raises(torch.cuda.OutOfMemoryError, match="injected"):
        run_with_oom_fallback(x, w, None, y, geometry, CEParams(), GradRequest(), None)
    assert faults == [(16, 0)]
    out, ran = run_with_oom_fallback(x, w, None, y, geometry, CEParams(), GradRequest(), OOMFallback(min_chunk_size=1))
    assert ran is geometry  # no fault outside the block: the geometry asked for
    assert out.loss_rows.shape == (BT,)


def test_a_fault_elsewhere_is_not_caught():
    x, w, y = make_inputs()
    geometry = Geometry.for_problem(problem_of(x, w), 16)
    with pytest.raises(ValueError, match="geometry was made for"):
        run_with_oom_fallback(x[:20], w, None, y[:20], geometry, CEParams(), GradRequest(), OOMFallback())


# --- the public loss with an FLCEPolicy: needs loss.py to hand the policy's fallback to FLCEFunction ----


def test_public_loss_with_a_policy_remembers_the_geometry():
    x, w, y = make_inputs()
    policy = policy_of(16)
    with warnings.catch_warnings(record=True) as record, inject_oom(above_rows=8) as faults:
        warnings.simplefilter("always")
        public_loss_and_grads(x, w, y, policy)
        public_loss_and_grads(x, w, y, policy)
    assert faults == [(16, 0)]
    assert len(fallback_warnings(record)) == 1
    assert policy.resolve(problem_of(x, w), HERE).chunk_size == 8


def test_public_loss_with_fallback_off_propagates_the_oom():
    x, w, y = make_inputs(BIG_BT, BIG_V)
    policy = FLCEPolicy(default=FixedChunkSize(128), oom_fallback=False)
    with inject_oom(above_rows=64), pytest.raises(torch.cuda.OutOfMemoryError, match="injected"):
        public_loss_and_grads(x, w, y, policy)
