"""Tests only: the extra Python processes of the tests, forked from a warm fork server.

The documentation's blocks (tests/test_docs.py) and the multi-process checks (tests/test_fsdp2.py,
tests/test_vocab_parallel.py) start Python processes; importing torch, flce_policy and transformers
was most of each one's start-up (about 2 s, 5 s with transformers, on the 2-core CI machine). Here
they are forked from ``multiprocessing``'s fork server, which has imported those once per test
process, with the environment they all run under: the kernels interpreted (``TRITON_INTERPRET=1``),
one compute thread, no GPU visible, no ``PYTHONPATH``. A fresh interpreter would import the same
modules with the same switches. ``run_script`` then gives the forked process the script's own
environment, working directory, ``sys.path`` and ``argv`` and runs it in a fresh ``__main__``;
``context().Process`` runs a function of a test module (spawn's usage).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

#: Imported once by the fork server before it forks anything (one that is not installed is left out:
#: the fork server skips what it cannot import).
PRELOAD = ("torch", "flce_policy", "transformers")

_context: multiprocessing.context.ForkServerContext | None = None
_fresh_paths: dict[str | None, list[str]] = {}


def server_environment() -> dict[str, str]:
    """This process's environment as the forked processes start from it (see the module docstring)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTHONPATH", None)
    return env


def context() -> multiprocessing.context.ForkServerContext:
    """The fork-server context, its server started on first use (once per test process)."""
    global _context
    if _context is None:
        fork_server = multiprocessing.get_context("forkserver")
        fork_server.set_forkserver_preload([__name__, *PRELOAD])
        saved = dict(os.environ)
        try:  # the server inherits the environment it is started with
            os.environ.clear()
            os.environ.update(server_environment())
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _context = fork_server
    return _context


def run_script(script: str, argv: Sequence[str], cwd: str, env: Mapping[str, str], log: str) -> multiprocessing.Process:
    """Start ``python argv...`` in ``cwd`` with ``env`` (``script``: the text of ``argv[0]``), its stdout and
    stderr into the file ``log``; ``join`` the process returned and read its ``exitcode``."""
    args = (script, list(argv), cwd, dict(env), _fresh_sys_path(env), log)
    process = context().Process(target=_run_script, args=args)
    process.start()
    return process


def _fresh_sys_path(env: Mapping[str, str]) -> list[str]:
    """``sys.path`` after its first entry (the script's folder) in a fresh interpreter with ``env``."""
    key = env.get("PYTHONPATH")
    if key not in _fresh_paths:
        command = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"]
        _fresh_paths[key] = json.loads(subprocess.run(command, env=dict(env), capture_output=True, check=True).stdout)
    return _fresh_paths[key]


def _run_script(script: str, argv: list[str], cwd: str, env: dict[str, str], path: list[str], log: str) -> None:
    """In the forked process: become ``python argv...`` started in ``cwd``, then run ``script``."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *path]
    sys.argv = argv
    exec(compile(script, argv[0], "exec"), {"__name__": "__main__", "__file__": argv[0]})
