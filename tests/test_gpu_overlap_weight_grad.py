"""GPU (marker ``gpu``): grad_weight's GEMM on a second CUDA stream (``Geometry.overlap_weight_grad``) gives the
serial run's results bit for bit, queues that work on the side stream, and is captured into CUDA graphs.

Bit for bit: the same kernels and cuBLAS calls on the same GPU, only on two streams. PyTorch gives each stream its
own cuBLAS workspace of the same size, and cuBLAS picks its algorithm from the problem and the device, not the
stream, so the side stream's GEMMs are the serial run's. Skipped without CUDA; run with
``TRITON_INTERPRET=0 python -m pytest tests/test_gpu_overlap_weight_grad.py -m gpu -s``. No timing here: the
benchmark rows ``ours_overlap_chunk{N}_bf16`` measure it (benchmarks/run_gpu_suite.sh overlap).
"""

from __future__ import annotations

import pytest
import torch
from _compiled_gpu import fresh_dynamo, replayed  # noqa: F401 (fresh_dynamo: an autouse fixture)

from flce_policy import fused_linear_cross_entropy
from flce_policy.kernels import driver, side_stream
from flce_policy.kernels.driver import CEParams, GradRequest, run_geometry
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPE = (2048, 1024, 32768)  # BT, H, V
CHUNK = 512  # 4 chunks: grad_weight read-modify-written by three of them
PROBLEM = Problem(*SHAPE, dtype="bfloat16")


def _inputs(bias: bool = False, seed: int = 0):
    tokens, hidden, vocab = SHAPE
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * (4.0 / hidden**0.5)).to(torch.bfloat16)
    y = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    y[torch.rand(tokens, device="cuda", generator=g) < 0.05] = -100
    b = torch.randn(vocab, device="cuda", generator=g).to(torch.bfloat16) if bias else None
    return x, w, y, b


def _step(fn, x, w, y, b, reduction="mean"):
    """The loss and the gradients of every leaf, from one forward and backward."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    loss = fn(*leaves[:2], y, leaves[2] if b is not None else None, reduction)
    grad_output = None if reduction == "mean" else torch.linspace(-1.0, 2.0, x.shape[0], device="cuda")
    loss.backward(grad_output)
    return [loss.detach().clone(), *(t.grad for t in leaves)]


def _loss_at(geometry: Geometry):
    def loss(x, w, y, b, reduction):
        return fused_linear_cross_entropy(x, w, y, b, policy=geometry, reduction=reduction)

    return loss


@pytest.mark.parametrize("reduction", ["mean", "none"])  # none: the gradients from backward's second run
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("accum_dtype", [None, "float32"], ids=["accum_bf16", "accum_fp32"])
def test_overlapped_equals_serial_bit_for_bit(accum_dtype, bias, reduction):
    serial = Geometry.for_problem(PROBLEM, CHUNK, accum_dtype=accum_dtype)
    overlapped = serial.with_overlap_weight_grad()
    x, w, y, b = _inputs(bias)
    want = _step(_loss_at(serial), x, w, y, b, reduction)
    got = _step(_loss_at(overlapped), x, w, y, b, reduction)
    for name, g, e in zip(("loss", "grad_input", "grad_weight", "grad_bias"), got, want, strict=False):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        assert torch.equal(g, e), f"{name}: max |diff| {(g.float() - e.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("overlap", [False, True])
def test_grad_weight_work_runs_on_the_side_stream_only_when_asked(overlap, monkeypatch):
    """Where each chunk's grad_weight GEMM is queued; the caller's stream is current again after the call."""
    queued_on: list[torch.cuda.Stream] = []
    real_mm = driver.accumulate_weight_grad

    def spy(*args, **kwargs):
        queued_on.append(torch.cuda.current_stream())
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(driver, "accumulate_weight_grad", spy)
    x, w, y, b = _inputs(bias=True)
    main = torch.cuda.current_stream()
    geometry = Geometry.for_problem(PROBLEM, CHUNK, overlap_weight_grad=overlap)
    _step(_loss_at(geometry), x, w, y, b)
    assert len(queued_on) == geometry.num_chunks
    side = side_stream._side_stream(torch.cuda.current_device()) if overlap else main
    assert all(s == side for s in queued_on) and (side != main) == overlap
    assert torch.cuda.current_stream() == main


def test_driver_captured_in_a_cuda_graph_replays_the_eager_result():
    """The fork and join (events only, no host sync) inside ``torch.cuda.graph``: a replay gives the eager call's
    outputs bit for bit."""
    x, w, y, _ = _inputs()
    geometry = Geometry.for_problem(PROBLEM, CHUNK, overlap_weight_grad=True)
    grad_scale = torch.tensor([1.0 / x.shape[0], 0.0], device="cuda")
    args = (x, w, None, y, geometry, CEParams(), GradRequest(input=True, weight=True))
    want = run_geometry(*args, grad_scale=grad_scale)  # also the warm-up: kernels compiled, the side stream made
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_geometry(*args, grad_scale=grad_scale)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    for name in ("loss_rows", "grad_input", "grad_weight"):
        assert torch.equal(getattr(out, name), getattr(want, name)), name


def test_reduce_overhead_equals_eager_without_a_host_sync():
    """torch.compile's CUDA graphs (the loss's capturable path) around the overlapped call."""
    from torch._dynamo.utils import counters

    x, w, y, _ = _inputs()
    geometry = Geometry.for_problem(PROBLEM, CHUNK, overlap_weight_grad=True)
    eager = _loss_at(geometry)
    want = _step(eager, x, w, y, None)
    compiled = torch.compile(eager, fullgraph=True, mode="reduce-overhead")
    counters.clear()
    for got in replayed(lambda: _step(compiled, x, w, y, None)):
        for g, e in zip(got, want, strict=True):
            # inductor compiles the code around the op (tests/test_gpu_compile.py's tolerance)
            torch.testing.assert_close(g.float(), e.float(), rtol=1e-5, atol=1e-6)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
