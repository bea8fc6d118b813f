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
    gluon_weight_grad_rows,
    planned_weight_grad_gemm,
)
from flce_policy.strategies import FixedChunkSize


@pytest.mark.parametrize("family, first, want", [("H100", False, 384), ("H100", True, 0), ("H200", False, 0),
                                                 ("A100", True, 0), ("unknown", False, 0)])  # fmt: skip
def test_rows_by_gpu_and_chunk(family, first, want, monkeypatch):
    monkeypatch.delenv(WEIGHT_GRAD_GEMM_ENV_VAR, raising=False)
    assert gluon_weight_grad_rows(family, first=first) == want


@pytest.mark.parametrize(
    "value, want", [("cublas", 0), (" CUBLAS ", 0), ("auto", 384), ("", 384), ("reduce", 2**31 - 1)]
)
def test_the_setting_pins_cublas(value, want, monkeypatch):
    monkeypatch.setenv(WEIGHT_GRAD_GEMM_ENV_VAR, value)
    assert gluon_weight_grad_rows("H100", first=False) == want


@pytest.mark.parametrize("family, want", [("H100", 2**31 - 1), ("H200", 2**31 - 1), ("GH200", 2**31 - 1),
                                          ("A100", 0), ("B200", 0), ("unknown", 0)])  # fmt: skip
def test_reduce_pins_the_kernel_at_any_rows_on_hopper_only(family, want, monkeypatch):
    monkeypatch.setenv(WEIGHT_GRAD_GEMM_ENV_VAR, "reduce")
    assert gluon_weight_grad_rows(family, first=False) == want
    assert gluon_weight_grad_rows(family, first=True) == 0  # the first chunk has nothing to add to


def test_a_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(WEIGHT_GRAD_GEMM_ENV_VAR, "gluon-always")
    with pytest.raises(
        ValueError, match=f"{WEIGHT_GRAD_GEMM_ENV_VAR}='gluon-always': expected one of auto, cublas, reduce"
    ):
        gluon_weight_grad_rows("H100", first=False)


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
        (_geometry(512), "H100", None, "cublas"),  # past the rule's rows
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


@pytest.mark.parametrize("rows, said", [(256, True), (1024, False)])
def test_explain_says_where_the_gluon_kernel_runs(rows, said, monkeypatch):
    monkeypatch.delenv(WEIGHT_GRAD_GEMM_ENV_VAR, raising=False)
    device = DeviceInfo(
        name="NVIDIA H100 80GB HBM3", family="H100", total_memory_bytes=80 * 2**30, compute_capability=(9, 0),
        source="override",
    )  # fmt: skip
    text = FLCEPolicy(default=FixedChunkSize(rows)).explain(Problem(8192, 5376, 262144, "bfloat16"), device)
    w_grad = next(line for line in text.splitlines() if line.startswith("W grad:"))
    assert ("on the Gluon kernel" in w_grad) == said


@pytest.mark.parametrize(
    "rows, first, dtype, setting, launched",
    [
        (384, False, torch.bfloat16, "auto", True),
        (1, False, torch.bfloat16, "auto", True),
        (385, False, torch.bfloat16, "auto", False),  # past the rule's rows
        (384, True, torch.bfloat16, "auto", False),  # the first chunk
        (384, False, torch.float32, "auto", False),  # not bf16
        (384, False, torch.bfloat16, "cublas", False),  # pinned
    ],
)
def test_the_driver_s_call_routes_by_the_rule(rows, first, dtype, setting, launched, monkeypatch):
    """On a GPU the rule names (a stand-in here: the kernel's launch recorded, not run), the Gluon kernel only where
    the rule and the tensors allow; cuBLAS's path otherwise, with the product written."""
    from flce_policy.kernels import weight_grad_gemm as module

    monkeypatch.setenv(WEIGHT_GRAD_GEMM_ENV_VAR, setting)
    monkeypatch.setattr(module, "_gluon_family", lambda device: "H100")
    calls = []
    monkeypatch.setattr(module, "launch_weight_grad_gemm", lambda *args, **kwargs: calls.append(args))
    g, x = torch.ones(rows, 16, dtype=dtype), torch.ones(rows, 8, dtype=dtype)
    out = torch.zeros(16, 8, dtype=dtype)
    module.accumulate_weight_grad(out, g, x, first=first)
    assert bool(calls) == launched
    if not launched:
        want = torch.full((16, 8), float(rows), dtype=torch.float64)
        torch.testing.assert_close(out.double(), want, rtol=2**-8, atol=0)  # bf16 holds 385 as 384
