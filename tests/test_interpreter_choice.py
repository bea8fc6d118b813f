"""``pytest -m gpu`` runs the compiled kernels: tests/conftest.py switches the interpreter off only where the run
selects GPU tests alone and the environment left the choice to it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import selects_only_gpu_tests

TESTS = Path(__file__).resolve().parent

PROBE = """
import os

import pytest


@pytest.mark.gpu
def test_probe():
    from flce_policy.kernels.interpreter import KERNELS_INTERPRETED  # Triton's own helpers and ours, defined

    with open(os.environ["PROBE_OUT"], "w") as out:
        out.write("1" if KERNELS_INTERPRETED else "0")
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


#: a plugin loaded before the conftest: a CUDA GPU as far as the conftest can tell
FAKE_CUDA = """
import torch

torch.cuda.is_available = lambda: True
"""


@pytest.mark.parametrize(
    ("args", "given", "cuda", "interpret"),
    [
        (["-m", "gpu"], None, True, "0"),
        (["-m", "gpu"], None, torch.cuda.is_available(), "0" if torch.cuda.is_available() else "1"),
        ([], None, True, "1"),
        (["-m", "gpu"], "1", True, "1"),
        (["-m", "not gpu"], None, True, None),
    ],
    ids=["gpu", "this-machine", "whole-suite", "given", "not-gpu"],
)
def test_the_gpu_run_compiles_unless_told(tmp_path, args, given, cuda, interpret):
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "fake_cuda.py").write_text(FAKE_CUDA)
    out = tmp_path / "interpret.txt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(TESTS), env.get("PYTHONPATH", "")]), PROBE_OUT=str(out))
    if given is not None:
        env["TRITON_INTERPRET"] = given
    # the repository's conftest as a plugin of a run over the probe alone, in one process
    plugins = ["-p", "fake_cuda"] if cuda else []
    command = [sys.executable, "-m", "pytest", *plugins, "-p", "conftest", "-p", "no:xdist", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "-q", *args, str(tmp_path / "test_probe.py")], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    if interpret is None:
        assert done.returncode == 5, done.stdout + done.stderr  # nothing selected: the probe is a GPU test
        return
    assert done.returncode == 0, done.stdout + done.stderr
    assert out.read_text() == interpret
