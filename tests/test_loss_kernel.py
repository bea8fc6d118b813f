"""The fused loss against an independent plain-torch reference on explicit logits.

The reference materialises ``logits = x @ W.T + b`` (softcapped if asked), calls
``F.cross_entropy`` and adds the z-loss by hand, in float64; gradients come from
``torch.autograd.grad`` on it. Errors are max-norm relative: ``max|a - e| / max|e|``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import flce_policy.call.autograd as flce_autograd
from flce_policy.kernels import ce_kernel
from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED
from flce_policy.kernels.driver import GradRequest, observe_chunks
from flce_policy.loss import FLCEOutput, FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.strategies import FixedChunkSize

DEVICE = "cpu" if KERNELS_INTERPRETED else "cuda"
#: the kernels' tests: on CPU under the interpreter, compiled only where a CUDA GPU is
NEEDS_KERNEL_DEVICE = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(),
    reason="the kernels were compiled (TRITON_INTERPRET unset) and there is no CUDA GPU",
)
pytestmark = NEEDS_KERNEL_DEVICE

BT, H, V = 13, 61, 509  # odd on purpose: BT=13 leaves a 5-row tail with chunks of 8 (few rows: the interpreter
#: runs one program per row and launch, most of these tests' time)
#: fp32 kernel vs float64 reference; the errors seen are <= 1e-6 (loss ~1e-8).
FP32_TOL = 1e-5
REDUCTIONS = ("mean", "sum", "none")


# --------------------------------------------------------------------------- reference and inputs


def reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    class_weight: torch.Tensor | None = None,
    upcast: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, z_loss, token_accuracy)`` of plain torch on explicit logits.

    The GEMM runs in the tensors' own dtype, everything after it in ``upcast``; with float64
    leaves this is the exact reference, with bf16 leaves and ``upcast=float32`` it is what eager
    PyTorch does in a bf16 model.
    """
    hidden = weight.shape[1]
    logits = F.linear(x.reshape(-1, hidden), weight, bias).to(upcast)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    y = target.reshape(-1).long()
    cw = None if class_weight is None else class_weight.to(upcast)
    ce = F.cross_entropy(
        logits, y, weight=cw, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
    )
    valid = y != ignore_index
    count = valid.sum()
    z_rows = torch.where(valid, z_loss_scale * torch.logsumexp(logits, dim=-1) ** 2, 0.0)
    if reduction == "none":
        ce, z_loss = ce.reshape(target.shape), z_rows.reshape(target.shape)
    elif reduction == "sum":
        z_loss = z_rows.sum()
    else:
        z_loss = z_rows.sum() / count
    accuracy = ((logits.argmax(dim=-1) == y) & valid).sum() / count
    return ce + z_loss, z_loss.detach(), accuracy


