"""benchmarks/zero3_saturation.py on CPU: the field report's scenario runs its GPU code path at tiny shapes.

The command a user runs (``python -m flce_policy.benchmarks.zero3_saturation OUT --tokens 8192``), on
one gloo rank under the Triton interpreter: the real HF model (a Gemma-4 body under a softcapped,
tied head) patched by ``apply_flce`` and wrapped as on the GPU, every case of the scenario one step
each. Under one-rank DDP always (it needs no DeepSpeed, so CI runs it), and under DeepSpeed ZeRO-3
where DeepSpeed is installed. Each case's loss is checked against HF's own loss of the same model
in fp32 (logits materialised, Gemma's forward applying the softcap). On CPU there is no filler:
the GPU's verdict (which case must run out of memory, the rows the policy must reach) is checked
on made-up results instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from flce_policy.benchmarks import zero3_saturation as z3s  # noqa: E402

#: The run under bf16 autocast against HF's fp32 loss (measured 9e-5); a loss without the softcap is 40% away
LOSS_RTOL = 2e-3
#: The cases of one token count on CPU (free_memory needs a GPU's free memory), as (case, saturated)
CPU_CASES = {
    ("packaged policy", False),
    ("fixed 2048 rows", False),
    ("fixed 256 rows", False),
    ("fixed 256 rows", True),
    ("fixed 1024 rows", True),
    ("packaged policy (OOM fallback on)", True),
    ("fixed 2048 rows, no fallback", True),
}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def hf_fp32_loss(softcap: bool = True) -> float:
    """HF's own loss of the benchmark's CPU model and batch: fp32, no autocast, no wrapper, logits materialised."""
    s = z3s.Scenario.for_tokens(False, 8192)
    model = z3s.make_model(s, torch.device("cpu"))
    if not softcap:
        model.config.final_logit_softcapping = None
    ids, labels = z3s.make_batch(s, torch.device("cpu"))
    with torch.no_grad():
        return model(input_ids=ids, labels=labels).loss.item()


@pytest.mark.parametrize(
    "wrapper",
    ["ddp", pytest.param("zero3", marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed"))],
)
def test_every_case_runs_the_head_call_and_gives_hf_s_loss(tmp_path, wrapper):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    command = [sys.executable, "-m", "flce_policy.benchmarks.zero3_saturation", str(out), "--tokens", "8192"]
    command += ["--steps", "1", "--wrapper", wrapper]
    # from tmp_path: the repository's top-level kernels/ folder would shadow the `kernels` package HF imports
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    assert "PASS zero3_saturation: 0 failing line(s)" in proc.stdout, output
    (result,) = json.loads((out / "zero3_saturation.json").read_text())
    assert (result["wrapper"], result["tokens"], result["vocab"], result["hidden"]) == (wrapper, 128, 512, 64)
    cases = {(c["case"], c["saturated"]): c for c in result["cases"]}
    assert set(cases) == CPU_CASES
    reference = hf_fp32_loss()
    for key, c in cases.items():
        assert c["outcome"] == "completed", (key, c)
        assert c["loss"] == pytest.approx(reference, rel=LOSS_RTOL), key
    # the benchmark's own fp32 reference (the head's inputs, its gathered weight): HF's fp32 loss but for the
    # body, which ran under bf16 autocast
    assert result["fp32_reference_loss"] == pytest.approx(reference, rel=LOSS_RTOL)
    # the fixed policies reached the head's call through apply_flce: the report's rows / 64 on 128 tokens
    rows = {key: c["geometry"]["chunk_size"] for key, c in cases.items()}
    assert rows[("fixed 256 rows", True)] == 4
    assert rows[("fixed 1024 rows", True)] == 16
    assert rows[("fixed 2048 rows, no fallback", True)] == 32
    assert cases[("fixed 256 rows", True)]["geometry"]["num_chunks"] == 32


def test_the_softcap_moves_the_loss_by_more_than_the_tolerance():
    """The comparison above would fail on a loss that leaves out Gemma's softcap."""
    with_cap, without = hf_fp32_loss(), hf_fp32_loss(softcap=False)
    assert abs(without - with_cap) / with_cap > 20 * LOSS_RTOL


def test_auto_wrapper_is_zero3_with_deepspeed_and_ddp_without():
    assert z3s.chosen_wrapper("auto", True)[0] == "zero3"
    wrapper, why = z3s.chosen_wrapper("auto", False)
    assert wrapper == "ddp" and "without ZeRO-3" in why
    assert z3s.chosen_wrapper("ddp", True)[0] == "ddp"
    with pytest.raises(SystemExit, match="needs DeepSpeed"):
        z3s.chosen_wrapper("zero3", False)


def _case(name, saturated, outcome="completed", rows=1024, loss=2.0):
    case = {"case": name, "saturated": saturated, "outcome": outcome}
    if outcome == "completed":
        case["loss"] = loss
        case["geometry"] = {"chunk_size": rows, "num_chunks": 8192 // rows, "slab_form": "logits"}
        case["geometry"]["slab_bytes"] = rows * 262144 * 2
    return case


def _gpu_result(**changes):
    """A GPU run's result as it should be: 2048 rows without a fallback OOM, the policy at the 1024 rows that fit."""
    cases = {
        "reference": _case("packaged policy", False, rows=4096),
        "fixed 1024": _case("fixed 1024 rows", True, rows=1024),
        "policy": _case("packaged policy (OOM fallback on)", True, rows=1024),
        "no fallback": _case("fixed 2048 rows, no fallback", True, outcome="OOM"),
    }
    cases.update(changes)
    return {"tokens": 8192, "cases": list(cases.values()), "fp32_reference_loss": 2.0001}


def _failing(result):
    return [line for ok, line in z3s.verdict(result, cuda=True) if not ok]


def test_gpu_verdict_passes_the_report_s_outcome():
    assert _failing(_gpu_result()) == []


def test_gpu_verdict_fails_where_2048_rows_without_a_fallback_completes():
    failing = _failing(_gpu_result(**{"no fallback": _case("fixed 2048 rows, no fallback", True, rows=2048)}))
    # the saturation missed: 2048 rows fitted, and the policy's 1024 rows are then not the largest that fit
    assert len(failing) == 2
    assert "no fallback" in failing[1] and "rows 1024 vs the largest fixed rows that fit: 2048" in failing[0]


def test_gpu_verdict_fails_a_policy_below_the_largest_rows_that_fit():
    (line,) = _failing(_gpu_result(policy=_case("packaged policy (OOM fallback on)", True, rows=512)))
    assert "rows 512 vs the largest fixed rows that fit: 1024" in line


def test_gpu_verdict_fails_another_loss_and_a_loss_off_fp32():
    failing = _failing(_gpu_result(policy=_case("packaged policy (OOM fallback on)", True, loss=2.01)))
    assert len(failing) == 1 and "loss rel diff 5.0e-03" in failing[0]
    off = _gpu_result()
    off["fp32_reference_loss"] = 2.1
    (line,) = _failing(off)
    assert "plain torch fp32" in line
