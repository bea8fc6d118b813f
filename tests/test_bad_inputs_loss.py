"""Edge and bad inputs of the public loss (issue 28): torch's result where torch has one, else a clear error.

References are ``F.cross_entropy`` on explicit float64 logits; errors are matched on the argument they
must name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from test_loss_kernel import DEVICE, NEEDS_KERNEL_DEVICE

from flce_policy import FLCEPolicy
from flce_policy.loss import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.memory import predict_peak
from flce_policy.plan.problem import Problem, checked_dtype
from flce_policy.strategies import FixedChunkSize

pytestmark = NEEDS_KERNEL_DEVICE

BT, H, V = 12, 8, 11
#: Targets whose class weights under ``linspace(-1, 1, V)`` sum to -3.8: a negative mean denominator.
TARGETS = [0, 1, 2, 3, 4, 9, 0, 1, 5, 6, 2, 8]


def _inputs(hidden: int = H, bias: bool = False):
    g = torch.Generator().manual_seed(28)
    x = torch.randn(BT, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(V, hidden, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    return x, w, b, torch.tensor(TARGETS)


def _ours_and_torch(x, w, b, target, reduction, grad_output=None, **options):
    """Loss and gradients of (x, w[, b]): ours in fp32 on DEVICE, torch's on float64 logits."""
    leaves = [t for t in (x, w, b) if t is not None]
    ours = [t.float().to(DEVICE).requires_grad_() for t in leaves]
    ref = [t.clone().requires_grad_() for t in leaves]
    weight = options.pop("class_weight", None)
    loss = fused_linear_cross_entropy(
        ours[0], ours[1], target.to(DEVICE), ours[2] if b is not None else None, policy=FixedChunkSize(5),
        reduction=reduction, class_weight=None if weight is None else weight.float().to(DEVICE), **options,
    )  # fmt: skip
    logits = ref[0] @ ref[1].T + (ref[2] if b is not None else 0)
    want = F.cross_entropy(logits, target, weight=weight, reduction=reduction, **options)
    if grad_output is None:
        grad_output = torch.ones_like(want)
    got_grads = torch.autograd.grad(loss, ours, grad_output.float().to(DEVICE))
    want_grads = torch.autograd.grad(want, ref, grad_output)
    return (loss, *got_grads), (want, *want_grads)


def _assert_close(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double().cpu(), w, rtol=2e-5, atol=2e-5, equal_nan=True)


# --------------------------------------------------------------------------- class weights: torch's denominator


