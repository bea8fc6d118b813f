"""Shared test setup: run the Triton kernels on CPU under the interpreter unless told otherwise.

Triton picks interpreter or compiler when a kernel is decorated, i.e. when ``flce_policy.kernels``
is first imported, so the variable is set here, before any test module imports the kernels.
``setdefault`` leaves an explicit ``TRITON_INTERPRET=0`` (the GPU suite) untouched.

Under the interpreter, ``tests/_interpreter_patch.py`` drops its repeated patching of
``triton.language`` inside a launch (half the CPU time of a vocab-tiled call; bit-identical results).
``FLCE_TESTS_STOCK_INTERPRETER=1`` runs Triton's interpreter as shipped.
"""

from __future__ import annotations

import os

import pytest

#: the thread-pool sizes of torch (OpenMP) and numpy (OpenBLAS)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")

os.environ.setdefault("TRITON_INTERPRET", "1")
# One compute thread per process (torch's OpenMP pool, numpy's OpenBLAS under the interpreter), inherited by
# the processes the tests spawn: xdist already runs one worker per core, and the tensors here are tiny, so a
# second thread only spins waiting for work on a core another worker needs (a tiny HF model's step took
# twice the CPU time with torch's default of one thread per core). Set before torch or numpy is imported.
for _variable in THREAD_VARIABLES:
    os.environ.setdefault(_variable, "1")

import _interpreter_patch  # noqa: E402

_interpreter_patch.for_tests()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which turns "auto" into a number of workers
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The whole suite (no files or tests named) runs on every core by default: pytest-xdist's ``-n auto``
    (one worker per physical core, 2 on the 2-core CI machine) with ``--dist loadfile``.

    A file's tests share one worker: the multi-process checks (tests/test_vocab_parallel.py,
    tests/test_fsdp2.py) run each launch once, from a module fixture, and read it in many tests.
    ``loadfile`` rather than ``loadgroup``: with pytest 9.2 and xdist 3.8 the group suffix that xdist
    writes is not read back (pytest keeps the node id elsewhere), so ``xdist_group`` marks do not keep
    a group on one worker; whole files do.
    Left alone: named files or tests (one process, no workers to start), ``-n``/``--dist`` given,
    ``--collect-only``, ``--pdb``, an xdist worker, xdist off (``-p no:xdist``, not installed).
    ``-n 0`` runs the whole suite in this process.
    """
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if hasattr(config, "workerinput"):  # a worker parses the command line again; the controller distributes
        return
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        return
    option = config.option
    if option.numprocesses is not None or option.dist != "no" or option.tx or option.collectonly or option.usepdb:
        return
    option.numprocesses = "auto"
    option.dist = "loadfile"


def pytest_configure(config: pytest.Config) -> None:
    # xdist registers it; registered here too so that -p no:xdist does not warn about an unknown mark
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one pytest-xdist worker")
