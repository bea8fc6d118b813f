"""benchmarks/hf_step.py's rows on CPU: each family's two-layer model with a small head, each loss path, one step.

The GPU run times each step with CUDA events (``measure``); here the step runs once in its place. The rows'
losses then go through the benchmark's own targets: flce's loss against HF's own loss of the same model
on materialised logits (Gemma-3's softcap applied by its forward), bf16 weights and an fp32 master under
bf16 autocast. Liger's row is the GPU run's (liger-kernel's kernels need CUDA).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from flce_policy.benchmarks import hf_step  # noqa: E402
from flce_policy.benchmarks.measure import Measurement  # noqa: E402

#: the families' heads made small: V=256, H=64, two heads of 32
SIZES = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32
)
METHODS = ("hf", "flce_default", "flce_256MiB")


def _run_once(step, *, warmup, repeats):
    step()
    return Measurement((1.0,), 0)


@pytest.mark.parametrize("family", list(hf_step.FAMILIES))
def test_rows_build_and_step_on_cpu_and_flce_gives_hf_s_loss(monkeypatch, tmp_path, family):
    monkeypatch.setattr(hf_step, "measure", _run_once)
    rows = [
        hf_step.run_row(family, method, autocast, 1, device="cpu", sizes=SIZES, batch=(2, 32))
        for autocast in (False, True)
        for method in METHODS
    ]
    assert [r["error"] for r in rows] == [None] * len(rows)
    for weights in ("bf16", "fp32 master + autocast"):
        loss = {r["method"]: r["loss"] for r in rows if r["weights"] == weights}
        for method in METHODS[1:]:
            assert loss[method] == pytest.approx(loss["hf"], rel=1e-2), (weights, method)
    lines = hf_step.targets(rows)
    assert f"PASS {family}: flce loss vs HF's (relative)" in "\n".join(lines)
    hf_step.write(rows, tmp_path, lines)
    assert {p.name for p in tmp_path.iterdir()} >= {"hf_step.json", "hf_step.csv", "hf_step.png"}