NAN_ON_TARGET_CLASS = torch.ones(V, dtype=torch.float64).index_fill(0, torch.tensor([TARGETS[3]]), float("nan"))
CLASS_WEIGHTS = {
    "linspace_negative_mass": torch.linspace(-1, 1, V, dtype=torch.float64),
    "nan_on_a_target_class": NAN_ON_TARGET_CLASS,
    "zero_mass": torch.zeros(V, dtype=torch.float64).index_fill(0, torch.tensor([7, 10]), 1.0),  # no target on them
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", list(CLASS_WEIGHTS))
def test_class_weights_of_any_sign_or_nan_as_torch(case, reduction):
    """A kept-weight mass that is negative, zero or NaN is torch's denominator, not replaced by 1: the
    loss and every gradient (NaN where torch's is NaN) as ``F.cross_entropy`` gives them."""
    x, w, b, target = _inputs(bias=True)
    target[-1] = -100  # an ignored row keeps a zero gradient, also next to a NaN weight
    weight = CLASS_WEIGHTS[case]
    if case == "linspace_negative_mass":
        assert weight[target[target >= 0]].sum() < -1
    grad_output = (
        torch.randn(BT, dtype=torch.float64) if reduction == "none" else torch.tensor(1.5, dtype=torch.float64)
    )
    got, want = _ours_and_torch(x, w, b, target, reduction, grad_output, class_weight=weight)
    _assert_close(got, want)
    if case != "linspace_negative_mass" and reduction == "mean":
        assert torch.isnan(want[0]) and torch.isnan(want[1][:-1]).all()  # the case means what it says


def test_negative_class_weights_with_label_smoothing_as_torch():
    x, w, b, target = _inputs()
    weight = CLASS_WEIGHTS["linspace_negative_mass"]
    got, want = _ours_and_torch(x, w, b, target, "mean", class_weight=weight, label_smoothing=0.2)
    _assert_close(got, want)


# --------------------------------------------------------------------------- ignore_index beyond int64


@pytest.mark.parametrize("ignore_index", [2**63, 2**64 - 100, 2**64 + 5, -(2**63) - 1])
def test_ignore_index_outside_int64_is_refused(ignore_index):
    x, w, _, target = _inputs()
    with pytest.raises(ValueError, match=r"ignore_index must fit in int64"):
        fused_linear_cross_entropy(
            x.float().to(DEVICE), w.float().to(DEVICE), target.to(DEVICE), ignore_index=ignore_index
        )
    with pytest.raises(ValueError, match=r"ignore_index must fit in int64"):
        FusedLinearCrossEntropyLoss(ignore_index=ignore_index)


@pytest.mark.parametrize("ignore_index", [2**63 - 1, -(2**63)])
def test_ignore_index_at_the_int64_limits_as_torch(ignore_index):
    x, w, b, target = _inputs()
    target[[2, 5]] = ignore_index
    got, want = _ours_and_torch(x, w, b, target, "mean", ignore_index=ignore_index)
    _assert_close(got, want)


# --------------------------------------------------------------------------- second-order gradients


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_double_backward_is_refused_when_asked_for(reduction):
    """Under create_graph=True the first-order gradients are torch's; differentiating them again (a
    gradient penalty) raises instead of silently dropping the second-order term."""
    x, w, _, target = _inputs()
    xs, ws = x.float().to(DEVICE).requires_grad_(), w.float().to(DEVICE).requires_grad_()
    loss = fused_linear_cross_entropy(xs, ws, target.to(DEVICE), policy=FixedChunkSize(5), reduction=reduction)
    total = loss.sum()
    gx, gw = torch.autograd.grad(total, (xs, ws), create_graph=True)
    ref = (x.clone().requires_grad_(), w.clone().requires_grad_())
    want = torch.autograd.grad(F.cross_entropy(ref[0] @ ref[1].T, target, reduction=reduction).sum(), ref)
    _assert_close((gx, gw), want)
    assert gx.requires_grad and gw.requires_grad
    penalty = gx.pow(2).sum() + gw.pow(2).sum()
    with pytest.raises(RuntimeError, match=r"fused_linear_cross_entropy has no second derivative"):
        (total + penalty).backward()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_backward_again_after_create_graph_names_the_second_derivative(reduction):
    """Whichever node autograd reaches first (CUDA's engine reaches the loss again before the penalty's own
    node, the CPU's the other way round), a backward after a create_graph one says what is unsupported."""
    x, w, _, target = _inputs()
    xs, ws = x.float().to(DEVICE).requires_grad_(), w.float().to(DEVICE).requires_grad_()
    loss = fused_linear_cross_entropy(xs, ws, target.to(DEVICE), policy=FixedChunkSize(5), reduction=reduction)
    torch.autograd.grad(loss, (xs, ws), create_graph=True)
    with pytest.raises(RuntimeError, match=r"has no second derivative.*nor does a second backward"):
        loss.backward()


def test_first_order_backward_under_create_graph_as_torch():
    """loss.backward(create_graph=True) fills .grad with the first-order gradients (torch's)."""
    x, w, _, target = _inputs()
    xs = x.float().to(DEVICE).requires_grad_()
    fused_linear_cross_entropy(xs, w.float().to(DEVICE), target.to(DEVICE)).backward(create_graph=True)
    ref = x.clone().requires_grad_()
    F.cross_entropy(ref @ w.T, target).backward()
    _assert_close((xs.grad,), (ref.grad,))


# --------------------------------------------------------------------------- bias of the wrong type


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        pytest.param([0.0] * V, r"bias must be a torch.Tensor \[V\] or None, got list$", id="list"),
        pytest.param(1.0, r"bias must be a torch.Tensor \[V\] or None, got float$", id="float"),
        pytest.param(FixedChunkSize(2), r"bias .* got FixedChunkSize: pass .* by keyword, as policy=", id="strategy"),
        pytest.param(FLCEPolicy(), r"bias .* got FLCEPolicy: pass .* by keyword, as policy=", id="policy"),
    ],
)
def test_bias_of_wrong_type_names_bias(bias, message):
    x, w, _, target = _inputs()
    args = (x.float().to(DEVICE), w.float().to(DEVICE), target.to(DEVICE))
    with pytest.raises(TypeError, match=message):
        fused_linear_cross_entropy(*args, bias)
    with pytest.raises(TypeError, match=message):
        FusedLinearCrossEntropyLoss()(*args, bias)


