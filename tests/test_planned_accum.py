"""The grad_weight accumulator a strategy plans travels in the geometry, and the loss follows it.

A ``Fastest(accum="fp32")`` policy whose pick has several row chunks must give fp32-accumulated
weight gradients without the caller also passing ``accum_dtype``: checked against a float64 torch
reference (explicit logits, autograd), where bf16 accumulation over the same chunks is measurably
worse. A call asking for another accumulator than the planned one is an error.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from flce_policy import FLCEPolicy, Geometry, Problem, fused_linear_cross_entropy
from flce_policy.engine.probe import device_for_tensor_device
from flce_policy.kernels.driver import inject_oom, observe_chunks
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.memory import predict_peak
from flce_policy.strategies import Fastest, FixedChunkSize, FreeMemory, HeuristicC, strategy_from_config

H200 = DeviceInfo.synthetic("H200")
BT, H, V = 128, 32, 512
CHUNK = 4  # 32 row chunks: enough bf16 roundings of the running grad_weight to show


class FixedChunkSizeFp32(FixedChunkSize):
    """A user's strategy that plans fp32 accumulation (the base-class hook, nothing else)."""

    def planned_accum_dtype(self) -> str | None:
        return "float32"


def make_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BT, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64) * (3 / H**0.5)
    y = torch.randint(0, V, (BT,), generator=gen)
    return x, w, y


def reference_grad_weight(x, w, y):
    wr = w.clone().requires_grad_()
    F.cross_entropy(x @ wr.t(), y).backward()
    return wr.grad


def bf16_grad_weight(x, w, y, **loss_kwargs):
    xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    fused_linear_cross_entropy(xb, wb, y, **loss_kwargs).backward()
    return wb.grad


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


# --- the geometry carries it ---------------------------------------------------------------------


def test_geometry_accum_dtype_is_normalised_validated_and_described():
    problem = Problem(1000, 64, 5000)
    for spelling in ("float32", "fp32", torch.float32):
        assert Geometry.for_problem(problem, 256, accum_dtype=spelling).accum_dtype == "float32"
    assert Geometry.for_problem(problem, 256).accum_dtype is None
    with pytest.raises(ValueError, match="accum_dtype"):
        Geometry.for_problem(problem, 256, accum_dtype="int8")
    assert "grad_weight accumulated in float32" in Geometry.for_problem(problem, 256, accum_dtype="fp32").describe()
    assert "accumulated" not in Geometry.for_problem(problem, 256).describe()


@pytest.mark.parametrize(
    ("chunk", "vocab_chunk", "accum", "itemsize"),
    [
        (256, None, "float32", 4),  # 4 row chunks add into grad_weight: the fp32 buffer
        (256, None, None, 2),
        (1000, None, "float32", 2),  # one chunk: one GEMM writes each element, fp32 inside
        (1000, 1024, "float32", 2),  # one row chunk of vocab tiles: each slice written once
        (500, 1024, "float32", 4),
    ],
)
def test_only_a_geometry_that_adds_into_grad_weight_gets_a_wider_buffer(chunk, vocab_chunk, accum, itemsize):
    geometry = Geometry.for_problem(Problem(1000, 64, 5000), chunk, vocab_chunk=vocab_chunk, accum_dtype=accum)
    assert geometry.accum_itemsize() == itemsize
    bf16 = predict_peak(geometry.model_copy(update={"accum_dtype": None})).total_bytes
    # the buffer is 5000 x 64 x 2 bytes wider, and its cast to bf16 after the loop needs both copies
    assert predict_peak(geometry).total_bytes > bf16 if itemsize == 4 else predict_peak(geometry).total_bytes == bf16


# --- strategies plan it --------------------------------------------------------------------------


def test_fastest_fp32_pick_with_several_row_chunks_plans_the_fp32_accumulator():
    # 32k x 5376 x 262144 under a 256 MiB slab: the cost model's pick has 2 row chunks (issue 6)
    geometry = Fastest(max_slab="256MiB", accum="fp32").geometry(Problem(32768, 5376, 262144), H200)
    assert geometry.num_chunks > 1 and geometry.accum_dtype == "float32"
    assert Fastest(max_slab="256MiB").geometry(Problem(32768, 5376, 262144), H200).accum_dtype is None
    assert {g.accum_dtype for g in Fastest(max_slab="256MiB", accum="fp32").candidates(Problem(8192, 64, 4096))} == {
        "float32"
    }


