"""The examples run as a user would run them (CPU: the Triton interpreter), and do what they say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_train_tiny_hf_trains_through_flce():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_tiny_hf.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    match = re.search(r"trained (\d+) steps through flce-policy; loss per step: (.*)", run.stdout)
    assert match, run.stdout[-2000:]
    losses = [float(x) for x in match.group(2).split(", ")]
    assert int(match.group(1)) == 3 and len(losses) == 3
    assert all(0 < x < 10 for x in losses)  # ln(128) = 4.85 at the start: a real loss, not 0 or nan
