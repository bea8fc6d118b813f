"""torch.compile of the loss: one custom-op node, no graph break, compiled equal to eager.

CPU, under the Triton interpreter, with ``backend="aot_eager"`` (and inductor once, for the
gradient buffers). Compiled results are compared with the same call in eager mode, which
``test_loss_kernel.py`` checks against a float64 torch reference. Compiles are few and reused:
each costs seconds on a 2-core CI machine.
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from test_loss_kernel import DEVICE
from test_loss_kernel import make_inputs as _make_inputs
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import flce_policy.call.autograd as flce_autograd
import flce_policy.call.custom_op as custom_op
from flce_policy import FLCEPolicy, OOMFallbackWarning, fused_linear_cross_entropy
from flce_policy.kernels.driver import inject_oom, observe_chunks
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.strategies import FixedChunkSize

#: Smaller than the other loss tests' 37x61x509: the interpreter runs each call twice (compiled and
#: eager) here. 19 rows in chunks of 8: three chunks, the last of 3 rows.
BT, H, V = 19, 16, 67

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="the kernels were compiled and there is no CUDA GPU"
)

#: Module-level, so the policy objects Dynamo guards on stay the same.
EIGHT_ROWS = FLCEPolicy(default=FixedChunkSize(8))
SIXTEEN_ROWS = FLCEPolicy(default=FixedChunkSize(16))
OP_NAME = "flce_policy.fused_linear_cross_entropy"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_inputs(bt=BT, h=H, v=V, **kwargs):
    return _make_inputs(bt, h, v, **kwargs)


def _leaves(inputs, names=("x", "w", "b")):
    return {k: (t.detach().clone().requires_grad_() if k in names else t) for k, t in inputs.items()}


def _all_reductions(t, coeffs, **options):
    """The three reductions in one step, mixed with coefficients != 1 so every backward path scales."""
    common = dict(policy=options.pop("policy", EIGHT_ROWS), class_weight=t.get("cw"), **options)
    extras = dict(return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True)
    mean = fused_linear_cross_entropy(t["x"], t["w"], t["y"], t.get("b"), reduction="mean", **extras, **common)
    total = fused_linear_cross_entropy(t["x"], t["w"], t["y"], t.get("b"), reduction="sum", **common)
    rows = fused_linear_cross_entropy(t["x"], t["w"], t["y"], t.get("b"), reduction="none", **extras, **common)
    objective = coeffs[0] * mean.loss + coeffs[1] * total + (coeffs[2:] * rows.loss).sum()
    return objective, [*mean, total, *rows]


def _run_step(step, inputs, coeffs, **options):
    t = _leaves(inputs)
    objective, outputs = step(t, coeffs, **options)
    objective.backward()
    grads = [t[k].grad for k in ("x", "w", "b") if k in t]
    return [objective, *outputs], grads


def _assert_same(compiled, eager, what):
    assert len(compiled) == len(eager), what
    for i, (c, e) in enumerate(zip(compiled, eager, strict=True)):
        if e is None:
            assert c is None, f"{what}[{i}]"
            continue
        assert c.dtype == e.dtype and c.shape == e.shape, (
            f"{what}[{i}]: {c.dtype}{tuple(c.shape)} vs {e.dtype}{tuple(e.shape)}"
        )
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-7, equal_nan=False, msg=f"{what}[{i}]")


OPTION_SETS = [
    pytest.param(
        {"bias": True, "class_weight": True, "n_ignored": 6},
        {"softcap": 6.0, "label_smoothing": 0.1, "z_loss_scale": 0.01},
        id="ignored_bias_class_weight_softcap_smoothing_z_loss",
    ),
    pytest.param(
        {"n_ignored": 4, "ignore_index": -1}, {"ignore_index": -1, "use_token_scaling": True}, id="token_scaling"
    ),
    pytest.param({"n_ignored": 5}, {"policy": "vocab_tiled", "z_loss_scale": 1e-3}, id="geometry_vocab_tiled"),
]


@pytest.mark.parametrize("input_kw, options", OPTION_SETS)
def test_compiled_fullgraph_equals_eager(input_kw, options):
    inputs = make_inputs(**input_kw)
    if options.get("policy") == "vocab_tiled":
        options = {**options, "policy": Geometry.for_problem(Problem(BT, H, V, "float32"), 8, vocab_chunk=32)}
    coeffs = torch.cat([torch.tensor([0.7, 1.3]), torch.linspace(-1.0, 2.0, BT)]).to(DEVICE)
    compiled = torch.compile(_all_reductions, fullgraph=True, backend="aot_eager")
    got, got_grads = _run_step(compiled, inputs, coeffs, **options)
    want, want_grads = _run_step(_all_reductions, inputs, coeffs, **options)
    _assert_same(got, want, "outputs")
    _assert_same(got_grads, want_grads, "gradients")
    assert len(got_grads) == (3 if input_kw.get("bias") else 2)


def test_dynamo_eager_backend_equals_eager():
    """backend="eager" runs the traced autograd.Function around the op without AOTAutograd."""
    inputs = make_inputs(bias=True, class_weight=True, n_ignored=5)
    coeffs = torch.cat([torch.tensor([0.7, 1.3]), torch.linspace(-1.0, 2.0, BT)]).to(DEVICE)
    compiled = torch.compile(_all_reductions, fullgraph=True, backend="eager")
    got, got_grads = _run_step(compiled, inputs, coeffs, softcap=6.0, z_loss_scale=0.01)
    want, want_grads = _run_step(_all_reductions, inputs, coeffs, softcap=6.0, z_loss_scale=0.01)
    _assert_same(got, want, "outputs")
    _assert_same(got_grads, want_grads, "gradients")


def test_compiled_autograd_equals_eager():
    """torch._dynamo.config.compiled_autograd: the backward (the op's scale pass and none's recompute) is
    traced again at backward time by compiled autograd, and still equals eager's."""
    inputs = make_inputs(bias=True, class_weight=True, n_ignored=5)
    coeffs = torch.cat([torch.tensor([0.7, 1.3]), torch.linspace(-1.0, 2.0, BT)]).to(DEVICE)

    def train_step(t):
        objective, outputs = _all_reductions(t, coeffs, label_smoothing=0.1)
        objective.backward()  # a graph break, where compiled autograd takes over
        return objective, outputs

    want, want_grads = _run_step(_all_reductions, inputs, coeffs, label_smoothing=0.1)
    counters = torch._dynamo.utils.counters["compiled_autograd"]
    counters.clear()
    with torch._dynamo.config.patch(compiled_autograd=True):  # read when torch.compile wraps the function
        compiled = torch.compile(train_step, backend="aot_eager")
        for _ in range(2):
            t = _leaves(inputs)
            objective, outputs = compiled(t)
            _assert_same([objective, *outputs], want, "outputs")
            _assert_same([t[k].grad for k in ("x", "w", "b")], want_grads, "gradients")
    assert counters["captures"] >= 1  # compiled autograd traced the backward


