"""Shared test setup: run the Triton kernels on CPU under the interpreter unless told otherwise.

Triton picks interpreter or compiler when a kernel is decorated (its own ``triton.language`` helpers when that is
first imported, ours when ``flce_policy.kernels`` is), so the variable is set at ``pytest_configure``, before any
test module or Triton itself is imported: ``1``, but ``0`` where the run selects only GPU tests (``pytest -m gpu``)
on a machine with CUDA. A ``TRITON_INTERPRET`` given in the environment (the GPU suite's ``0``) is kept.

Under the interpreter, ``tests/_interpreter_patch.py`` drops its repeated patching of
``triton.language`` inside a launch (half the CPU time of a vocab-tiled call; bit-identical results).
``FLCE_TESTS_STOCK_INTERPRETER=1`` runs Triton's interpreter as shipped.
"""

from __future__ import annotations

import os

import pytest
from _pytest.mark.expression import Expression

#: the thread-pool sizes of torch (OpenMP) and numpy (OpenBLAS)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")

#: whether the environment chose interpreter or compiler itself: then the run keeps that choice
INTERPRET_GIVEN = "TRITON_INTERPRET" in os.environ
# One compute thread per process (torch's OpenMP pool, numpy's OpenBLAS under the interpreter), inherited by
# the processes the tests spawn: xdist already runs one worker per core, and the tensors here are tiny, so a
# second thread only spins waiting for work on a core another worker needs (a tiny HF model's step took
# twice the CPU time with torch's default of one thread per core). Set before torch or numpy is imported.
for _variable in THREAD_VARIABLES:
    os.environ.setdefault(_variable, "1")

import _interpreter_patch  # noqa: E402  (imports Triton only when called)


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
    option.loadscopereorder = False  # files in collection order (LONGEST_FIRST), not by their number of tests


#: The files that take the most CPU time (seconds of one process and its children, measured alone: about
#: 90 down to 5), longest first, but for the four that fork their processes from tests/_warm_start.py's
#: server (docs, vocab_parallel, fsdp2, examples): they follow the first two, so that the worker that
#: gets the docs (xdist hands out two files each at the start) takes the other three as it frees up
#: while the other works through the sweep and test_compile.py, and one fork server (5 s of imports)
#: serves all four. A bare run hands files to the 2 workers in collection order, so these are
#: collected first and the short files fill in at the end: both workers finish together (xdist's own
#: order, by number of tests, left few-test files such as test_fsdp2.py or test_vocab_tiled.py for the
#: last minute). A file not listed runs after them, in its usual order.
LONGEST_FIRST = (
    "test_hf_sweep.py",
    "test_docs.py",
    "test_compile.py",
    "test_vocab_parallel.py",
    "test_fsdp2.py",
    "test_examples.py",
    "test_hf_integration.py",
    "test_zero3_saturation.py",
    "test_vocab_tiled.py",
    "test_loss_kernel.py",
    "test_weight_grad_filter_paths.py",
    "test_entropy.py",
    "test_softcap_rounding.py",
    "test_bench.py",
    "test_scaled_exp.py",
    "test_weight_grad_filter.py",
    "test_token_scaling_autocast.py",
    "test_trl_integration.py",
    "test_driver_geometry.py",
    "test_planned_accum.py",
    "test_weight_grad_filter_policy.py",
    "test_bad_inputs_loss.py",
    "test_oom_fallback.py",
    "test_convergence_bench.py",
    "test_packaging.py",
    "test_trained_inputs.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files of LONGEST_FIRST first, in its order; the rest after them as collected (a stable sort, so
    the tests of a file keep their order; every xdist worker sorts its collection alike)."""
    position = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: position.get(item.path.name, len(LONGEST_FIRST)))


def selects_only_gpu_tests(markexpr: str) -> bool:
    """Whether ``-m markexpr`` selects tests marked ``gpu`` and no others: a test with that mark alone, and not a
    test without marks nor one with every mark but ``gpu`` (enough for the expressions one writes)."""
    if not markexpr:
        return False
    expression = Expression.compile(markexpr)
    return (
        expression.evaluate(lambda name, **_: name == "gpu")
        and not expression.evaluate(lambda name, **_: False)
        and not expression.evaluate(lambda name, **_: name != "gpu")
    )


def pytest_configure(config: pytest.Config) -> None:
    # xdist registers it; registered here too so that -p no:xdist does not warn about an unknown mark
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one pytest-xdist worker")
    if not INTERPRET_GIVEN:
        # the GPU tests want the compiled kernels; without a GPU they skip, interpreted as the rest (two CPU test
        # modules cannot even be collected with compiled kernels there). xdist's workers inherit the choice.
        gpu_run = selects_only_gpu_tests(config.option.markexpr) and _cuda_available()
        os.environ["TRITON_INTERPRET"] = "0" if gpu_run else "1"
    _interpreter_patch.for_tests()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
