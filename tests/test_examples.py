"""The examples run as a user would run them (CPU: the Triton interpreter), and do what they say.

Each runs as ``python examples/<name>.py ...`` would, in a process forked from one that imported torch,
flce_policy and transformers already (tests/_warm_start.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import _warm_start
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_train_tiny_hf_trains_through_flce(tmp_path: Path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    script, log = EXAMPLES / "train_tiny_hf.py", tmp_path / "train_tiny_hf.log"
    run = _warm_start.run_script(script.read_text(), [str(script), "--steps", "3"], os.getcwd(), env, str(log))
    run.join(600)
    if run.is_alive():
        run.kill()
        run.join()
    output = log.read_text()
    assert run.exitcode == 0, output[-3000:]
    match = re.search(r"trained (\d+) steps through flce-policy; loss per step: (.*)", output)
    assert match, output[-2000:]
    losses = [float(x) for x in match.group(2).split(", ")]
    assert int(match.group(1)) == 3 and len(losses) == 3
    assert all(0 < x < 10 for x in losses)  # ln(128) = 4.85 at the start: a real loss, not 0 or nan
