"""Where grad_weight's GEMM runs on the Gluon kernel (flce_policy.plan.weight_grad_gemm), what explain says of it,
and the driver's one call for it on CPU, against plain torch in fp32."""

from __future__ import annotations

import pytest
import torch

from flce_policy import FLCEPolicy
from flce_policy.kernels.weight_grad_gemm import accumulate_weight_grad, weight_grad_gemm
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.plan.weight_grad_gemm import (
    WEIGHT_GRAD_GEMM_ENV_VAR,
    planned_weight_grad_gemm,
    weight_grad_gemm_for,
)
from flce_policy.strategies import FixedChunkSize


@pytest.mark.parametrize(
    "family, rows, first, want",
    [
        ("H100", 1, False, "gluon"),
        ("H100", 384, False, "gluon"),  # reading the old block, up to the rule's rows
        ("H100", 385, False, "gluon_in_memory"),  # past them, adding in memory
        ("H100", 640, False, "gluon_in_memory"),
        ("H100", 641, False, "cublas"),
        ("H100", 256, True, "cublas"),  # the first chunk: nothing to read or add to
        ("H200", 256, False, "cublas"),  # not measured there
        ("A100", 256, False, "cublas"),
        ("unknown", 512, False, "cublas"),
    ],
)
def test_the_rule_by_gpu_rows_and_chunk(family, rows, first, want, monkeypatch):
    monkeypatch.delenv(WEIGHT_GRAD_GEMM_ENV_VAR, raising=False)
    assert weight_grad_gemm_for(family, rows, first=first) == want


def test_without_the_bulk_reduce_the_in_memory_rows_stay_on_cublas(monkeypatch):
    monkeypatch.delenv(WEIGHT_GRAD_GEMM_ENV_VAR, raising=False)
    assert weight_grad_gemm_for("H100", 512, first=False, in_memory_available=False) == "cublas"
    assert weight_grad_gemm_for("H100", 256, first=False, in_memory_available=False) == "gluon"


@pytest.mark.parametrize(
    "value, rows, want",
    [("cublas", 256, "cublas"), (" CUBLAS ", 512, "cublas"), ("auto", 256, "gluon"), ("", 512, "gluon_in_memory"),
     ("reduce", 256, "gluon_in_memory"), ("reduce", 8192, "gluon_in_memory")],
)  # fmt: skip
def test_the_setting_pins_a_gemm(value, rows, want, monkeypatch):
    monkeypatch.setenv(WEIGHT_GRAD_GEMM_ENV_VAR, value)
    assert weight_grad_gemm_for("H100", rows, first=False) == want


@pytest.mark.parametrize("family, want", [("H100", "gluon_in_memory"), ("H200", "gluon_in_memory"),
                                          ("GH200", "gluon_in_memory"), ("A100", "cublas"), ("B200", "cublas"),
                                          ("unknown", "cublas")])  # fmt: skip
def test_reduce_pins_the_kernel_at_any_rows_on_hopper_only(family, want, monkeypatch):
    monkeypatch.setenv(WEIGHT_GRAD_GEMM_ENV_VAR, "reduce")
    assert weight_grad_gemm_for(family, 4096, first=False) == want
    assert weight_grad_gemm_for(family, 4096, first=True) == "cublas"  # the first chunk has nothing to add to
    # a pin is not a rule: without the bulk reduce its launch raises (below) rather than fall back unseen
    assert weight_grad_gemm_for(family, 4096, first=False, in_memory_available=False) == want


def test_a_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(WEIGHT_GRAD_GEMM_ENV_VAR, "gluon-always")
    with pytest.raises(
        ValueError, match=f"{WEIGHT_GRAD_GEMM_ENV_VAR}='gluon-always': expected one of auto, cublas, reduce"
    ):
        weight_grad_gemm_for("H100", 256, first=False)


