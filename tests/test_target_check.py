"""The target-range check (flce_policy/call/targets.py): raised as a ValueError, read after the call's work is queued.

A bad class index must be the caller's Python error whatever else the call does meanwhile: the
kernels run on safe targets (bad rows ignored) until the flag is read, so nothing indexes outside
``[0, V)`` first, and the flag is read once the chunks are queued, not before (no GPU idle time).
"""

from __future__ import annotations

import pytest
import torch
from test_loss_kernel import DEVICE

import flce_policy.call.autograd as flce_autograd
from flce_policy import fused_linear_cross_entropy
from flce_policy.call.targets import TargetCheck, check_target_range, poisoned_targets, start_target_check

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="the kernels were compiled and there is no CUDA GPU"
)

V = 11


def _first_bad(target: torch.Tensor, ignore_index: int) -> int | None:
    """Plain-Python reference: the first index outside [0, V) that is not ignore_index."""
    for value in target.tolist():
        if value != ignore_index and not 0 <= value < V:
            return value
    return None


@pytest.mark.parametrize("seed", range(6))
def test_finish_raises_exactly_when_a_row_is_bad(seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(-3, V + 3, (40,), generator=g)
    target[torch.rand(40, generator=g) < 0.2] = -100
    if seed % 2:  # half the cases all good
        target = target.clamp(0, V - 1)
    safe, check = start_target_check(target.to(DEVICE), V, -100)
    want = _first_bad(target, -100)
    # the safe targets: bad rows ignored, the rest untouched
    expected_safe = [t if (t == -100 or 0 <= t < V) else -100 for t in target.tolist()]
    assert safe.cpu().tolist() == expected_safe
    if want is None:
        check.finish()
        check_target_range(target.to(DEVICE), V, -100)
    else:
        with pytest.raises(ValueError, match=rf"target holds index {want}, outside \[0, V={V}\)"):
            check.finish()
        with pytest.raises(ValueError, match=rf"index {want}\b"):
            check_target_range(target.to(DEVICE), V, -100)


def test_poisoned_targets_nan_only_when_bad():
    good = torch.tensor([0, 3, -100, V - 1], device=DEVICE)
    safe, poison = poisoned_targets(good, V, -100)
    assert safe.tolist() == good.tolist() and poison.item() == 0.0
    safe, poison = poisoned_targets(torch.tensor([0, V, -7, 2], device=DEVICE), V, -100)
    assert safe.tolist() == [0, -100, -100, 2] and torch.isnan(poison)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("rows", [0, 7, 2500])  # none; under one block; several blocks and a tail
def test_denominators_and_gradient_scales(rows, mean, weighted):
    """The check's meta against plain Python: kept rows (neither ignored nor bad), their class-weight mass,
    both denominators taken as 1 when no row is kept, and the scales 1/mass, 1/count for mean (ones for sum)."""
    g = torch.Generator().manual_seed(rows)
    target = torch.randint(-3, V + 3, (rows,), generator=g)
    target[torch.rand(rows, generator=g) < 0.3] = -100
    class_weight = torch.rand(V, generator=g, dtype=torch.float64) + 0.25 if weighted else None
    check = TargetCheck(
        target.to(DEVICE), V, -100, None if class_weight is None else class_weight.float().to(DEVICE), mean
    )
    kept = [t for t in target.tolist() if 0 <= t < V]
    mass = sum(class_weight[t].item() for t in kept) if weighted else float(len(kept))
    mass, count = (mass, float(len(kept))) if kept else (1.0, 1.0)
    bad = any(t != -100 and not 0 <= t < V for t in target.tolist())
    want = [float(bad), mass, count, 1 / mass if mean else 1.0, 1 / count if mean else 1.0, 0.0]
    torch.testing.assert_close(check.meta.cpu().double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(check.grad_scale.cpu().double(), torch.tensor(want[3:5], dtype=torch.float64))
    # where no host may read the flag: the same, except that a bad row makes the scales and the poison NaN
    device_side = TargetCheck(
        target.to(DEVICE), V, -100, None if class_weight is None else class_weight.float().to(DEVICE), mean,
        host_check=False,
    )  # fmt: skip
    if bad:
        want[3:] = [float("nan")] * 3
    torch.testing.assert_close(
        device_side.meta.cpu().double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0, equal_nan=True
    )
    assert torch.isnan(device_side.poison).item() == bad


@pytest.mark.parametrize(
    ("class_weight", "mass"),
    [([-1.0, 0.5, -0.25], -1.75), ([1.0, -2.0, 0.0], 0.0), ([1.0, float("nan"), 1.0], float("nan"))],
    ids=["negative", "zero", "nan"],
)
def test_mass_of_kept_rows_is_kept_whatever_its_sign(class_weight, mass):
    """A kept-row mass <= 0 or NaN is the denominator as it is (torch's), never replaced by 1."""
    target = torch.tensor([0, 1, 2, -100, 0], device=DEVICE)
    check = TargetCheck(target, 3, -100, torch.tensor(class_weight, device=DEVICE), True)
    want = [0.0, mass, 4.0, 1 / mass if mass else float("inf"), 0.25, 0.0]
    torch.testing.assert_close(check.meta.cpu().double(), torch.tensor(want, dtype=torch.float64), equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_totals_against_float64_sums(reduction):
    """The one-program sums over many rows: loss, z-loss and accuracy against float64 reductions."""
    from flce_policy.kernels.loss_total import loss_totals

    rows = 100_003
    g = torch.Generator().manual_seed(5)
    target = torch.randint(0, V, (rows,), generator=g)
    target[torch.rand(rows, generator=g) < 0.1] = -100
    loss_rows = torch.where(target != -100, torch.rand(rows, generator=g) * 12, 0.0)
    z_rows = torch.where(target != -100, torch.rand(rows, generator=g) * 1e-3, 0.0)
    argmax = torch.where(torch.rand(rows, generator=g) < 0.4, target, (target + 1) % V)
    argmax[target == -100] = -1
    check = TargetCheck(target.to(DEVICE), V, -100, None, reduction == "mean")
    got = loss_totals(
        *(t.to(DEVICE) for t in (loss_rows, z_rows, argmax, target)), check.meta, -100, reduction == "mean"
    )
    kept = (target != -100).double()
    ce, z = loss_rows.double().sum(), z_rows.double().sum()
    if reduction == "mean":
        ce, z = ce / kept.sum(), z / kept.sum()
    accuracy = ((argmax == target).double() * kept).sum() / kept.sum()
    for value, want in zip(got, (ce + z, z, accuracy), strict=True):
        torch.testing.assert_close(value.cpu().double(), want, rtol=2e-7, atol=0)


def test_bad_target_with_class_weight_is_the_value_error_not_an_index_error():
    """The denominators index class_weight by target: only safe targets may reach them before the check."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g).to(DEVICE)
    w = torch.randn(V, 4, generator=g).to(DEVICE)
    y = torch.randint(0, V, (8,), generator=g).to(DEVICE)
    y[5] = V + 100
    with pytest.raises(ValueError, match=rf"index {V + 100}\b"):
        fused_linear_cross_entropy(x, w, y, class_weight=torch.rand(V, generator=g).to(DEVICE))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_flag_is_read_after_the_chunks_are_queued(monkeypatch, reduction):
    order: list[str] = []
    run = flce_autograd.run_with_oom_fallback
    finish = TargetCheck.finish

    def driver(*args, **kwargs):
        order.append("driver")
        return run(*args, **kwargs)

    def read_flag(self):
        order.append("flag read")
        return finish(self)

    monkeypatch.setattr(flce_autograd, "run_with_oom_fallback", driver)
    monkeypatch.setattr(TargetCheck, "finish", read_flag)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(V, 8, generator=g).to(DEVICE).requires_grad_()
    y = torch.randint(0, V, (16,), generator=g).to(DEVICE)
    loss = fused_linear_cross_entropy(x, w, y, reduction=reduction)
    assert order == ["driver", "flag read"]
    # and the result is the plain-torch loss: the safe targets are the real ones when all are good
    want = torch.nn.functional.cross_entropy(x.detach().double() @ w.detach().double().T, y, reduction=reduction)
    torch.testing.assert_close(loss.detach().double(), want, rtol=1e-4, atol=1e-4)

    y_bad = y.clone()
    y_bad[3] = -2
    order.clear()
    with pytest.raises(ValueError, match=r"index -2\b"):
        fused_linear_cross_entropy(x, w, y_bad, reduction=reduction)
    assert order == ["driver", "flag read"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or DEVICE != "cuda", reason="needs a CUDA GPU and compiled kernels")
def test_cuda_bad_target_is_a_value_error_and_the_device_stays_usable():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 256, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(32000, 256, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 32000, (4096,), device="cuda", generator=g)
    bad = y.clone()
    bad[4000] = 32000 + 7
    for _ in range(3):  # the flag is a pinned copy read after an event: repeat to catch a stale read
        with pytest.raises(ValueError, match=r"index 32007\b"):
            fused_linear_cross_entropy(x, w, bad, class_weight=torch.ones(32000, device="cuda"))
        loss = fused_linear_cross_entropy(x, w, y)
        loss.backward()
    want = torch.nn.functional.cross_entropy((x.detach().float() @ w.detach().float().T), y)
    torch.testing.assert_close(loss.detach(), want, rtol=2e-2, atol=2e-2)
