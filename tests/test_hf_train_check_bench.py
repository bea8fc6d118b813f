"""benchmarks/hf_train_check.py on CPU: its comparison (HF's loss and apply_flce's, trained side by side) on
models made small, a few steps.

The GPU run trains each tiny model 50 AdamW steps; here two, on a batch of two sequences, through the
same ``compare``: every step's flce loss within the benchmark's 1% of HF's own (the independent
reference: HF's loss on materialised logits, Gemma-3's softcap applied by its forward).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from flce_policy.benchmarks import hf_train_check  # noqa: E402

#: the tiny models made smaller: V=128, H=32
SIZES = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16
)


@pytest.mark.parametrize("model_type", list(hf_train_check.CASES))
def test_compare_trains_both_paths_and_flce_follows_hf(model_type):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 16), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100

    def build(dtype):
        return hf_train_check.tiny(model_type, dtype, "cpu", **SIZES)

    results = hf_train_check.compare(model_type, ids, labels, 2, build)
    assert [r["weights"] for r in results] == ["bf16", "fp32 master + autocast"]
    for r in results:
        assert r["passed"] and r["worst_relative_diff"] <= hf_train_check.TOLERANCE, r
        assert len(r["flce"]) == len(r["hf"]) == 2 and len(r["hf_rotated"]) == 1
        assert ("flce_fp32_softcap" in r) == (model_type == "gemma3_text")
