"""GPU suite (marker ``gpu``): the real probe, and the loss at realistic shapes against fp32 torch.

Run on an H200 with ``bash benchmarks/run_gpu_suite.sh``; skipped without CUDA. Errors are
printed (``-s``) and collected in ``$FLCE_GPU_REPORT`` (JSON lines) when set, for the issue notes.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from gpu_memory import require_gpu_memory
from gpu_reference import (
    chunked_bf16_eager,
    chunked_bf16_eager_bytes,
    chunked_fp32_reference,
    chunked_fp32_reference_bytes,
    make_inputs,
    reference_loss_and_grads,
    reference_loss_and_grads_bytes,
    rel_l2,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _report(record: dict) -> None:
    print(json.dumps(record))
    path = os.environ.get("FLCE_GPU_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


@pytest.fixture(autouse=True)
def _fp32_reference_without_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved
    torch.cuda.empty_cache()


def test_probe_sees_this_gpu_through_nvml():
    from flce_policy.engine.probe import probe_device, probe_device_verbose

    info, notes = probe_device_verbose()
    _report({"test": "probe", **info.model_dump(), "notes": notes})
    props = torch.cuda.get_device_properties(0)
    assert info.source == "nvml"
    assert info.family != "unknown" and info.family in props.name
    # NVML and torch agree on the card's memory within 1% (they count slightly differently)
    assert abs(info.total_memory_bytes - props.total_memory) / props.total_memory < 0.01
    assert probe_device(0) == probe_device()


def _ours(x, w, y, policy, **kw):
    from flce_policy import fused_linear_cross_entropy

    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    loss = fused_linear_cross_entropy(xr, wr, y, policy=policy, **kw)
    loss.backward()
    return loss.detach(), xr.grad, wr.grad


def _liger(x, w, y, chunk_mem_const=1, accum_dtype=None):
    liger = pytest.importorskip("liger_kernel.transformers.functional")
    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    loss = liger.liger_fused_linear_cross_entropy(xr, wr, y, chunk_mem_const=chunk_mem_const, accum_dtype=accum_dtype)
    loss.backward()
    return loss.detach(), xr.grad, wr.grad


def _errors(name, result, reference):
    loss, gx, gw = result
    rloss, rgx, rgw = reference
    return {
        "method": name,
        "loss_rel": abs(float(loss) - float(rloss)) / abs(float(rloss)),
        "grad_input_rel_l2": rel_l2(gx, rgx),
        "grad_weight_rel_l2": rel_l2(gw, rgw),
    }


@pytest.mark.parametrize(
    "shape",
    [(4096, 1024, 32768), (8192, 4096, 128256), (8192, 5376, 262144)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_bf16_matches_fp32_reference_as_well_as_eager(shape):
    from flce_policy import FLCEPolicy, Geometry, Problem
    from flce_policy.strategies import FixedChunkSize

    tokens, hidden, vocab = shape
    # the bf16 inputs, the fp32 reference's gradients kept, and a whole-logits reference call beside them
    inputs, kept = (tokens + vocab) * hidden * 2, (tokens + vocab) * hidden * 4
    require_gpu_memory(
        inputs + kept + reference_loss_and_grads_bytes(*shape), "[BT, V] fp32 logits and their gradients, 3 at once"
    )
    x, w, y = make_inputs(tokens, hidden, vocab, torch.bfloat16)
    reference = reference_loss_and_grads(x, w, y, compute_dtype=torch.float32)
    rows = [_errors("eager_bf16", reference_loss_and_grads(x, w, y, compute_dtype=torch.bfloat16), reference)]
    vocab_tiled = Geometry.for_problem(Problem(tokens, hidden, vocab), tokens, vocab_chunk=min(8192, vocab))
    runs = {
        "ours_default_policy": dict(policy=FLCEPolicy.default()),
        "ours_vocab_tiled_one_row_chunk": dict(policy=vocab_tiled),
        "ours_chunk256": dict(policy=FixedChunkSize(256)),
        "ours_one_chunk": dict(policy=FixedChunkSize(tokens)),
        "ours_chunk256_fp32acc": dict(policy=FixedChunkSize(256), accum_dtype=torch.float32),
    }
    for name, kwargs in runs.items():
        rows.append(_errors(name, _ours(x, w, y, **kwargs), reference))
    try:
        rows.append(_errors("liger_c1", _liger(x, w, y), reference))
    except pytest.skip.Exception:
        pass
    for row in rows:
        _report({"test": "bf16_accuracy", "shape": shape, **row})
    eager = rows[0]
    by_name = {row["method"]: row for row in rows}
    for name in runs:
        row = by_name[name]
        assert row["loss_rel"] <= max(1.1 * eager["loss_rel"], 1e-5), row
        assert row["grad_input_rel_l2"] <= 1.1 * eager["grad_input_rel_l2"], row
    # One chunk, fp32 accumulation and vocab tiles over one row chunk round grad_weight once, as
    # eager does: held to 1.1x.
    for name in ("ours_one_chunk", "ours_chunk256_fp32acc", "ours_vocab_tiled_one_row_chunk"):
        assert by_name[name]["grad_weight_rel_l2"] <= 1.1 * eager["grad_weight_rel_l2"], by_name[name]


def test_fp32_inputs_match_reference():
    from flce_policy.strategies import FixedChunkSize

    x, w, y = make_inputs(2048, 1024, 32768, torch.float32)
    reference = reference_loss_and_grads(x, w, y, compute_dtype=torch.float32)
    row = _errors("ours_fp32_chunk512", _ours(x, w, y, FixedChunkSize(512)), reference)
    _report({"test": "fp32_accuracy", "shape": [2048, 1024, 32768], **row})
    assert row["loss_rel"] < 1e-5
    assert row["grad_input_rel_l2"] < 1e-4 and row["grad_weight_rel_l2"] < 1e-4


def test_slab_of_more_than_2_pow_31_elements():
    """8200 rows in chunks of 8192 at V=262144: the slab holds 2**31 elements, offsets pass int32."""
    from flce_policy.strategies import FixedChunkSize

    tokens, hidden, vocab = 8200, 256, 262144
    inputs, kept = (tokens + vocab) * hidden * 2, (tokens + vocab) * hidden * 4
    require_gpu_memory(
        inputs + kept + reference_loss_and_grads_bytes(tokens, hidden, vocab),
        "[BT, V] fp32 logits and their gradients, 3 at once",
    )
    x, w, y = make_inputs(tokens, hidden, vocab, torch.bfloat16, seed=1)
    y[-3:] = vocab - 1  # targets at the very end of the last rows of the big chunk and the tail
    y[8189] = vocab - 2
    reference = reference_loss_and_grads(x, w, y, compute_dtype=torch.float32)
    eager = _errors("eager_bf16", reference_loss_and_grads(x, w, y, compute_dtype=torch.bfloat16), reference)
    ours = _errors("ours_chunk8192", _ours(x, w, y, FixedChunkSize(8192), accum_dtype=torch.float32), reference)
    _report({"test": "int64_offsets", "shape": [tokens, hidden, vocab], "eager": eager, "ours": ours})
    assert ours["loss_rel"] <= max(1.1 * eager["loss_rel"], 1e-5)
    assert ours["grad_input_rel_l2"] <= 1.1 * eager["grad_input_rel_l2"]
    assert ours["grad_weight_rel_l2"] <= 1.1 * eager["grad_weight_rel_l2"]


def test_options_on_gpu_match_reference():
    """Softcap + z-loss + label smoothing + class weights + bias, reduction none, in fp32 on the GPU."""
    import torch.nn.functional as F

    from flce_policy import fused_linear_cross_entropy
    from flce_policy.strategies import FixedChunkSize

    x, w, y = make_inputs(1000, 512, 50000, torch.float32, seed=2)
    b = torch.randn(50000, device="cuda") * 0.1
    cw = torch.rand(50000, device="cuda") + 0.5
    g = torch.randn(1000, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss = fused_linear_cross_entropy(
        *leaves[:2],
        y,
        leaves[2],
        policy=FixedChunkSize(128),
        reduction="none",
        softcap=30.0,
        z_loss_scale=1e-4,
        label_smoothing=0.1,
        class_weight=cw,
    )
    grads = torch.autograd.grad(loss, leaves, g)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    logits = ref_leaves[0] @ ref_leaves[1].t() + ref_leaves[2]
    logits = 30.0 * torch.tanh(logits / 30.0)
    ref = F.cross_entropy(logits, y, weight=cw, reduction="none", label_smoothing=0.1)
    ref = ref + 1e-4 * torch.logsumexp(logits, -1) ** 2 * (y != -100)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g)
    assert rel_l2(loss, ref) < 1e-5
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_l2(got, want) < 1e-4


def _ours_measured(x, w, y, policy, **kw):
    """Our fwd+bwd with its peak over the inputs (the leaves allocated before the count starts)."""
    from flce_policy import fused_linear_cross_entropy

    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(xr, wr, y, policy=policy, **kw)
    loss.backward()
    torch.cuda.synchronize()
    return (loss.detach(), xr.grad, wr.grad), torch.cuda.max_memory_allocated() - before


def test_vocab_tiled_at_32k_is_fp32_accurate_in_the_memory_of_bf16_gradients():
    """32768x5376x262144 bf16: the lean Fastest pick (256 MiB slab, fp32-accurate, peak limit) and
    4096-column tiles (7 late tiles computed again) against the chunked fp32 reference and eager.
    Also a policy of ``Fastest(max_slab="256MiB", accum="fp32")`` (its pick has 2 row chunks) with
    no accum_dtype passed: the loss must follow the planned fp32 accumulator (peak as predicted).
    Eager's bf16 call runs by row blocks (``chunked_bf16_eager``, its roundings): whole, its [BT, V] fp32
    logits are 32 GiB and it holds three such at once, more than an 80 GB card."""
    from flce_policy import DeviceInfo, FLCEPolicy, Geometry, Problem
    from flce_policy.benchmarks.methods import LEAN_PEAK
    from flce_policy.engine.probe import device_for_tensor_device
    from flce_policy.plan.memory import predict_peak
    from flce_policy.strategies import Fastest

    shape = (32768, 5376, 262144)
    # the bf16 inputs and the fp32 reference's gradients kept, beside the larger of the two references' steps
    inputs, kept = (shape[0] + shape[2]) * shape[1] * 2, (shape[0] + shape[2]) * shape[1] * 4
    references = max(chunked_fp32_reference_bytes(*shape), chunked_bf16_eager_bytes(*shape))
    require_gpu_memory(inputs + kept + references, "the references by blocks of 4096 rows, and fp32 W and its gradient")
    problem = Problem(*shape)
    x, w, y = make_inputs(*shape, torch.bfloat16)
    reference = chunked_fp32_reference(x, w, y)
    eager = _errors("eager_bf16", chunked_bf16_eager(x, w, y), reference)
    torch.cuda.empty_cache()
    lean = Fastest(max_slab="256MiB", accum="fp32", max_peak=LEAN_PEAK).geometry(problem, DeviceInfo.synthetic("H200"))
    runs = {
        "ours_fastest_lean": lean,
        "ours_vtile4096": Geometry.for_problem(problem, shape[0], vocab_chunk=4096),
        "ours_fastest256MiB_fp32_policy": FLCEPolicy(default=Fastest(max_slab="256MiB", accum="fp32")),
    }
    rows = [eager]
    here = device_for_tensor_device(x.device)
    for name, policy in runs.items():
        result, peak = _ours_measured(x, w, y, policy)
        geometry = policy if isinstance(policy, Geometry) else policy.resolve(problem, here)
        predicted = predict_peak(geometry).total_bytes
        rows.append(
            {
                **_errors(name, result, reference),
                "geometry": geometry.describe(),
                "accum_dtype": geometry.accum_dtype,
                "peak_bytes": peak,
                "predicted_peak_bytes": predicted,
            }
        )
        del result
        torch.cuda.empty_cache()
    try:
        rows.append(_errors("liger_c1_fp32", _liger(x, w, y, accum_dtype=torch.float32), reference))
    except pytest.skip.Exception:
        pass
    for row in rows:
        _report({"test": "vocab_tiled_32k", "shape": shape, **row})
    for row in rows[1 : 1 + len(runs)]:
        assert row["loss_rel"] <= max(1.1 * eager["loss_rel"], 1e-5), row
        assert row["grad_input_rel_l2"] <= 1.1 * eager["grad_input_rel_l2"], row
        assert row["grad_weight_rel_l2"] <= 1.1 * eager["grad_weight_rel_l2"], row
        assert abs(row["predicted_peak_bytes"] / row["peak_bytes"] - 1) < 0.03, row


def test_one_chunk_with_fp32_accumulation_allocates_no_fp32_buffer():
    """One row-only chunk: one GEMM writes each grad_weight element, so accum_dtype=float32 must
    cost nothing (same peak as bf16, as predicted) and give the same gradients bit for bit."""
    from flce_policy import Geometry, Problem
    from flce_policy.plan.memory import predict_peak

    shape = (4096, 4096, 65536)
    x, w, y = make_inputs(*shape, torch.bfloat16, seed=3)
    geometry = Geometry.for_problem(Problem(*shape), shape[0])
    plain, plain_peak = _ours_measured(x, w, y, geometry)
    widened, widened_peak = _ours_measured(x, w, y, geometry, accum_dtype=torch.float32)
    predicted = predict_peak(geometry, accum_dtype="float32").total_bytes
    _report(
        {
            "test": "one_chunk_fp32_accum",
            "shape": shape,
            "peak_bytes_bf16": plain_peak,
            "peak_bytes_fp32_accum": widened_peak,
            "predicted_peak_bytes": predicted,
            "fp32_buffer_bytes": shape[1] * shape[2] * 4,
        }
    )
    assert widened_peak == plain_peak
    assert abs(predicted / widened_peak - 1) < 0.03
    for a, b in zip(plain, widened, strict=True):
        assert torch.equal(a, b)


def test_a_scaled_loss_backward_scales_in_place_without_a_host_sync():
    """``(3 * loss).backward()``: the gradients scaled where they lie (no second grad_weight, the
    same peak as ``loss.backward()``), equal to 3x the plain ones within one bf16 rounding."""
    from flce_policy import Geometry, Problem, fused_linear_cross_entropy

    shape = (4096, 4096, 65536)
    x, w, y = make_inputs(*shape, torch.bfloat16, seed=4)
    geometry = Geometry.for_problem(Problem(*shape), 1024)
    plain, plain_peak = _ours_measured(x, w, y, geometry)

    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    (3.0 * fused_linear_cross_entropy(xr, wr, y, policy=geometry)).backward()
    torch.cuda.synchronize()
    scaled_peak = torch.cuda.max_memory_allocated() - before
    _report(
        {
            "test": "scaled_backward",
            "shape": shape,
            "peak_bytes_plain": plain_peak,
            "peak_bytes_scaled": scaled_peak,
            "grad_weight_bytes": shape[1] * shape[2] * 2,
        }
    )
    # (3 * loss) itself is a few bytes; a second grad_weight would be 512 MiB
    assert scaled_peak - plain_peak < 2**20
    for got, base in ((xr.grad, plain[1]), (wr.grad, plain[2])):
        exact = base.double() * 3
        assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-7).all()


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32], ids=["bf16_hidden", "fp32_hidden"])
def test_autocast_over_fp32_master_weight_peaks_as_predicted(hidden_dtype):
    """bf16 autocast, fp32 LM head (HF Trainer bf16=True on an fp32 model): the loss computes in
    bf16, grad_weight comes back fp32 (accumulated in fp32, no bf16 gradient + cast), the peak is
    the memory model's (the bf16 call's + the weight's bf16 copy + the wider gradient), and the
    gradients are as accurate as the bf16 call's."""
    from flce_policy import FLCEPolicy, fused_linear_cross_entropy
    from flce_policy.engine.probe import device_for_tensor_device
    from flce_policy.plan.memory import predict_peak
    from flce_policy.plan.problem import Problem

    shape = (8192, 4096, 131072)
    # the bf16 inputs, the fp32 master weight and its gradient, the hidden states and theirs, then a
    # whole-logits fp32 reference beside them
    tokens, hidden, vocab = shape
    held = (tokens + vocab) * hidden * 2 + 2 * vocab * hidden * 4 + 2 * tokens * hidden * 4
    require_gpu_memory(held + reference_loss_and_grads_bytes(*shape), "[BT, V] fp32 logits and their gradients")
    x, w, y = make_inputs(*shape, torch.bfloat16, seed=5)
    policy = FLCEPolicy.default()
    geometry = policy.resolve(Problem(*shape), device_for_tensor_device(x.device))
    master = w.float().requires_grad_()
    hidden = x.to(hidden_dtype).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, master, y, policy=policy)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    input_dtype = None if hidden_dtype == torch.bfloat16 else "float32"
    predicted = predict_peak(geometry, master_dtype="float32", input_dtype=input_dtype).total_bytes
    ref_loss, ref_gx, ref_gw = reference_loss_and_grads(x, w, y, compute_dtype=torch.float32)
    record = {
        "test": "autocast_fp32_master",
        "hidden_dtype": str(hidden_dtype),
        "shape": shape,
        "geometry": geometry.describe(),
        "peak_bytes": peak,
        "predicted_peak_bytes": predicted,
        "bf16_call_predicted_peak_bytes": predict_peak(geometry).total_bytes,
        "grad_input_rel_l2": rel_l2(hidden.grad, ref_gx),
        "grad_weight_rel_l2": rel_l2(master.grad, ref_gw),
        "loss_rel": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
    }
    _report(record)
    assert master.grad.dtype == torch.float32 and hidden.grad.dtype == hidden_dtype
    assert abs(predicted / peak - 1) < 0.03, record
    assert record["grad_weight_rel_l2"] < 0.01 and record["grad_input_rel_l2"] < 0.01, record
    assert record["loss_rel"] < 1e-3, record