def test_adding_in_memory_without_the_bulk_reduce_names_the_setting(monkeypatch):
    from flce_policy.kernels import weight_grad_gemm as module

    monkeypatch.setattr(module, "reduce_add_available", lambda: False)
    g, x = torch.zeros(8, 16).bfloat16(), torch.zeros(8, 8).bfloat16()
    with pytest.raises(RuntimeError, match=f"{WEIGHT_GRAD_GEMM_ENV_VAR}=reduce.*lacks"):
        module.launch_weight_grad_gemm(torch.zeros(16, 8).bfloat16(), g, x, first=False, add_in_memory=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("first", [True, False])
def test_the_driver_s_call_on_cpu_matches_fp32(first, dtype):
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(48, 96, generator=gen).to(dtype)
    x = torch.randn(48, 40, generator=gen).to(dtype)
    old = torch.randn(96, 40, generator=gen).to(dtype)
    want = g.double().t() @ x.double() + (0 if first else old.double())
    out = old.clone()
    accumulate_weight_grad(out, g, x, first=first)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert torch.allclose(out.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize(
    "grad_weight, g, x, match",
    [
        (torch.zeros(96, 40), torch.zeros(48, 96), torch.zeros(48, 40), "grad_weight must be a 2-D bf16 tensor"),
        (torch.zeros(96, 40).bfloat16(), torch.zeros(48, 96).bfloat16().t(), torch.zeros(48, 40).bfloat16(),
         "g needs contiguous, 16-byte aligned rows"),
        (torch.zeros(96, 40).bfloat16(), torch.zeros(48, 96).bfloat16(), torch.zeros(48, 40).bfloat16(),
         "all tensors must be on one CUDA device"),
    ],
)  # fmt: skip
def test_the_kernel_refuses_what_it_cannot_take(grad_weight, g, x, match):
    with pytest.raises(ValueError, match=match):
        weight_grad_gemm(grad_weight, g, x, first=True)


def _geometry(rows: int, **options) -> Geometry:
    return Geometry.for_problem(Problem(8192, 5376, 262144, "bfloat16"), rows, **options)


@pytest.mark.parametrize(
    "geometry, family, master, want",
    [
        (_geometry(256), "H100", None, "gluon"),
        (_geometry(384), "H100", None, "gluon"),
        (_geometry(512), "H100", None, "gluon_in_memory"),  # past the reading rows: added in memory
        (_geometry(1024), "H100", None, "cublas"),  # past the rule's rows
        (_geometry(256), "H200", None, "cublas"),  # not measured there
        (_geometry(8192), "H100", None, "cublas"),  # one chunk: the first chunk's GEMM only
        (_geometry(256, accum_dtype="float32"), "H100", None, "cublas"),  # an fp32 accumulator
        (_geometry(256), "H100", "float32", "cublas"),  # an fp32 master weight's gradient
        (_geometry(256).with_filter(2**-13), "H100", None, "cublas"),  # the filter's own kernel
    ],
)
def test_the_planned_gemm(geometry, family, master, want, monkeypatch):
    monkeypatch.delenv(WEIGHT_GRAD_GEMM_ENV_VAR, raising=False)
    assert planned_weight_grad_gemm(geometry, family, master) == want


def test_the_planned_gemm_of_vocab_tiles_and_fp32_problems_is_cublas(monkeypatch):
    monkeypatch.delenv(WEIGHT_GRAD_GEMM_ENV_VAR, raising=False)
    tiled = Geometry.for_problem(Problem(8192, 5376, 262144, "bfloat16"), 256, vocab_chunk=65536)
    fp32 = Geometry.for_problem(Problem(8192, 5376, 262144, "float32"), 256)
    assert planned_weight_grad_gemm(tiled, "H100") == planned_weight_grad_gemm(fp32, "H100") == "cublas"


@pytest.mark.parametrize(
    "rows, said", [(256, "that reads it while the GEMM runs"), (512, "in memory (a Gluon kernel"), (1024, None)]
)
def test_explain_says_where_the_gluon_kernel_runs(rows, said, monkeypatch):
    monkeypatch.delenv(WEIGHT_GRAD_GEMM_ENV_VAR, raising=False)
    device = DeviceInfo(
        name="NVIDIA H100 80GB HBM3", family="H100", total_memory_bytes=80 * 2**30, compute_capability=(9, 0),
        source="override",
    )  # fmt: skip
    text = FLCEPolicy(default=FixedChunkSize(rows)).explain(Problem(8192, 5376, 262144, "bfloat16"), device)
    w_grad = next(line for line in text.splitlines() if line.startswith("W grad:"))
    if said is None:
        assert "Gluon" not in w_grad
    else:
        assert said in w_grad


@pytest.mark.parametrize(
    "rows, first, dtype, setting, reduce_available, launched",
    [
        (384, False, torch.bfloat16, "auto", True, "read"),
        (1, False, torch.bfloat16, "auto", True, "read"),
        (385, False, torch.bfloat16, "auto", True, "in memory"),  # past the reading rows
        (640, False, torch.bfloat16, "auto", True, "in memory"),
        (512, False, torch.bfloat16, "auto", False, None),  # no bulk reduce in this Triton: cuBLAS
        (641, False, torch.bfloat16, "auto", True, None),  # past the rule's rows
        (384, True, torch.bfloat16, "auto", True, None),  # the first chunk
        (384, False, torch.float32, "auto", True, None),  # not bf16
        (384, False, torch.bfloat16, "cublas", True, None),  # pinned
        (4096, False, torch.bfloat16, "reduce", True, "in memory"),  # pinned, any rows
    ],
)
def test_the_driver_s_call_routes_by_the_rule(rows, first, dtype, setting, reduce_available, launched, monkeypatch):
    """On a GPU the rule names (a stand-in here: the kernel's launch recorded, not run), the Gluon kernel only where
    the rule and the tensors allow, reading the old block or adding in memory as it says; cuBLAS's path otherwise,
    with the product written."""
    from flce_policy.kernels import weight_grad_gemm as module

    monkeypatch.setenv(WEIGHT_GRAD_GEMM_ENV_VAR, setting)
    monkeypatch.setattr(module, "_gluon_family", lambda device: "H100")
    monkeypatch.setattr(module, "reduce_add_available", lambda: reduce_available)
    calls = []
    record = lambda *args, add_in_memory, **kwargs: calls.append("in memory" if add_in_memory else "read")  # noqa: E731
    monkeypatch.setattr(module, "launch_weight_grad_gemm", record)
    g, x = torch.ones(rows, 16, dtype=dtype), torch.ones(rows, 8, dtype=dtype)
    out = torch.zeros(16, 8, dtype=dtype)
    module.accumulate_weight_grad(out, g, x, first=first)
    assert calls == ([] if launched is None else [launched])
    if launched is None:
        want = torch.full((16, 8), float(rows), dtype=torch.float64)
        torch.testing.assert_close(out.double(), want, rtol=2**-8, atol=0)  # bf16 holds 385 as 384