def test_free_memory_plans_its_accumulator_also_under_a_cap(monkeypatch):
    from flce_policy.plan import memory_now

    monkeypatch.setattr(memory_now, "available_bytes", lambda device: 80 * 2**30)
    problem = Problem(8192, 5376, 262144)
    uncapped = FreeMemory(accum_dtype="float32").geometry(problem, H200)
    capped = FreeMemory(accum_dtype="float32", cap=HeuristicC(1)).geometry(problem, H200)
    assert uncapped.accum_dtype == capped.accum_dtype == "float32"
    assert capped.chunk_size == HeuristicC(1).geometry(problem, H200).chunk_size == 256
    assert FreeMemory().geometry(problem, H200).accum_dtype is None


def test_a_yaml_policy_of_fastest_fp32_resolves_to_an_fp32_geometry():
    policy = FLCEPolicy(default=strategy_from_config({"strategy": "fastest", "max_slab": "256MiB", "accum": "fp32"}))
    geometry = policy.resolve(Problem(32768, 5376, 262144), H200)
    assert geometry.accum_dtype == "float32"
    explained = policy.explain_dict(Problem(32768, 5376, 262144), H200)
    assert explained["accum_dtype"] == "float32" and explained["weight_grad_low_precision_steps"] == 1
    assert explained["predicted_peak_bytes"] == predict_peak(geometry, accum_dtype="float32").total_bytes


# --- the loss follows it -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def told():
    """grad_weight with the fp32 accumulator asked for by name, chunks of CHUNK: what a plan must give."""
    x, w, y = make_inputs()
    return bf16_grad_weight(x, w, y, policy=FixedChunkSize(CHUNK), accum_dtype=torch.float32)


#: the tests that compare with ``told`` run on one pytest-xdist worker, which computes it once
TOLD = pytest.mark.xdist_group("planned_accum_told")


@TOLD
def test_the_loss_accumulates_as_planned_without_being_told(told):
    x, w, y = make_inputs()
    want = reference_grad_weight(x, w, y)
    planned = bf16_grad_weight(x, w, y, policy=FixedChunkSizeFp32(CHUNK))
    bf16_running_sum = bf16_grad_weight(x, w, y, policy=FixedChunkSize(CHUNK))
    one_chunk = bf16_grad_weight(x, w, y, policy=FixedChunkSize(BT))
    assert torch.equal(planned, told)
    # fp32 accumulation rounds each element once, as one chunk does; 32 bf16 roundings are worse
    assert rel(planned, want) <= 1.02 * rel(one_chunk, want)
    assert rel(bf16_running_sum, want) > 1.2 * rel(planned, want)


def test_a_call_asking_for_another_accumulator_than_planned_is_an_error():
    x, w, y = make_inputs()
    with pytest.raises(ValueError, match=r"accum_dtype=torch.bfloat16 conflicts .* planned .* torch.float32"):
        bf16_grad_weight(x, w, y, policy=FixedChunkSizeFp32(CHUNK), accum_dtype=torch.bfloat16)
    # asking for the planned one is fine
    bf16_grad_weight(x, w, y, policy=FixedChunkSizeFp32(BT), accum_dtype=torch.float32)


@TOLD
def test_a_geometry_given_as_the_policy_carries_its_accumulator(told):
    x, w, y = make_inputs()
    geometry = Geometry.for_problem(Problem(BT, H, V, torch.bfloat16), CHUNK, accum_dtype="float32")
    with observe_chunks() as events:
        planned = bf16_grad_weight(x, w, y, policy=geometry)
    assert len(events) == BT // CHUNK
    assert torch.equal(planned, told)


def test_the_oom_fallback_keeps_the_planned_accumulator():
    x, w, y = make_inputs()
    policy = FLCEPolicy(default=FixedChunkSizeFp32(16), min_chunk_size=1)
    with warnings.catch_warnings(), inject_oom(above_rows=8) as faults:
        warnings.simplefilter("ignore")
        got = bf16_grad_weight(x, w, y, policy=policy)
    assert faults == [(16, 0)]
    remembered = policy.resolve(Problem(BT, H, V, torch.bfloat16), device_for_tensor_device(x.device))
    assert (remembered.chunk_size, remembered.accum_dtype) == (8, "float32")
    assert torch.equal(got, bf16_grad_weight(x, w, y, policy=FixedChunkSize(8), accum_dtype=torch.float32))
