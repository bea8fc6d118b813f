"""benchmarks/install_quack.sh: joins a wheel shipped as split parts, installs into a site-packages folder."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "install_quack.sh"


def _wheel(path: Path, name: str, module_text: str) -> None:
    dist = f"{name}-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", module_text)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


def _run(*args: str) -> subprocess.CompletedProcess:
    bin_dir = str(Path(sys.executable).parent)  # python3 in the script: this interpreter's, with its pip
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env={"PATH": bin_dir + ":/usr/bin:/bin"}
    )


def test_split_parts_are_joined_by_the_wheel_s_own_name_and_installed(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
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
    left = sorted(p.name for p in wheels.iterdir())
    assert left == ["cu13.part.aa", "cu13.part.ab", "whole_pkg-0.1-py3-none-any.whl"]  # the source as it was


def test_a_target_without_site_packages_is_refused(tmp_path):
    done = _run(str(tmp_path), str(tmp_path / "quack"))
    assert done.returncode == 2 and "site-packages" in done.stderr


def test_usage_without_a_wheel_folder():
    done = _run()
    assert done.returncode != 0 and "usage" in done.stderr