def make_inputs(
    bt: int = BT,
    h: int = H,
    v: int = V,
    *,
    bias: bool = False,
    class_weight: bool = False,
    ignore_index: int = -100,
    n_ignored: int = 0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """fp32 ``x [bt, h]``, ``w [v, h]`` (logit std ~3), optional ``b``/``cw``, and targets ``y``.

    About half the targets are the row's argmax (so token accuracy is neither 0 nor 1) and
    ``n_ignored`` rows are set to ``ignore_index``.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bt, h, generator=g)
    w = torch.randn(v, h, generator=g) * (3.0 / h**0.5)
    b = torch.randn(v, generator=g) if bias else None
    y = torch.randint(0, v, (bt,), generator=g)
    logits = F.linear(x.double(), w.double(), None if b is None else b.double())
    y = torch.where(torch.rand(bt, generator=g) < 0.5, logits.argmax(dim=-1), y)
    if n_ignored:
        y[torch.randperm(bt, generator=g)[:n_ignored]] = ignore_index
    out = {"x": x, "w": w, "y": y}
    if b is not None:
        out["b"] = b
    if class_weight:
        cw = torch.rand(v, generator=g) * 1.5 + 0.25
        cw[5::40] = 0.0  # some classes switched off, as class weights are used
        out["cw"] = cw
    return {k: t.to(DEVICE) for k, t in out.items()}


def leaves(inputs: dict[str, torch.Tensor], dtype: torch.dtype, grad: tuple[str, ...] = ("x", "w", "b")):
    """Fresh copies of the float tensors in ``dtype`` (class weights stay fp32), ``grad`` ones as leaves."""
    out = {}
    for k, t in inputs.items():
        if k in ("x", "w", "b"):
            out[k] = t.detach().to(dtype).requires_grad_(k in grad)
        else:
            out[k] = t
    return out


def run_flce(t: dict[str, torch.Tensor], **options):
    return fused_linear_cross_entropy(t["x"], t["w"], t["y"], t.get("b"), class_weight=t.get("cw"), **options)


KERNEL_ONLY = ("policy", "accum_dtype", "return_z_loss", "return_token_accuracy")


def run_reference(t: dict[str, torch.Tensor], **options):
    """The reference on the same tensors; options only the kernel has (policy, ...) are dropped."""
    options = {k: v for k, v in options.items() if k not in KERNEL_ONLY}
    return reference(t["x"], t["w"], t["y"], t.get("b"), class_weight=t.get("cw"), **options)


def grads(loss: torch.Tensor, t: dict[str, torch.Tensor], grad_output: torch.Tensor | None) -> dict[str, torch.Tensor]:
    names = [k for k in ("x", "w", "b") if k in t and t[k].requires_grad]
    if grad_output is not None:
        grad_output = grad_output.to(loss.dtype)
    values = torch.autograd.grad(loss, [t[k] for k in names], grad_outputs=grad_output)
    return dict(zip(names, values, strict=True))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual - expected| / max|expected|`` in float64; shapes must match and actual be finite."""
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.isfinite(a).all(), "non-finite values"
    diff = (a - e).abs().max().item() if a.numel() else 0.0
    scale = e.abs().max().item() if e.numel() else 0.0
    return diff / scale if scale > 0 else diff


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def default_grad_output(reduction: str, shape: torch.Size, seed: int = 1) -> torch.Tensor | None:
    """mean: none (1.0, the usual backward); sum: 2.5; none: a random per-token grad_output."""
    if reduction == "mean":
        return None
    if reduction == "sum":
        return torch.tensor(2.5, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DEVICE)


def check_against_reference(
    inputs: dict[str, torch.Tensor],
    *,
    grad: tuple[str, ...] = ("x", "w", "b"),
    grad_output: torch.Tensor | None = None,
    tol: float = FP32_TOL,
    **options,
) -> torch.Tensor:
    """Kernel (fp32) vs reference (float64): loss and the gradients of the leaves in ``grad``."""
    kt, rt = leaves(inputs, torch.float32, grad), leaves(inputs, torch.float64, grad)
    loss = run_flce(kt, **options)
    ref_loss = run_reference(rt, **options)[0]
    assert isinstance(loss, torch.Tensor) and not isinstance(loss, tuple)
    assert loss.dtype == torch.float32
    assert_close(loss, ref_loss, tol, "loss")
    if any(k in kt and kt[k].requires_grad for k in grad):
        got, want = grads(loss, kt, grad_output), grads(ref_loss, rt, grad_output)
        assert got.keys() == want.keys()
        for k in got:
            assert got[k].dtype == kt[k].dtype
            assert_close(got[k], want[k], tol, f"grad {k}")
    return loss


# --------------------------------------------------------------------------- options

# (make_inputs kwargs, loss options)
OPTION_CASES = [
    pytest.param({}, {}, id="plain"),
    pytest.param({"bias": True}, {}, id="bias"),
    pytest.param({"n_ignored": 6}, {}, id="ignore_default_-100"),
    pytest.param({"n_ignored": 6, "ignore_index": -1}, {"ignore_index": -1}, id="ignore_-1"),
    # torch also ignores an ignore_index that is a valid class
    pytest.param({"n_ignored": 6, "ignore_index": 7}, {"ignore_index": 7}, id="ignore_valid_class_7"),
    pytest.param({"n_ignored": 6, "ignore_index": 1000}, {"ignore_index": 1000}, id="ignore_above_vocab"),
    pytest.param({}, {"label_smoothing": 0.1}, id="label_smoothing"),
    pytest.param({}, {"label_smoothing": 1.0}, id="label_smoothing_1"),
    pytest.param({"class_weight": True, "n_ignored": 4}, {}, id="class_weight"),
    pytest.param({"class_weight": True, "n_ignored": 4}, {"label_smoothing": 0.2}, id="smoothing_class_weight"),
    pytest.param({}, {"softcap": 4.0}, id="softcap"),
    pytest.param({}, {"z_loss_scale": 0.01}, id="z_loss"),
    pytest.param({"n_ignored": 5}, {"softcap": 4.0, "z_loss_scale": 0.01}, id="softcap_z_loss"),
    pytest.param(
        {"bias": True, "class_weight": True, "n_ignored": 5, "ignore_index": -1},
        {"ignore_index": -1, "label_smoothing": 0.2, "softcap": 6.0, "z_loss_scale": 0.01},
        id="everything",
    ),
]
EVERYTHING_INPUTS = {"bias": True, "class_weight": True, "n_ignored": 5, "ignore_index": -1}
EVERYTHING_OPTIONS = {"ignore_index": -1, "label_smoothing": 0.2, "softcap": 6.0, "z_loss_scale": 0.01}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(("input_kw", "options"), OPTION_CASES)
def test_loss_and_grads_match_reference(input_kw, options, reduction):
    inputs = make_inputs(**input_kw)
    shape = inputs["y"].shape
    loss = check_against_reference(
        inputs,
        grad_output=default_grad_output(reduction, shape),
        policy=FixedChunkSize(8),
        reduction=reduction,
        **options,
    )
    assert loss.shape == (shape if reduction == "none" else ())


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_class_weight_with_ignore_index_above_vocab(reduction):
    # Regression: the class-weight mass once indexed class_weight with the ignore_index itself.
    inputs = make_inputs(class_weight=True, n_ignored=5, ignore_index=V + 100)
    check_against_reference(
        inputs,
        grad_output=default_grad_output(reduction, inputs["y"].shape),
        policy=FixedChunkSize(8),
        ignore_index=V + 100,
        reduction=reduction,
    )


def test_mean_with_grad_output_not_one():
    check_against_reference(
        make_inputs(**EVERYTHING_INPUTS),
        grad_output=torch.tensor(-0.75, device=DEVICE),
        policy=FixedChunkSize(8),
        **EVERYTHING_OPTIONS,
    )


def test_reduction_none_zero_on_ignored_rows():
    inputs = make_inputs(n_ignored=7)
    loss = run_flce(leaves(inputs, torch.float32), policy=FixedChunkSize(8), reduction="none", z_loss_scale=0.01)
    ignored = inputs["y"] == -100
    assert (loss[ignored] == 0).all()
    assert (loss[~ignored] > 0).all()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(("want_z", "want_acc"), [(True, False), (False, True), (True, True)])
def test_z_loss_and_token_accuracy_outputs(reduction, want_z, want_acc):
    inputs = make_inputs(class_weight=True, n_ignored=6)
    options = {"label_smoothing": 0.1, "softcap": 5.0, "z_loss_scale": 0.02, "reduction": reduction}
    kt, rt = leaves(inputs, torch.float32), leaves(inputs, torch.float64)
    out = run_flce(kt, policy=FixedChunkSize(8), return_z_loss=want_z, return_token_accuracy=want_acc, **options)
    ref_loss, ref_z, ref_acc = run_reference(rt, **options)
    assert 0.1 < ref_acc.item() < 0.9  # the inputs make the accuracy check meaningful

    assert isinstance(out, FLCEOutput)
    assert out.loss.dtype == torch.float32
    assert_close(out.loss, ref_loss, FP32_TOL, "loss (z-loss included)")
    if want_z:
        assert out.z_loss.dtype == torch.float32 and not out.z_loss.requires_grad
        assert_close(out.z_loss, ref_z, FP32_TOL, "z_loss")
        assert ref_z.abs().max() > 1e-3 * ref_loss.abs().max()  # material, so leaving it out would show
    else:
        assert out.z_loss is None
    if want_acc:
        assert out.token_accuracy.shape == () and not out.token_accuracy.requires_grad
        assert abs(out.token_accuracy.item() - ref_acc.item()) < 1e-6
    else:
        assert out.token_accuracy is None
    # the loss in the tuple still backpropagates like the plain one
    go = default_grad_output(reduction, inputs["y"].shape)
    got, want = grads(out.loss, kt, go), grads(ref_loss, rt, go)
    for k in want:
        assert_close(got[k], want[k], FP32_TOL, f"grad {k}")


def test_z_loss_mean_divides_by_token_count_not_class_weight():
    # With class weights far from 1 the weighted mass differs from the count by a lot.
    inputs = make_inputs(class_weight=True, n_ignored=5)
    inputs["cw"] = inputs["cw"] * 7.0
    kt, rt = leaves(inputs, torch.float32), leaves(inputs, torch.float64)
    out = run_flce(kt, policy=FixedChunkSize(8), z_loss_scale=0.05, return_z_loss=True)
    valid = inputs["y"] != -100
    lse = torch.logsumexp(inputs["x"].double() @ inputs["w"].double().T, dim=-1)
    expected = 0.05 * (lse[valid] ** 2).sum() / valid.sum()
    assert_close(out.z_loss, expected, FP32_TOL, "z_loss")
    assert_close(out.loss, run_reference(rt, z_loss_scale=0.05)[0], FP32_TOL, "loss")


# --------------------------------------------------------------------------- which inputs need grad

GRAD_SUBSETS = [s for n in range(4) for s in itertools.combinations(("x", "w", "b"), n)]


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("grad", GRAD_SUBSETS, ids=lambda s: "+".join(s) or "nothing")
def test_requires_grad_subsets(grad, reduction):
    inputs = make_inputs(bias=True, n_ignored=3)
    kt, rt = leaves(inputs, torch.float32, grad), leaves(inputs, torch.float64, grad)
    options = {"reduction": reduction, "label_smoothing": 0.1, "z_loss_scale": 0.01}
    loss = run_flce(kt, policy=FixedChunkSize(8), **options)
    ref_loss = run_reference(rt, **options)[0]
    assert_close(loss, ref_loss, FP32_TOL, "loss")
    assert loss.requires_grad == bool(grad)
    if not grad:
        return
    go = default_grad_output(reduction, inputs["y"].shape)
    loss.backward(go)
    ref_loss.backward(None if go is None else go.double())
    for k in ("x", "w", "b"):
        if k in grad:
            assert_close(kt[k].grad, rt[k].grad, FP32_TOL, f"grad {k}")
        else:
            assert kt[k].grad is None, f"{k} does not require grad but got one"


def test_frozen_weight_gets_no_grad():
    inputs = make_inputs()
    x = inputs["x"].clone().requires_grad_()
    w = inputs["w"].clone()  # frozen: requires_grad False
    loss = fused_linear_cross_entropy(x, w, inputs["y"], policy=FixedChunkSize(8))
    loss.backward()
    assert w.grad is None
    xr = inputs["x"].double().requires_grad_()
    reference(xr, inputs["w"].double(), inputs["y"])[0].backward()
    assert_close(x.grad, xr.grad, FP32_TOL, "grad x")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_under_no_grad(reduction):
    inputs = make_inputs(**EVERYTHING_INPUTS)
    kt, rt = leaves(inputs, torch.float32), leaves(inputs, torch.float64)
    with torch.no_grad():
        loss = run_flce(kt, policy=FixedChunkSize(8), reduction=reduction, **EVERYTHING_OPTIONS)
        ref_loss = run_reference(rt, reduction=reduction, **EVERYTHING_OPTIONS)[0]
    assert not loss.requires_grad and loss.grad_fn is None
    assert_close(loss, ref_loss, FP32_TOL, "loss")


def test_no_gradient_work_under_no_grad(monkeypatch):
    # Regression: ctx.needs_input_grad ignores torch.no_grad(), so mean/sum once computed every
    # gradient (grad_weight [V, H] included) in forward and threw them away.
    requests: list[GradRequest] = []
    real = flce_autograd.run_with_oom_fallback

    def spy(*args, **kwargs):
        requests.append(args[6])
        return real(*args, **kwargs)

    monkeypatch.setattr(flce_autograd, "run_with_oom_fallback", spy)
    t = leaves(make_inputs(bias=True), torch.float32)
    with torch.no_grad():
        run_flce(t, policy=FixedChunkSize(8))
    assert requests, "the driver was not called"
    assert not any(r.any for r in requests), f"gradients computed under no_grad: {requests}"


# --------------------------------------------------------------------------- geometries


def _problem(dtype: torch.dtype = torch.float32) -> Problem:
    return Problem(tokens=BT, hidden=H, vocab=V, dtype=dtype)


# (policy factory, chunks the driver must run for BT=13)
GEOMETRY_CASES = [
    pytest.param(lambda: FixedChunkSize(1), 13, id="fixed_1"),
    pytest.param(lambda: FixedChunkSize(8), 2, id="fixed_8_tail_5"),
    pytest.param(lambda: FixedChunkSize(64), 1, id="fixed_64_one_chunk"),
    pytest.param(lambda: Geometry.for_problem(_problem(), BT), 1, id="geometry_13_one_chunk"),
    pytest.param(lambda: Geometry.for_problem(_problem(), 5), 3, id="geometry_5_non_pow2_tail_3"),
    pytest.param(lambda: Geometry.for_problem(_problem(), 12), 2, id="geometry_12_tail_1"),
]


#: The geometry tests run on one pytest-xdist worker: each geometry's run is made once (``geometry_runs``).
GEOMETRY_RUNS = pytest.mark.xdist_group("loss_kernel_geometries")


@pytest.fixture(scope="module")
def geometry_runs():
    """``run(make_policy, reduction)``: (loss, grads, chunks the driver ran) of the everything-options call,
    made once per geometry and reduction: the reference checks and the cross-geometry check read the same."""
    runs = {}

    def run(make_policy, reduction):
        if (make_policy, reduction) not in runs:
            inputs = make_inputs(**EVERYTHING_INPUTS)
            kt = leaves(inputs, torch.float32)
            with observe_chunks() as events:
                loss = run_flce(kt, policy=make_policy(), reduction=reduction, **EVERYTHING_OPTIONS)
            got = grads(loss, kt, default_grad_output(reduction, inputs["y"].shape))
            runs[make_policy, reduction] = (loss.detach(), got, len(events))
        return runs[make_policy, reduction]

    return run


@GEOMETRY_RUNS
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(("make_policy", "n_chunks"), GEOMETRY_CASES)
def test_geometries_match_reference(make_policy, n_chunks, reduction, geometry_runs):
    loss, got, chunks = geometry_runs(make_policy, reduction)
    assert chunks == n_chunks  # the policy was honoured, not replaced by a default
    rt = leaves(make_inputs(**EVERYTHING_INPUTS), torch.float64)
    ref_loss = run_reference(rt, reduction=reduction, **EVERYTHING_OPTIONS)[0]
    assert_close(loss, ref_loss, FP32_TOL, "loss")
    want = grads(ref_loss, rt, default_grad_output(reduction, rt["y"].shape))
    assert got.keys() == want.keys()
    for k in want:
        assert_close(got[k], want[k], FP32_TOL, f"grad {k}")


@GEOMETRY_RUNS
def test_geometries_agree_with_each_other(geometry_runs):
    results = [(param.id, *geometry_runs(param.values[0], "mean")[:2]) for param in GEOMETRY_CASES]
    base_id, base_loss, base_grads = results[0]
    for name, loss, g in results[1:]:
        assert_close(loss, base_loss, FP32_TOL, f"loss {name} vs {base_id}")
        for k in base_grads:
            assert_close(g[k], base_grads[k], FP32_TOL, f"grad {k} {name} vs {base_id}")


def test_default_policy_matches_reference():
    pytest.importorskip("flce_policy.engine.policy")
    check_against_reference(make_inputs(**EVERYTHING_INPUTS), policy=None, **EVERYTHING_OPTIONS)
    check_against_reference(make_inputs(bias=True))  # policy left out entirely


# --------------------------------------------------------------------------- vocab wider than one block


# (MAX_BLOCK_V, TARGET_PROGRAMS, V, segments wanted): the kernel splits a row into column segments
# of whole blocks (partials, then a finish pass merging them); small blocks make V=509 walk that path.
SEGMENT_CASES = [
    pytest.param(128, None, V, "several", id="blocks_128_segments"),
    pytest.param(32, None, V, "several", id="blocks_32_segments"),
    # 9 blocks of 32 in 4 segments of 3 blocks: the last segment has no columns
    pytest.param(32, None, 281, "several", id="blocks_32_empty_segment"),
    # few programs wanted: one segment walking 16 blocks (the online log-sum-exp across blocks)
    pytest.param(32, 4, V, "one", id="blocks_32_one_segment"),
]


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(("block", "programs", "v", "segments"), SEGMENT_CASES)
def test_vocab_spanning_several_blocks_and_segments(monkeypatch, block, programs, v, segments, reduction):
    monkeypatch.setattr(ce_kernel, "MAX_BLOCK_V", block)
    if programs is not None:
        monkeypatch.setattr(ce_kernel, "TARGET_PROGRAMS", programs)
    plan = ce_kernel.ce_workspace(4, v, torch.device(DEVICE))
    assert plan.block_v == block
    assert (plan.segments_per_tile > 1) if segments == "several" else (plan.segments_per_tile == 1)

    inputs = make_inputs(13, v=v, **{**EVERYTHING_INPUTS, "n_ignored": 2})  # chunks of 4, 4, 4, 1
    kt, rt = leaves(inputs, torch.float32), leaves(inputs, torch.float64)
    out = run_flce(kt, policy=FixedChunkSize(4), reduction=reduction, return_token_accuracy=True, **EVERYTHING_OPTIONS)
    ref_loss, _, ref_acc = run_reference(rt, reduction=reduction, **EVERYTHING_OPTIONS)
    assert_close(out.loss, ref_loss, FP32_TOL, "loss")
    assert abs(out.token_accuracy.item() - ref_acc.item()) < 1e-6
    go = default_grad_output(reduction, inputs["y"].shape)
    got, want = grads(out.loss, kt, go), grads(ref_loss, rt, go)
    for k in want:
        assert_close(got[k], want[k], FP32_TOL, f"grad {k}")


@pytest.mark.parametrize("v", [4133, 16411], ids=["two_blocks", "two_segments"])
def test_vocab_above_max_block_unpatched(v):
    # V > 4096 with the real constants, on a tiny problem: several blocks, then several segments.
    inputs = make_inputs(2, 8, v, bias=True, class_weight=True, n_ignored=0, seed=3)
    kt, rt = leaves(inputs, torch.float32), leaves(inputs, torch.float64)
    options = {"label_smoothing": 0.1, "softcap": 8.0, "z_loss_scale": 0.01}
    out = run_flce(kt, policy=FixedChunkSize(2), return_token_accuracy=True, **options)
    ref_loss, _, ref_acc = run_reference(rt, **options)
    assert_close(out.loss, ref_loss, FP32_TOL, "loss")
    assert abs(out.token_accuracy.item() - ref_acc.item()) < 1e-6
    got, want = grads(out.loss, kt, None), grads(ref_loss, rt, None)
    for k in want:
        assert_close(got[k], want[k], FP32_TOL, f"grad {k}")


# --------------------------------------------------------------------------- shapes and layouts


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_3d_non_contiguous_input(reduction):
    B, T = 3, 11
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, B, H, generator=g).to(DEVICE).transpose(0, 1)  # [B, T, H], not contiguous
    w = (torch.randn(H, V, generator=g) * (3.0 / H**0.5)).to(DEVICE).t()  # [V, H], not contiguous (tied embedding)
    b = torch.randn(V, generator=g).to(DEVICE)
    y = torch.randint(0, V, (T, B), generator=g).to(DEVICE).t()  # [B, T], not contiguous
    y[1, 4] = -100
    assert not (x.is_contiguous() or w.is_contiguous() or y.is_contiguous())
    inputs = {"x": x, "w": w, "b": b, "y": y}
    loss = check_against_reference(
        inputs,
        grad_output=default_grad_output(reduction, y.shape),
        policy=FixedChunkSize(8),
        reduction=reduction,
        z_loss_scale=0.01,
    )
    assert loss.shape == ((B, T) if reduction == "none" else ())


