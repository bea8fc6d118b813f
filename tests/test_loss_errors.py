"""Bad arguments give clear Python errors; empty and all-ignored batches give defined results."""

from __future__ import annotations

import math

import pytest
import torch
from test_loss_kernel import DEVICE, NEEDS_KERNEL_DEVICE

from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED
from flce_policy.kernels.driver import observe_chunks
from flce_policy.loss import FLCEOutput, FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from flce_policy.strategies import FixedChunkSize

pytestmark = NEEDS_KERNEL_DEVICE

BT, H, V = 5, 8, 11


def base(dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "input": torch.randn(BT, H, generator=g).to(dtype).to(DEVICE),
        "weight": torch.randn(V, H, generator=g).to(dtype).to(DEVICE),
        "target": torch.randint(0, V, (BT,), generator=g).to(DEVICE),
    }


def call(**overrides):
    args = {**base(), "policy": FixedChunkSize(2), **overrides}
    return fused_linear_cross_entropy(**args)


def with_target(*values: int) -> torch.Tensor:
    t = base()["target"].clone()
    t[: len(values)] = torch.tensor(values)
    return t


# (overrides, exception type, regex the message must match)
ERROR_CASES = [
    # shapes
    pytest.param({"input": torch.randn(BT, H - 1)}, ValueError, r"input.*H=8", id="hidden_mismatch"),
    pytest.param({"input": torch.tensor(1.0)}, ValueError, r"input", id="input_0d"),
    pytest.param({"weight": torch.randn(V * H)}, ValueError, r"weight must be 2-D", id="weight_1d"),
    pytest.param({"weight": torch.randn(1, V, H)}, ValueError, r"weight must be 2-D", id="weight_3d"),
    pytest.param({"target": torch.zeros(BT - 1, dtype=torch.long)}, ValueError, r"target shape", id="target_short"),
    pytest.param({"target": torch.zeros(BT, 1, dtype=torch.long)}, ValueError, r"target shape", id="target_extra_dim"),
    pytest.param({"bias": torch.zeros(V - 1)}, ValueError, r"bias", id="bias_short"),
    pytest.param({"bias": torch.zeros(V, 1)}, ValueError, r"bias", id="bias_2d"),
    # dtypes
    pytest.param({"weight": torch.randn(V, H).bfloat16()}, TypeError, r"weight dtype.*input dtype", id="weight_dtype"),
    pytest.param({"bias": torch.zeros(V, dtype=torch.float16)}, TypeError, r"bias dtype", id="bias_dtype"),
    pytest.param(
        {"input": torch.randn(BT, H).double(), "weight": torch.randn(V, H).double()},
        TypeError,
        r"input dtype",
        id="float64_input",
    ),
    pytest.param({"target": torch.zeros(BT)}, TypeError, r"target.*integer", id="float_target"),
    pytest.param({"target": torch.zeros(BT, dtype=torch.bool)}, TypeError, r"target.*integer", id="bool_target"),
    pytest.param({"input": [[0.0] * H] * BT}, TypeError, r"input must be a torch.Tensor", id="input_not_tensor"),
    # target values
    pytest.param({"target": with_target(1, V)}, ValueError, rf"target.*\b{V}\b", id="target_eq_vocab"),
    pytest.param({"target": with_target(V + 30)}, ValueError, rf"target.*\b{V + 30}\b", id="target_above_vocab"),
    pytest.param({"target": with_target(0, -5)}, ValueError, r"target.*-5", id="negative_target"),
    pytest.param(
        {"target": with_target(-100), "ignore_index": -1}, ValueError, r"target.*-100", id="default_ignore_not_ignored"
    ),
    # options
    pytest.param({"label_smoothing": -0.1}, ValueError, r"label_smoothing", id="label_smoothing_negative"),
    pytest.param({"label_smoothing": 1.1}, ValueError, r"label_smoothing", id="label_smoothing_above_1"),
    pytest.param({"label_smoothing": math.nan}, ValueError, r"label_smoothing", id="label_smoothing_nan"),
    pytest.param({"softcap": 0.0}, ValueError, r"softcap", id="softcap_zero"),
    pytest.param({"softcap": -3.0}, ValueError, r"softcap", id="softcap_negative"),
    pytest.param({"softcap": math.nan}, ValueError, r"softcap", id="softcap_nan"),
    pytest.param({"softcap": math.inf}, ValueError, r"softcap", id="softcap_inf"),
    pytest.param({"reduction": "avg"}, ValueError, r"reduction", id="reduction_unknown"),
    pytest.param({"reduction": "MEAN"}, ValueError, r"reduction", id="reduction_case"),
    pytest.param({"z_loss_scale": -1e-4}, ValueError, r"z_loss_scale", id="z_loss_negative"),
    pytest.param({"z_loss_scale": math.nan}, ValueError, r"z_loss_scale", id="z_loss_nan"),
    pytest.param({"ignore_index": 1.5}, TypeError, r"ignore_index", id="ignore_index_float"),
    pytest.param({"ignore_index": True}, TypeError, r"ignore_index", id="ignore_index_bool"),
    pytest.param({"accum_dtype": torch.float64}, ValueError, r"accum_dtype", id="accum_dtype_float64"),
    pytest.param({"class_weight": torch.ones(V - 1)}, ValueError, r"class_weight.*V=11", id="class_weight_short"),
    pytest.param({"class_weight": torch.ones(V, 1)}, ValueError, r"class_weight", id="class_weight_2d"),
    pytest.param({"class_weight": [1.0] * V}, ValueError, r"class_weight", id="class_weight_list"),
    pytest.param({"class_weight": torch.ones(V, dtype=torch.long)}, TypeError, r"class_weight", id="class_weight_int"),
]


def _on_device(overrides: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in overrides.items()}