# --------------------------------------------------------------------------- zero sizes


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_hidden_size_zero_as_torch(bias, reduction):
    """H = 0: the logits are the bias (or zeros: a mean of log V); gradients of torch's shapes and values."""
    x, w, b, target = _inputs(hidden=0, bias=bias)
    grad_output = torch.randn(BT, dtype=torch.float64) if reduction == "none" else None
    got, want = _ours_and_torch(x, w, b, target, reduction, grad_output, label_smoothing=0.1)
    _assert_close(got, want)
    assert got[1].shape == (BT, 0) and got[2].shape == (V, 0)


def test_vocab_size_zero_is_refused():
    x = torch.randn(BT, H, device=DEVICE)
    for target in (torch.zeros(BT, dtype=torch.long), torch.full((BT,), -100)):  # torch: IndexError, or NaN
        with pytest.raises(ValueError, match=r"weight has no rows: its vocabulary dimension V is 0"):
            fused_linear_cross_entropy(x, torch.randn(0, H, device=DEVICE), target.to(DEVICE))


# --------------------------------------------------------------------------- dtype arguments


@pytest.mark.parametrize("value", ["float64", torch.float64, "bogus", 5])
def test_master_dtype_outside_the_supported_ones_is_refused(value):
    geometry = Geometry.for_problem(Problem(64, 32, 100, "bfloat16"), 16)
    message = r"master_dtype must be one of bfloat16, float16, float32 .*; got"
    with pytest.raises(ValueError, match=message):
        predict_peak(geometry, master_dtype=value)
    with pytest.raises(ValueError, match=message):
        FLCEPolicy(default=FixedChunkSize(16)).explain_dict(geometry.problem, master_dtype=value)


def test_checked_dtype_accepts_torch_dtypes_names_and_aliases():
    assert [checked_dtype(v, "x") for v in (torch.float32, "bf16", "Float16", "fp32")] == [
        "float32", "bfloat16", "float16", "float32",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"--master-dtype must be one of"):
        checked_dtype("float64", "--master-dtype")


# --------------------------------------------------------------------------- Triton's interpreter set too late


def test_interpreter_switched_on_after_import_names_the_fix():
    """TRITON_INTERPRET=1 set after ``import flce_policy``: the kernels were defined for a GPU; CPU tensors
    get the library's message (not Triton's "0 active drivers"), on a machine with or without a GPU."""
    script = textwrap.dedent(
        """
        import os
        import torch
        import flce_policy
        os.environ["TRITON_INTERPRET"] = "1"
        x, w = torch.randn(4, 8), torch.randn(11, 8)
        try:
            flce_policy.fused_linear_cross_entropy(x, w, torch.zeros(4, dtype=torch.long))
        except RuntimeError as err:
            print(err)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "TRITON_INTERPRET=1 was set after flce_policy was imported" in done.stdout
    assert "set TRITON_INTERPRET=1 before importing flce_policy" in done.stdout


# --------------------------------------------------------------------------- a bare strategy under compile


def test_bare_strategy_under_fullgraph_compile_says_the_fix_first():
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x, w, y: fused_linear_cross_entropy(x, w, y, policy=FixedChunkSize(8)),
        fullgraph=True,
        backend="eager",
    )
    x, w, _, target = _inputs()
    with pytest.raises(Exception) as caught:  # noqa: B017 (Dynamo wraps it in its own error type)
        compiled(x.float().to(DEVICE), w.float().to(DEVICE), target.to(DEVICE))
    torch._dynamo.reset()
    first_line = str(caught.value).splitlines()[0]
    assert "policy=FixedChunkSize under torch.compile: pass policy=FLCEPolicy(default=strategy)" in first_line
