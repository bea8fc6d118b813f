"""benchmarks/install_quack.sh: joins a wheel shipped as split parts, installs into a site-packages folder."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "install_quack.sh"


#: A file from each wheel whose tree QuACK imports: quack-kernels, nvidia-cutlass-dsl-libs-core and -libs-base.
QUACK_TREES = {
    "quack_kernels": "quack/linear_cross_entropy.py",
    "cutlass_core": "nvidia_cutlass_dsl/dsl_packages/cutlass/cutlass_dsl/__init__.py",
    "cutlass_base": "nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/__init__.py",
}


def _wheel(path: Path, name: str, module_text: str, file_name: str | None = None) -> None:
    dist = f"{name}-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(file_name or f"{name}.py", module_text)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


def _run(*args: str) -> subprocess.CompletedProcess:
    bin_dir = str(Path(sys.executable).parent)  # python3 in the script: this interpreter's, with its pip
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env={"PATH": bin_dir + ":/usr/bin:/bin"}
    )


def _quack_trees(wheels: Path, leave_out: str = "") -> None:
    for name, file_name in QUACK_TREES.items():
        if name != leave_out:
            _wheel(wheels / f"{name}-0.1-py3-none-any.whl", name, "", file_name)


def test_split_parts_are_joined_by_the_wheel_s_own_name_and_installed(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _quack_trees(wheels)
    _wheel(wheels / "whole_pkg-0.1-py3-none-any.whl", "whole_pkg", "VALUE = 1\n")
    big = tmp_path / "big.whl"
    _wheel(big, "split_pkg", "VALUE = 2\n" + "# padding\n" * 2000)
    data = big.read_bytes()
    half = len(data) // 2
    (wheels / "cu13.part.aa").write_bytes(data[:half])  # a name that is not the wheel's: read from its metadata
    (wheels / "cu13.part.ab").write_bytes(data[half:])
    target = tmp_path / "q" / "site-packages"

    done = _run(str(wheels), str(target))

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{target}:{target}/nvidia_cutlass_dsl/dsl_packages"
    assert (target / "whole_pkg.py").read_text() == "VALUE = 1\n"
    assert (target / "split_pkg.py").read_text().startswith("VALUE = 2\n")
    left = sorted(p.name for p in wheels.iterdir() if not p.name.startswith(tuple(QUACK_TREES)))
    assert left == ["cu13.part.aa", "cu13.part.ab", "whole_pkg-0.1-py3-none-any.whl"]  # the source as it was


@pytest.mark.parametrize(
    ("leave_out", "named"),
    [
        ("cutlass_core", "nvidia-cutlass-dsl-libs-core"),
        ("cutlass_base", "nvidia-cutlass-dsl-libs-base"),
        ("quack_kernels", "quack-kernels"),
    ],
)
def test_a_tree_quack_imports_left_out_fails_naming_its_wheel(tmp_path, leave_out, named):
    # the libs-core wheel (cutlass.cutlass_dsl) left out had passed, and QuACK failed at its first call
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _quack_trees(wheels, leave_out)
    done = _run(str(wheels), str(tmp_path / "q" / "site-packages"))
    assert done.returncode == 1 and done.stdout == ""
    assert f"no wheel of {named} in {wheels}" in done.stderr


def test_a_target_without_site_packages_is_refused(tmp_path):
    done = _run(str(tmp_path), str(tmp_path / "quack"))
    assert done.returncode == 2 and "site-packages" in done.stderr


def test_usage_without_a_wheel_folder():
    done = _run()
    assert done.returncode != 0 and "usage" in done.stderr