@pytest.mark.parametrize(("overrides", "exc", "message"), ERROR_CASES)
def test_bad_arguments_raise_clear_errors(overrides, exc, message):
    with observe_chunks() as events:
        with pytest.raises(exc, match=message):
            call(**_on_device(overrides))
    if exc is ValueError and message.startswith("target."):
        # a bad target value is read after the chunks are queued, which ran on safe targets
        # (bad rows ignored: tests/test_target_check.py); every other check comes before any kernel
        return
    assert events == []  # caught before any kernel ran


@pytest.mark.parametrize(
    "policy", ["default", 8, {"strategy": "fixed_chunk_size"}, object()], ids=["str", "int", "dict", "object"]
)
def test_policy_of_wrong_type(policy):
    pytest.importorskip("flce_policy.engine.policy")
    with pytest.raises(TypeError, match=r"policy"):
        call(policy=policy)


@pytest.mark.parametrize("which", ["weight", "target", "bias", "class_weight"])
def test_tensors_on_different_devices(which):
    args = base()
    extra = {"bias": torch.zeros(V, device=DEVICE), "class_weight": torch.ones(V, device=DEVICE)}
    tensors = {**args, **extra}
    tensors[which] = tensors[which].to("meta")
    with pytest.raises(ValueError, match=rf"{which} is on meta but input is on {DEVICE}"):
        fused_linear_cross_entropy(**tensors, policy=FixedChunkSize(2))


def test_unsupported_device():
    args = {k: v.to("meta") for k, v in base().items()}
    with pytest.raises(RuntimeError, match=r"unsupported device meta"):
        fused_linear_cross_entropy(**args, policy=FixedChunkSize(2))


def test_device_not_matching_triton_mode():
    if KERNELS_INTERPRETED:
        if not torch.cuda.is_available():
            pytest.skip("interpreted kernels and no CUDA tensors to misuse")
        other = "cuda"
    else:
        other = "cpu"
    args = {k: v.to(other) for k, v in base().items()}
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET"):
        fused_linear_cross_entropy(**args, policy=FixedChunkSize(2))


@pytest.mark.parametrize(
    ("options", "message"),
    [({"reduction": "avg"}, "reduction"), ({"label_smoothing": 2.0}, "label_smoothing"), ({"softcap": -1}, "softcap")],
)
def test_module_rejects_bad_options_at_construction(options, message):
    with pytest.raises(ValueError, match=message):
        FusedLinearCrossEntropyLoss(policy=FixedChunkSize(2), **options)


def test_module_rejects_bad_class_weight_when_called():
    module = FusedLinearCrossEntropyLoss(policy=FixedChunkSize(2), class_weight=torch.ones(V + 1, device=DEVICE))
    args = base()
    with pytest.raises(ValueError, match=r"class_weight"):
        module(args["input"], args["weight"], args["target"])


# --------------------------------------------------------------------------- defined results


def _leaves(shape_x: tuple[int, ...], dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape_x, generator=g).to(dtype).to(DEVICE).requires_grad_()
    w = torch.randn(V, H, generator=g).to(dtype).to(DEVICE).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).to(DEVICE).requires_grad_()
    return x, w, b


def _check_zero_grads(loss: torch.Tensor, tensors, grad_output: torch.Tensor | None = None) -> None:
    got = torch.autograd.grad(loss, tensors, grad_outputs=grad_output)
    for g, t in zip(got, tensors, strict=True):
        assert g.shape == t.shape and g.dtype == t.dtype
        assert torch.isfinite(g).all()
        assert (g == 0).all()


ALL_OPTIONS = {"label_smoothing": 0.1, "softcap": 5.0, "z_loss_scale": 1e-2}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(0, H), (2, 0, H)], ids=["2d", "3d"])
def test_empty_input(shape, reduction):
    x, w, b = _leaves(shape)
    target = torch.zeros(shape[:-1], dtype=torch.long, device=DEVICE)
    out = fused_linear_cross_entropy(
        x,
        w,
        target,
        b,
        class_weight=torch.ones(V, device=DEVICE),
        reduction=reduction,
        return_z_loss=True,
        return_token_accuracy=True,
        **ALL_OPTIONS,
    )
    assert out.loss.dtype == torch.float32
    if reduction == "none":
        assert out.loss.shape == target.shape and out.z_loss.shape == target.shape
        grad_output = torch.ones(target.shape, device=DEVICE)
    else:
        assert out.loss.shape == () and out.loss.item() == 0.0 and out.z_loss.item() == 0.0
        grad_output = None
    assert out.token_accuracy.item() == 0.0
    _check_zero_grads(out.loss, (x, w, b), grad_output)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, -1])
def test_all_targets_ignored(ignore_index, reduction, dtype):
    x, w, b = _leaves((7, H), dtype)
    target = torch.full((7,), ignore_index, device=DEVICE)
    # torch itself gives NaN for the mean here; the documented result is 0 with zero gradients
    out = fused_linear_cross_entropy(
        x,
        w,
        target,
        b,
        policy=FixedChunkSize(2),
        ignore_index=ignore_index,
        reduction=reduction,
        class_weight=torch.rand(V, device=DEVICE) + 0.5,
        return_z_loss=True,
        return_token_accuracy=True,
        **ALL_OPTIONS,
    )
    assert isinstance(out, FLCEOutput)
    assert out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss).all() and (out.loss == 0).all()
    assert (out.z_loss == 0).all() and out.token_accuracy.item() == 0.0
    if reduction == "none":
        assert out.loss.shape == (7,)
        grad_output = torch.randn(7, device=DEVICE)
    else:
        assert out.loss.shape == ()
        grad_output = torch.tensor(1.7, device=DEVICE)
    _check_zero_grads(out.loss, (x, w, b), grad_output)
