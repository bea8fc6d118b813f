"""``pytest -m gpu`` runs the compiled kernels: tests/conftest.py switches the interpreter off only where the run
selects GPU tests alone and the environment left the choice to it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import selects_only_gpu_tests

TESTS = Path(__file__).resolve().parent

PROBE = """
import os

import pytest


@pytest.mark.gpu
def test_probe():
    with open(os.environ["PROBE_OUT"], "w") as out:
        out.write(os.environ["TRITON_INTERPRET"])
"""


@pytest.mark.parametrize(
    ("markexpr", "only_gpu"),
    [
        ("gpu", True),
        ("gpu and not slow", True),
        ("(gpu)", True),
        ("", False),
        ("not gpu", False),
        ("gpu or slow", False),
        ("slow", False),
        ("not slow", False),
        ("gpu or not slow", False),
    ],
)
def test_which_marker_expressions_select_only_gpu_tests(markexpr, only_gpu):
    assert selects_only_gpu_tests(markexpr) is only_gpu


@pytest.mark.parametrize(
    ("args", "given", "interpret"),
    [(["-m", "gpu"], None, "0"), ([], None, "1"), (["-m", "gpu"], "1", "1"), (["-m", "not gpu"], None, "1")],
)
def test_the_gpu_run_compiles_unless_told(tmp_path, args, given, interpret):
    (tmp_path / "test_probe.py").write_text(PROBE)
    out = tmp_path / "interpret.txt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]), PROBE_OUT=str(out))
    if given is not None:
        env["TRITON_INTERPRET"] = given
    # the repository's conftest as a plugin of a run over the probe alone, in one process
    command = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q"]
    done = subprocess.run(
        [*command, *args, str(tmp_path / "test_probe.py")], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    if "not gpu" in args:
        assert done.returncode == 5, done.stdout + done.stderr  # nothing selected: the probe is a GPU test
        return
    assert done.returncode == 0, done.stdout + done.stderr
    assert out.read_text() == interpret
