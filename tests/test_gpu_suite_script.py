"""benchmarks/run_gpu_suite.sh's stage dispatch, on the CPU: a stub ``python3`` records what each stage would run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "run_gpu_suite.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path: Path, *stages: str, **env: str) -> tuple[int, list[str]]:
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    (stub / "python3").write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n')
    (stub / "python3").chmod(0o755)
    repo = tmp_path / "repo"
    (repo / ".whl").mkdir(parents=True, exist_ok=True)
    shutil.copy(SCRIPT, repo / "run_gpu_suite.sh")
    environ = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), **env}
    for name in ("MEASURED_INPUTS", "MEASURED_PAIRS", "MEASURED_TRITON_CACHE", "SUSTAINED_SHAPES"):
        if name not in env:
            environ.pop(name, None)
    done = subprocess.run(
        ["bash", "run_gpu_suite.sh", *stages], cwd=repo, env=environ, timeout=60, capture_output=True, text=True
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return done.returncode, calls


def _runs(calls: list[str], module: str) -> list[str]:
    return [c for c in calls if f"-m {module} " in c]


def test_measured_runs_the_shapes_then_the_first_calls_once(tmp_path):
    rc, calls = _run(tmp_path, "measured")
    calls = _runs(calls, "flce_policy.benchmarks.measured_policy")
    assert rc == 0
    assert len(calls) == 2
    assert "--checks shapes" in calls[0]
    assert "--checks first-calls --inputs random --first-shape 16384x1024x131072" in calls[1]
    assert "--pairs 3 --triton-cache cold" in calls[1]


def test_measured_first_runs_the_first_calls_alone_with_the_knobs(tmp_path):
    rc, calls = _run(tmp_path, "measured-first", MEASURED_INPUTS="trained", MEASURED_PAIRS="5",
                     MEASURED_TRITON_CACHE="rule-warm")  # fmt: skip
    calls = _runs(calls, "flce_policy.benchmarks.measured_policy")
    assert rc == 0
    assert len(calls) == 1
    assert "--checks first-calls --inputs trained --pairs 5 --triton-cache rule-warm" in calls[0]


@pytest.mark.parametrize(
    "env, shapes",
    [
        ({}, "--shapes small-heads large-heads --out"),
        ({"SUSTAINED_SHAPES": "large-heads"}, "--shapes large-heads --out"),
    ],
)
def test_smallheads_sustained_runs_the_readme_table_s_bench(tmp_path, env, shapes):
    rc, calls = _run(tmp_path, "smallheads-sustained", **env)
    benches = _runs(calls, "flce_policy.cli")
    assert rc == 0
    assert len(benches) == 1
    assert benches[0].startswith("-m flce_policy.cli bench --sustained 1.5 --interleave --repeats 5 ")
    assert shapes in benches[0]
    assert benches[0].endswith("--methods ours_default_bf16 quack liger_c16_bf16")


def test_an_unknown_stage_is_refused(tmp_path):
    rc, _ = _run(tmp_path, "no-such-stage")
    assert rc == 2
