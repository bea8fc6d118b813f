"""benchmarks/sharded_heads.py's FSDP2 cases on one CPU rank (gloo): the script without DeepSpeed, so CI runs it.

Per family (Llama; Gemma-3 with its softcap), untied and tied: HF's own loss and apply_flce's trained side by
side under ``fully_shard``, fp32 and with a bf16 ``MixedPrecisionPolicy``; every step's loss within the
benchmark's 1% of HF's and the first step's lm_head gradient compared. ``tests/test_zero3_cpu.py`` runs its
ZeRO-3 cases where DeepSpeed is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sharded_heads.py"


def test_fsdp2_cases_train_as_hf_does(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), "--cases", "fsdp2,fsdp2_bf16", "--steps", "3"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "sharded_heads.json").read_text())
    failed = [r for r in report["results"] if not r["ok"]]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:] + proc.stderr[-3000:])
    assert len(report["results"]) == 8  # 2 precisions x 2 families x untied/tied
    for r in report["results"]:
        # fp32: the same gradient to fp32 rounding; bf16 mixed precision: to bf16's
        limit = 1e-5 if r["case"].startswith("fsdp2 ") else 2e-2
        assert r["lm_head_grad_rel_l2_step0"] < limit, r