def test_3d_input_extra_outputs_keep_target_shape():
    B, T = 3, 11
    inputs = make_inputs(B * T, n_ignored=4)
    kt, rt = leaves(inputs, torch.float32), leaves(inputs, torch.float64)
    kt = {**kt, "x": kt["x"].view(B, T, H), "y": kt["y"].view(B, T)}
    rt = {**rt, "x": rt["x"].view(B, T, H), "y": rt["y"].view(B, T)}
    options = {"reduction": "none", "z_loss_scale": 0.01}
    out = run_flce(kt, policy=FixedChunkSize(8), return_z_loss=True, return_token_accuracy=True, **options)
    ref_loss, ref_z, ref_acc = run_reference(rt, **options)
    assert out.loss.shape == out.z_loss.shape == (B, T)
    assert_close(out.loss, ref_loss, FP32_TOL, "loss")
    assert_close(out.z_loss, ref_z, FP32_TOL, "z_loss")
    assert abs(out.token_accuracy.item() - ref_acc.item()) < 1e-6


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_return_z_loss_without_z_loss_is_zero(reduction):
    inputs = make_inputs(n_ignored=2)
    out = run_flce(leaves(inputs, torch.float32), policy=FixedChunkSize(8), reduction=reduction, return_z_loss=True)
    ref_loss = run_reference(leaves(inputs, torch.float64), reduction=reduction)[0]
    assert out.token_accuracy is None
    assert out.z_loss.shape == ref_loss.shape and (out.z_loss == 0).all()
    assert_close(out.loss, ref_loss, FP32_TOL, "loss")


