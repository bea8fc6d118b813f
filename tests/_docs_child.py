"""Tests only: the processes tests/test_docs.py runs the documentation's blocks in.

Each block (or chain, or rank, or shell block) gets a process of its own, forked from a fork server
(``multiprocessing``'s) that has imported torch, flce_policy and transformers once, with the
environment a block gets (``TRITON_INTERPRET=1``, no GPU): the three imports were most of a block's
start-up (about 2 s without transformers, 5 s with it, on a 2-core CI machine), and a fresh
interpreter would import the same modules with the same environment. The forked process then takes
the block's own environment, working directory and ``sys.path`` (that of ``python script.py`` run
there) and runs the driver script in a fresh ``__main__`` namespace, its output into a log file.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

#: Imported once by the fork server, before it forks any block's process (a module that is not
#: installed is left out: the fork server skips what it cannot import).
PRELOAD = ("torch", "flce_policy", "transformers")

_context: multiprocessing.context.ForkServerContext | None = None
_fresh_path: list[str] | None = None


def start(script: str, argv: Sequence[str], workdir: str, env: Mapping[str, str], log: str) -> multiprocessing.Process:
    """Run ``script`` (the text of ``argv[0]``) as ``python argv...`` would in ``workdir`` with ``env``;
    stdout and stderr go to ``log``. The started process: ``join`` it, read ``exitcode``."""
    context = _fork_server(env)
    process = context.Process(target=_run, args=(script, list(argv), workdir, dict(env), _sys_path(env), log))
    process.start()
    return process


def _fork_server(env: Mapping[str, str]) -> multiprocessing.context.ForkServerContext:
    """The fork server, started (once per test process) with a block's environment, so that what it
    imports sees what the block would (the interpreter switch above all)."""
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__, *PRELOAD])
        saved = dict(os.environ)
        try:
            os.environ.clear()
            os.environ.update(env)
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _context = context
    return _context


def _sys_path(env: Mapping[str, str]) -> list[str]:
    """``sys.path`` after its first entry (the script's folder) in a fresh interpreter with ``env``."""
    global _fresh_path
    if _fresh_path is None:
        command = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"]
        _fresh_path = json.loads(subprocess.run(command, env=dict(env), capture_output=True, check=True).stdout)
    return _fresh_path


def _run(script: str, argv: list[str], workdir: str, env: dict[str, str], path: list[str], log: str) -> None:
    """In the forked process: become ``python argv...`` started in ``workdir``, then run ``script``."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = [workdir, *path]
    sys.argv = argv
    exec(compile(script, argv[0], "exec"), {"__name__": "__main__", "__file__": argv[0]})
