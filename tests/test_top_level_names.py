"""The repository's top-level folders never shadow an installed package of the same name.

Each case runs a child Python from the repository root with its root first on ``sys.path``, as
``python -m pytest`` or a script started there has it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("kernels", "strategies", "configs", "benchmarks")


def run_from_root(code: str, site: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    if site is not None:
        env["PYTHONPATH"] = str(site)  # after the root: sys.path[0] is the current directory
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_root_is_first_on_the_childs_path():
    done = run_from_root("import sys, os; print(os.path.realpath(sys.path[0] or '.'))")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == ROOT


def test_hugging_faces_kernels_and_the_transformers_models_that_import_it():
    try:
        metadata.version("kernels")
    except metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's `kernels` is not installed (transformers < 5.25 does not need it)")
    done = run_from_root(
        """
        import importlib.util, json, os, kernels
        import transformers.activations  # imports HF's kernels (transformers >= 5.25)
        from transformers import LlamaForCausalLM
        if importlib.util.find_spec("transformers.models.gemma4") is not None:  # transformers >= 5.x
            from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
        import flce_policy.kernels
        print(json.dumps([os.path.realpath(kernels.__file__), flce_policy.kernels.__file__]))
        """
    )
    assert done.returncode == 0, done.stderr
    hf_kernels, ours = map(Path, json.loads(done.stdout))
    assert hf_kernels == Path(metadata.distribution("kernels").locate_file("kernels/__init__.py")).resolve()
    assert ours == ROOT / "kernels" / "__init__.py"


@pytest.mark.parametrize("name", FOLDERS)
def test_an_installed_package_of_the_folders_name_wins(tmp_path, name):
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("MARK = 'installed'\n")
    (package / "sub.py").write_text("VALUE = 42\n")
    dist_info = tmp_path / f"{name}-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    done = run_from_root(
        f"""
        import json
        from importlib import metadata
        import {name}
        from {name}.sub import VALUE
        import flce_policy.{name}
        print(json.dumps([{name}.MARK, VALUE, metadata.version("{name}"), flce_policy.{name}.__file__]))
        """,
        site=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    mark, value, version, ours = json.loads(done.stdout)
    assert (mark, value, version) == ("installed", 42, "1.0")
    assert Path(ours) == ROOT / name / "__init__.py"


@pytest.mark.parametrize("name", FOLDERS)
def test_without_an_installed_package_the_name_is_missing(name):
    try:
        pytest.skip(f"a `{name}` distribution is installed here ({metadata.version(name)})")
    except metadata.PackageNotFoundError:
        pass
    done = run_from_root(f"import {name}")
    assert done.returncode != 0
    assert f"ModuleNotFoundError: No module named '{name}'" in done.stderr, done.stderr
