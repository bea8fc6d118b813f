"""apply_flce under DeepSpeed ZeRO-3 on one CPU rank (gloo), against HF's loss under the same engine.

Runs ``benchmarks/sharded_heads.py`` (engines and the HF Trainer with a ZeRO-3 config; the head is
released after its forward, so its backward needs the re-gather that apply_flce's output routing
triggers). DeepSpeed is not a test dependency: skipped without it (the GPU run covers it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sharded_heads.py"


def test_zero3_engine_and_trainer_match_hf(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        str(SCRIPT),
        str(tmp_path),
        "--cases",
        "zero3,trainer_zero3",
        "--steps",
        "3",
        "--trainer-steps",
        "2",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "sharded_heads.json").read_text())
    failed = [r for r in report["results"] if not r["ok"]]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:] + proc.stderr[-3000:])
    assert len(report["results"]) == 8  # 2 wrappers x 2 families x untied/tied