def test_second_backward_through_one_loss():
    """retain_graph=True then a second backward: eager refuses (its gradients are scaled in place once);
    compiled, each backward returns a new scaled tensor, so the second accumulates the same gradient again."""
    inputs = make_inputs(n_ignored=3)
    t = _leaves(inputs)
    loss = _plain(t["x"], t["w"], t["y"])
    (2 * loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice through the same call"):
        (2 * loss).backward()
    want = t["x"].grad.clone(), t["w"].grad.clone()

    compiled = torch.compile(_plain, fullgraph=True, backend="aot_eager")
    t = _leaves(inputs)
    loss = compiled(t["x"], t["w"], t["y"])
    (2 * loss).backward(retain_graph=True)
    (2 * loss).backward()
    torch.testing.assert_close(t["x"].grad, 2 * want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(t["w"].grad, 2 * want[1], rtol=1e-6, atol=1e-7)


def test_explain_reports_one_graph_and_no_break():
    inputs = make_inputs(bias=True, class_weight=True, n_ignored=3)
    t = _leaves(inputs)
    coeffs = torch.ones(2 + BT, device=DEVICE)
    explanation = torch._dynamo.explain(_all_reductions)(t, coeffs, softcap=5.0)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    # the three calls, each one opaque node (in the forward subgraph of its autograd.Function), and
    # reduction none's recompute in its backward subgraph
    code = "".join(module.code for module in explanation.graphs[0].modules())
    assert code.count(f"{OP_NAME}.default(") == 3
    assert code.count(f"{OP_NAME}_backward.default(") == 1


def test_autocast_compiled_equals_eager():
    inputs = make_inputs(bias=True, n_ignored=4)

    def step(t):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = fused_linear_cross_entropy(t["x"], t["w"], t["y"], t["b"], policy=EIGHT_ROWS, z_loss_scale=1e-3)
        return out

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, step):
        t = _leaves(inputs)
        loss = fn(t)
        (loss * 1.5).backward()
        results.append([loss, t["x"].grad, t["w"].grad, t["b"].grad])
    _assert_same(*results, "autocast")
    assert all(g.dtype == torch.float32 for g in results[0][1:])  # the fp32 leaves' dtypes


def test_dynamic_token_count_resolves_each_size_without_recompiling():
    counter = CompileCounterWithBackend("aot_eager")

    def loss_of(x, w, y):
        return fused_linear_cross_entropy(x, w, y, policy=EIGHT_ROWS, reduction="sum", softcap=5.0)

    compiled = torch.compile(loss_of, fullgraph=True, backend=counter)
    for tokens in (19, 30):
        inputs = make_inputs(bt=tokens, n_ignored=5, seed=tokens)
        results, chunks = [], []
        for fn in (compiled, loss_of):
            x, w = (inputs[k].clone().requires_grad_() for k in ("x", "w"))
            y = inputs["y"].clone()
            if fn is compiled:
                torch._dynamo.mark_dynamic(x, 0)
                torch._dynamo.mark_dynamic(y, 0)
            with observe_chunks() as events:
                loss = fn(x, w, y)
            loss.backward()
            results.append([loss, x.grad, w.grad])
            chunks.append(len(events))
        _assert_same(*results, f"{tokens} tokens")
        assert chunks == [-(-tokens // 8)] * 2  # the geometry of this size, resolved at run time
    assert counter.frame_count == 1


def test_policy_object_is_guarded():
    def loss_of(x, w, y, policy):
        return fused_linear_cross_entropy(x, w, y, policy=policy)

    compiled = torch.compile(loss_of, fullgraph=True, backend="aot_eager")
    inputs = make_inputs()
    seen = []
    for policy in (EIGHT_ROWS, SIXTEEN_ROWS, EIGHT_ROWS):
        with observe_chunks() as events:
            compiled(inputs["x"], inputs["w"], inputs["y"], policy)
        seen.append(len(events))
    assert seen == [3, 2, 3]


def test_strategy_policy_under_compile_names_the_fix():
    compiled = torch.compile(
        lambda x, w, y: fused_linear_cross_entropy(x, w, y, policy=FixedChunkSize(8)),
        fullgraph=True,
        backend="aot_eager",
    )
    inputs = make_inputs()
    with pytest.raises(Exception, match=r"FLCEPolicy\(default=strategy\)"):
        compiled(inputs["x"], inputs["w"], inputs["y"])


def test_geometry_for_another_problem_under_compile_says_so():
    """A Geometry is checked against the traced shapes and dtype, with the eager path's message."""
    made_for = Geometry.for_problem(Problem(BT + 1, H, V, "float32"), 8)
    compiled = torch.compile(
        lambda x, w, y: fused_linear_cross_entropy(x, w, y, policy=made_for), fullgraph=True, backend="aot_eager"
    )
    inputs = make_inputs()
    with pytest.raises(Exception, match=rf"geometry was made for BT={BT + 1} H={H} V={V} float32 but the tensors "
                       rf"are BT={BT} H={H} V={V} float32"):  # fmt: skip
        compiled(inputs["x"], inputs["w"], inputs["y"])


# --------------------------------------------------------------------------- bad targets


def _mean_and_none(x, w, y):
    mean = fused_linear_cross_entropy(x, w, y, policy=EIGHT_ROWS)
    rows = fused_linear_cross_entropy(x, w, y, policy=EIGHT_ROWS, reduction="none")
    return mean, rows


def _bad_targets(inputs):
    y = inputs["y"].clone()
    y[3] = V + 2
    y[7] = -100
    return y


def test_compiled_bad_target_raises_the_eager_error():
    inputs = make_inputs()
    compiled = torch.compile(_mean_and_none, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match=rf"target holds index {V + 2}, outside \[0, V={V}\)"):
        compiled(inputs["x"], inputs["w"], _bad_targets(inputs))


def test_bad_target_where_no_host_sync_is_allowed_gives_nan(monkeypatch):
    # As under CUDA-graph capture: the op checks on the device and answers with NaN.
    monkeypatch.setattr(custom_op, "_host_sync_allowed", lambda device: False)
    inputs = make_inputs(n_ignored=3)
    compiled = torch.compile(_mean_and_none, fullgraph=True, backend="aot_eager")

    x, w = (inputs[k].clone().requires_grad_() for k in ("x", "w"))
    y = _bad_targets(inputs)
    mean, rows = compiled(x, w, y)
    assert torch.isnan(mean) and torch.isnan(rows).all()
    mean.backward()
    # every gradient the loss reaches is NaN; ignored rows (the bad one runs as ignored) get none
    counted = (y >= 0) & (y < V)
    assert torch.isnan(w.grad).all() and torch.isnan(x.grad[counted]).all()
    assert (x.grad[~counted] == 0).all()

    # valid targets on the same path: the eager result, nothing poisoned
    results = []
    for fn in (compiled, _mean_and_none):
        x, w = (inputs[k].clone().requires_grad_() for k in ("x", "w"))
        mean, rows = fn(x, w, inputs["y"])
        (mean + rows.sum()).backward()
        results.append([mean, rows, x.grad, w.grad])
    _assert_same(*results, "valid targets, device-side check")


# --------------------------------------------------------------------------- OOM fallback inside the op


def test_oom_fallback_runs_inside_the_op_and_is_remembered():
    policy = FLCEPolicy(default=FixedChunkSize(16), min_chunk_size=8)
    compiled = torch.compile(
        lambda x, w, y: fused_linear_cross_entropy(x, w, y, policy=policy), fullgraph=True, backend="aot_eager"
    )
    inputs = make_inputs(n_ignored=4)
    want = fused_linear_cross_entropy(inputs["x"], inputs["w"], inputs["y"], policy=EIGHT_ROWS)
    with inject_oom(above_rows=8) as faults:
        with pytest.warns(OOMFallbackWarning, match="completed at 8 rows"):
            first = compiled(inputs["x"], inputs["w"], inputs["y"])
        with warnings.catch_warnings():
            warnings.simplefilter("error", OOMFallbackWarning)
            with observe_chunks() as events:
                second = compiled(inputs["x"], inputs["w"], inputs["y"])
    assert [rows for rows, _ in faults] == [16]
    assert {e.rows for e in events} == {8, 3}
    torch.testing.assert_close(first, want, rtol=0, atol=0)
    torch.testing.assert_close(second, want, rtol=0, atol=0)


# --------------------------------------------------------------------------- the op's fake implementation


def _op_args(t, reduction, predicted, compute_dtype, wants, ignore_index=-100):
    config = custom_op._config_text(
        0, 0, 0, "", "logits", False, reduction, ignore_index, 0.0, None, "fp32", 0.0, True, predicted, False, None,
        False, None, None, None, compute_dtype, *wants,
    )  # fmt: skip
    return (t["x"], t["w"], t.get("b"), t["y"], None, config)


@pytest.mark.parametrize("bt", [3, 0])  # a few rows (one not ignored), and none
def test_fake_shapes_match_the_real_op_for_every_combination(bt):
    inputs = make_inputs(bt=bt, h=8, v=17, bias=True, n_ignored=min(bt, 2))
    op = torch.ops.flce_policy.fused_linear_cross_entropy
    for reduction in ("mean", "sum", "none"):
        for bias in (True, False):
            for wants in ((True, True, True), (False, True, False), (False, False, False)):
                for predicted in (True, False):
                    for compute_dtype in (None, torch.bfloat16):
                        t = {k: v for k, v in inputs.items() if bias or k != "b"}
                        args = _op_args(t, reduction, predicted, compute_dtype, wants)
                        real = op(*args)
                        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
                            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
                            fake = op(*fake_args)
                        case = f"{reduction} bias={bias} wants={wants} predicted={predicted} {compute_dtype}"
                        assert [(r.shape, r.dtype) for r in real] == [(f.shape, f.dtype) for f in fake], case


def test_opcheck():
    inputs = make_inputs(bt=6, h=8, v=17, bias=True, n_ignored=2)
    t = inputs  # no leaves: the op is what autograd records through _CompiledLoss, not by itself
    op = torch.ops.flce_policy.fused_linear_cross_entropy.default
    # Left out: test_aot_dispatch_dynamic, which asks for gradients of the non-differentiable
    # outputs (the op under AOT dispatch is what every compiled test here runs), and
    # test_autograd_registration: the op has no autograd kernel, its derivative is the
    # autograd.Function Dynamo traces around it (test_op_called_directly_where_autograd_records_says_so).
    utils = ("test_schema", "test_faketensor")
    for reduction in ("mean", "none"):
        torch.library.opcheck(op, _op_args(t, reduction, True, None, (True, True, True)), test_utils=utils)


def test_op_called_directly_where_autograd_records_says_so():
    inputs = make_inputs(bt=6, h=8, v=17, n_ignored=2)
    t = _leaves(inputs)
    op = torch.ops.flce_policy.fused_linear_cross_entropy.default
    with pytest.raises(RuntimeError, match="no derivative of their own: call flce_policy.fused_linear_cross_entropy"):
        op(*_op_args(t, "mean", False, None, (True, True, False)))
    with torch.no_grad():  # nothing to record: it runs
        loss = op(*_op_args(t, "mean", False, None, (True, True, False)))[0]
    torch.testing.assert_close(loss, fused_linear_cross_entropy(t["x"], t["w"], t["y"]).detach())


def test_malformed_config_is_named():
    inputs = make_inputs(bt=6, h=8, v=17)
    with pytest.raises(ValueError, match="malformed op config 'reduction=mean'"):
        with torch.no_grad():
            torch.ops.flce_policy.fused_linear_cross_entropy.default(
                inputs["x"], inputs["w"], None, inputs["y"], None, "reduction=mean"
            )


# --------------------------------------------------------------------------- no copy of the gradients


def _driver_buffers(monkeypatch):
    """data_ptrs of the grad_input/grad_weight buffers the driver allocates, per run."""
    seen = []
    run = flce_autograd.run_with_oom_fallback

    def spy(*args, **kwargs):
        out, geometry = run(*args, **kwargs)
        if out.grad_weight is not None:
            seen.append((out.grad_input.data_ptr(), out.grad_weight.data_ptr()))
        return out, geometry

    monkeypatch.setattr(flce_autograd, "run_with_oom_fallback", spy)
    return seen


def _grads_are_the_driver_buffers(fn, inputs, seen):
    x, w = (inputs[k].clone().requires_grad_() for k in ("x", "w"))
    loss = fn(x, w, inputs["y"])
    (2.0 * loss).backward()  # grad_output != 1: the in-place scale runs
    return seen[-1] == (x.grad.data_ptr(), w.grad.data_ptr())


def _op_eagerly(x, w, y):
    from flce_policy.call.options import LossOptions

    return custom_op.compiled_loss(x, w, None, y, None, EIGHT_ROWS, LossOptions(), None)[0]


def _plain(x, w, y):
    return fused_linear_cross_entropy(x, w, y, policy=EIGHT_ROWS)


def test_gradients_are_the_buffers_the_driver_allocated(monkeypatch):
    seen = _driver_buffers(monkeypatch)
    inputs = make_inputs(n_ignored=3)
    assert _grads_are_the_driver_buffers(_plain, inputs, seen)  # eager, FLCEFunction
    assert _grads_are_the_driver_buffers(_op_eagerly, inputs, seen)  # the custom op's autograd, eagerly

    def copying(x, w, y):  # a hook that copies the gradient: the detector sees it
        w.register_hook(lambda g: g.clone())
        return _plain(x, w, y)

    assert not _grads_are_the_driver_buffers(copying, inputs, seen)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor on CPU needs a C++ compiler"
)
def test_inductor_reinplaces_the_scale_no_gradient_copy(monkeypatch):
    seen = _driver_buffers(monkeypatch)
    inputs = make_inputs(n_ignored=3)
    compiled = torch.compile(_plain, fullgraph=True, backend="inductor")
    want = _plain(inputs["x"], inputs["w"], inputs["y"])
    assert _grads_are_the_driver_buffers(compiled, inputs, seen)
    torch.testing.assert_close(compiled(inputs["x"], inputs["w"], inputs["y"]), want, rtol=1e-6, atol=0)