@pytest.mark.parametrize(("bt", "h", "v"), [(1, 1, 1), (1, 3, 2), (2, 1, 5), (3, 4, 64)])
def test_tiny_shapes(bt, h, v):
    # V=1: a single class, the loss is exactly 0; V=64: one exact power-of-two block
    inputs = make_inputs(bt, h, v, bias=True, class_weight=True, seed=2)
    check_against_reference(inputs, policy=FixedChunkSize(1), label_smoothing=0.1, softcap=3.0, z_loss_scale=0.01)


def test_tied_weight_gradients_accumulate():
    # The LM head is also the embedding: W gets gradient through the input and as the weight.
    inputs = make_inputs(bias=False)
    ids = torch.randint(0, V, (BT,), generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def run(w, fn, **kw):
        x = w[ids] * 0.5
        return fn(x, w, inputs["y"], None, **kw)

    w = inputs["w"].clone().requires_grad_()
    loss = run(w, fused_linear_cross_entropy, policy=FixedChunkSize(8), z_loss_scale=0.01)
    loss.backward()
    wr = inputs["w"].double().requires_grad_()
    ref_loss = run(wr, reference, z_loss_scale=0.01)[0]
    ref_loss.backward()
    assert_close(loss, ref_loss, FP32_TOL, "loss")
    assert_close(w.grad, wr.grad, FP32_TOL, "grad w")
    # a second call accumulates into the same .grad
    run(w, fused_linear_cross_entropy, policy=FixedChunkSize(8), z_loss_scale=0.01).backward()
    assert_close(w.grad, 2 * wr.grad, FP32_TOL, "accumulated grad w")


@pytest.mark.parametrize("cw_dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_class_weight_dtypes(cw_dtype):
    inputs = make_inputs(class_weight=True, n_ignored=3)
    inputs["cw"] = inputs["cw"].to(cw_dtype)  # the reference gets the same (rounded) values
    check_against_reference(inputs, policy=FixedChunkSize(8), label_smoothing=0.1)


@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int16])
def test_narrow_integer_targets(target_dtype):
    inputs = make_inputs(n_ignored=3)
    inputs["y"] = inputs["y"].to(target_dtype)
    check_against_reference(inputs, policy=FixedChunkSize(8), reduction="sum")


