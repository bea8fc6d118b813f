"""The built wheel carries the package-dir mapping and the YAML, and works outside the checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE_SCRIPT = """
import json, flce_policy, flce_policy.strategies, flce_policy.kernels, flce_policy.configs
from importlib.resources import files
from flce_policy import FLCEPolicy, DeviceInfo, Problem
policy = FLCEPolicy.packaged()
geometry = policy.resolve(Problem(8192, 5376, 262144), DeviceInfo.synthetic("H100"))
print(json.dumps({
    "package": flce_policy.__file__,
    "strategies": flce_policy.strategies.__file__,
    "yaml_is_file": files("flce_policy.configs").joinpath("default.yaml").is_file(),
    "h100_chunk": geometry.chunk_size,
}))
"""


@pytest.mark.slow
def test_wheel_installs_and_imports_outside_the_repo(tmp_path):
    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(REPO),
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheel_dir.glob("flce_policy-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "flce_policy/__init__.py",
        "flce_policy/strategies/__init__.py",
        "flce_policy/kernels/driver.py",
        "flce_policy/configs/default.yaml",
        "flce_policy/plan/geometry.py",
        "flce_policy/call/resolve.py",
        "flce_policy/cli/tune.py",
    ):
        assert expected in names
    assert not any(name.startswith(("strategies/", "kernels/", "configs/", "results/")) for name in names)
    assert not any(name.endswith((".log", ".jsonl", ".py.txt")) for name in names)  # run logs stay out of the package

    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    run = subprocess.run(
        [sys.executable, "-c", PROBE_SCRIPT],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr
    import json

    seen = json.loads(run.stdout)
    assert seen["package"].startswith(str(site))
    assert seen["strategies"].startswith(str(site))
    assert seen["yaml_is_file"] is True
    assert seen["h100_chunk"] >= 1
