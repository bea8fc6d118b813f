"""The GPU-only development benchmarks' setup on CPU: chunk_gemm_bound, compile_bench, profile_chunks, quick and
tune_ce_kernel.

Their timing (CUDA events, the CUDA profiler, ``triton.testing.do_bench``) needs a GPU; what they time is
built here at small shapes and run once under the Triton interpreter, so that a change to what they
call breaks a test, not the next GPU run. tune_ce_kernel's call is checked against plain torch.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from flce_policy.benchmarks import chunk_gemm_bound, compile_bench, profile_chunks, quick, suite, tune_ce_kernel
from flce_policy.benchmarks.measure import Measurement
from flce_policy.benchmarks.methods import make_inputs
from flce_policy.kernels import ce_kernel

SHAPE = (64, 32, 256)  # BT, H, V


def test_chunk_gemm_bound_times_every_schedule_at_each_chunk(monkeypatch, capsys):
    calls = []

    def run_once(step, **timing):
        calls.append(timing)
        step()
        return Measurement((1.0,), 0)

    monkeypatch.setattr(chunk_gemm_bound, "make_inputs", functools.partial(make_inputs, device="cpu"))
    monkeypatch.setattr(chunk_gemm_bound, "measure", run_once)
    chunk_gemm_bound.main(["64x32x256", "16", "24", "--split-k", "2", "--stagger", "3", "--sustained", "0.5"])
    rows = [line.split(":")[0].strip() for line in capsys.readouterr().out.splitlines()[1:]]
    labels = ["serial", "overlap", "split_k2", "split_k2+overlap", "stagger3", "stagger3+ring"]
    assert [row.split(" (")[0] for row in rows] == [f"{c} rows, {label}" for c in (16, 24) for label in labels]
    assert "16 rows, stagger3 (K 48 rows, a kernel holding 0 MiB of logits)" in rows
    assert calls == [{"busy_start": False, "sustained_s": 0.5}] * (1 + len(rows))  # the floor first


def test_compile_bench_builds_every_form_and_each_runs(monkeypatch):
    pytest.importorskip("transformers")
    # Inductor's CPU build of each compiled form would cost tens of seconds on a 2-core machine, and its compile
    # of the loss is tests/test_compile.py's: here Dynamo traces each form (fullgraph) into aot_eager instead.
    real_compile = torch.compile

    def traced(fn, *, mode=None, **options):
        return real_compile(fn, backend="aot_eager", **options)

    monkeypatch.setattr(torch, "compile", traced)
    torch._dynamo.reset()
    inputs = make_inputs(*SHAPE, logit_std=4.0, device="cpu")
    forms = {
        **compile_bench.loss_steps(inputs),
        **compile_bench.touch_steps(inputs),
        **compile_bench.hf_steps(*SHAPE, device="cpu"),
    }
    assert set(forms) == {
        "eager", "compiled", "reduce_overhead", "scaled_eager", "scaled_compiled",
        "trivial_eager", "trivial_compiled", "hf_eager", "hf_compiled",
    }  # fmt: skip
    try:
        for step in forms.values():
            step()
    finally:
        torch._dynamo.reset()


def test_profile_chunks_builds_ours_at_each_chunk_size_and_each_runs():
    steps = profile_chunks.profiled_steps(SHAPE, [16, 64], device="cpu")
    ours = [label for label in steps if label.startswith("ours")]
    assert ours == ["ours chunk 16", "ours chunk 64"]
    for label in ours:  # a peer's rows need its CUDA kernels
        steps[label]()


def test_profile_chunks_pins_each_form_asked_and_times_the_floor_first(monkeypatch):
    from flce_policy import fused_linear_cross_entropy

    seen = []

    def recording(x, weight, target, *, policy=None, **options):
        seen.append(getattr(policy, "default_slab_form", None))
        return fused_linear_cross_entropy(x, weight, target, policy=policy, **options)

    monkeypatch.setattr("flce_policy.fused_linear_cross_entropy", recording)
    args = profile_chunks.build_parser().parse_args(["64x32x256", "16", "--slab-forms", "logits", "scaled_exp_rows"])
    steps = profile_chunks.profiled_steps(args.shape, args.chunks, device="cpu", slab_forms=args.slab_forms, floor=True)
    labels = [label for label in steps if not label.startswith("liger")]
    assert labels == ["floor (three cuBLAS GEMMs)", "ours chunk 16 logits", "ours chunk 16 scaled_exp_rows"]
    for label in labels[1:]:
        steps[label]()
    assert seen == ["logits", "scaled_exp_rows"]  # each step's policy pins its form
    with pytest.raises(SystemExit):
        profile_chunks.build_parser().parse_args(["64x32x256", "16", "--slab-forms", "no_such_form"])


def test_quick_measures_the_named_rows_at_the_shape_given(monkeypatch, capsys):
    def run_once(step, **_):
        step()
        return Measurement((1.0,), 0)

    monkeypatch.setattr(suite, "make_inputs", functools.partial(make_inputs, device="cpu"))
    monkeypatch.setattr(suite, "measure", run_once)
    quick.main(
        ["gemm_floor,ours_default_bf16,ours_chunk256_bf16,ours_overlap_chunk256_bf16", "x".join(map(str, SHAPE))]
    )
    table = [line.split() for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("64x32x256")]
    assert [(row[1], row[-1]) for row in table] == [
        ("gemm_floor", "ok"),
        ("ours_default_bf16", "ok"),
        ("ours_chunk256_bf16", "ok"),
        ("ours_overlap_chunk256_bf16", "ok"),
    ]


@pytest.mark.parametrize(("block", "warps", "programs"), [(256, 4, 8), (1024, 8, 2048)])
def test_tune_ce_kernel_variant_gives_torch_s_loss_and_gradient(block, warps, programs):
    rows, vocab = 8, 2048
    saved = ce_kernel.MAX_BLOCK_V, ce_kernel.WIDE_BLOCK_WARPS, ce_kernel.TARGET_PROGRAMS
    with tune_ce_kernel.kernel_settings(block, warps, programs):
        call = tune_ce_kernel.slab_call(rows, vocab, device="cpu")
        logits = call.logits.float()
        call.run()
    assert call.workspace.block_v == block  # the variant planned the call
    assert (ce_kernel.MAX_BLOCK_V, ce_kernel.WIDE_BLOCK_WARPS, ce_kernel.TARGET_PROGRAMS) == saved
    torch.testing.assert_close(call.loss, F.cross_entropy(logits, call.target, reduction="none"))
    # the gradient of the summed loss written over the slab (grad scale 1), rounded to bf16
    want = logits.softmax(-1) - F.one_hot(call.target, vocab).float()
    torch.testing.assert_close(call.logits.float(), want, atol=2e-3, rtol=1e-2)