# --------------------------------------------------------------------------- low precision


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (steadier than max-norm at bf16 granularity)."""
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - e).norm() / e.norm()).item()


def _eager_factor(dtype: torch.dtype) -> float:
    """How many times eager torch's error the kernel may have.

    2 in general. The Triton interpreter casts fp32 -> bf16 by truncation (triton/runtime/interpreter.py,
    ``_convert_float`` without a rounding mode) where the GPU rounds to nearest, which doubles the
    rounding error of the dL/dlogits written into a bf16 slab: 4 there.
    """
    return 4.0 if (dtype == torch.bfloat16 and KERNELS_INTERPRETED) else 2.0


@pytest.mark.parametrize("accum_dtype", [None, torch.float32], ids=["accum_default", "accum_fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("input_kw", "options"),
    [
        pytest.param({"bias": True}, {}, id="plain"),
        pytest.param(EVERYTHING_INPUTS, EVERYTHING_OPTIONS, id="everything"),
    ],
)
def test_low_precision_within_eager_error(dtype, accum_dtype, input_kw, options):
    """bf16/fp16 inputs: relative L2 error vs the exact reference bounded by eager torch's own error.

    Exact reference: the same low-precision values, upcast to float64. Eager: the GEMM in the low
    dtype, the loss in fp32, ``F.cross_entropy((x @ W.T + b).float(), y)``, as a bf16 model does.
    The floor (eps/16 of the dtype) only matters when eager happens to be nearly exact.
    """
    inputs = make_inputs(**input_kw)
    low = leaves(inputs, dtype)
    exact = leaves(low, torch.float64)
    eager = leaves(low, dtype)
    ref_loss = run_reference(exact, **options)[0]
    eager_loss = run_reference(eager, upcast=torch.float32, **options)[0]
    ref_grads, eager_grads = grads(ref_loss, exact, None), grads(eager_loss, eager, None)
    factor, floor = _eager_factor(dtype), torch.finfo(dtype).eps / 16

    loss = run_flce(low, policy=FixedChunkSize(8), accum_dtype=accum_dtype, **options)
    assert loss.dtype == torch.float32
    # the loss sees the same rounded logits as eager: factor 2 whatever the cast
    tol = max(2 * rel_l2(eager_loss, ref_loss), floor)
    assert rel_l2(loss, ref_loss) <= tol, f"loss: {rel_l2(loss, ref_loss):.3g} > {tol:.3g}"
    got = grads(loss, low, None)
    for k in ref_grads:
        assert got[k].dtype == dtype
        err, eager_err = rel_l2(got[k], ref_grads[k]), rel_l2(eager_grads[k], ref_grads[k])
        tol = max(factor * eager_err, floor)
        assert err <= tol, f"grad {k}: relative L2 error {err:.3g} > {tol:.3g} (eager {eager_err:.3g})"


# --------------------------------------------------------------------------- the module


def test_module_matches_function_and_reference():
    inputs = make_inputs(**EVERYTHING_INPUTS)
    options = {**EVERYTHING_OPTIONS, "reduction": "sum", "class_weight": inputs["cw"]}
    module = FusedLinearCrossEntropyLoss(policy=FixedChunkSize(8), **options)
    assert "reduction='sum'" in repr(module)

    mt, ft, rt = (leaves(inputs, dt) for dt in (torch.float32, torch.float32, torch.float64))
    loss = module(mt["x"], mt["w"], mt["y"], mt["b"])
    assert loss.shape == ()  # sum, honoured
    fn_loss = run_flce(ft, policy=FixedChunkSize(8), **EVERYTHING_OPTIONS, reduction="sum")
    ref_loss = run_reference(rt, **EVERYTHING_OPTIONS, reduction="sum")[0]
    assert_close(loss, ref_loss, FP32_TOL, "module loss vs reference")
    assert_close(loss, fn_loss, FP32_TOL, "module loss vs function")
    go = torch.tensor(2.5, device=DEVICE)
    got, fn_got, want = grads(loss, mt, go), grads(fn_loss, ft, go), grads(ref_loss, rt, go)
    for k in want:
        assert_close(got[k], want[k], FP32_TOL, f"module grad {k} vs reference")
        assert_close(got[k], fn_got[k], FP32_TOL, f"module grad {k} vs function")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_module_honours_options(reduction):
    inputs = make_inputs(n_ignored=4, ignore_index=-1)
    module = FusedLinearCrossEntropyLoss(
        policy=FixedChunkSize(4),
        reduction=reduction,
        ignore_index=-1,
        label_smoothing=0.1,
        z_loss_scale=0.01,
        return_z_loss=True,
        return_token_accuracy=True,
    )
    t, rt = leaves(inputs, torch.float32), leaves(inputs, torch.float64)
    out = module(t["x"], t["w"], t["y"])
    ref_loss, ref_z, ref_acc = reference(
        rt["x"], rt["w"], rt["y"], reduction=reduction, ignore_index=-1, label_smoothing=0.1, z_loss_scale=0.01
    )
    assert isinstance(out, FLCEOutput)
    assert_close(out.loss, ref_loss, FP32_TOL, "loss")
    assert_close(out.z_loss, ref_z, FP32_TOL, "z_loss")
    assert abs(out.token_accuracy.item() - ref_acc.item()) < 1e-6
