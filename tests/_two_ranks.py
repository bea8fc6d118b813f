"""Tests only: a function run on two gloo ranks in processes of their own, each rank's JSON result read back.

A hang cannot stall the suite: the process group times out (``timeout_s``), and a rank still alive at the
deadline is killed, so its result file is missing and the test fails.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import _warm_start
import torch.distributed as dist

from flce_policy.call import autograd
from flce_policy.plan.geometry import Geometry

__all__ = ["WORLD", "rank_main", "recorded_geometries", "run_two_ranks"]

WORLD = 2
#: the most both ranks may take together, start-up included (the 2-core CI machine, the interpreter's kernels)
JOIN_DEADLINE_S = 300


def run_two_ranks(worker: Callable[..., None], out_dir: Path, *args: Any) -> list[dict]:
    """Run ``worker(rank, port, out_dir, *args)`` (a module-level function calling :func:`rank_main`) on two ranks;
    each rank's result, asserting that none raised."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = _warm_start.context()
    procs = [context.Process(target=worker, args=(rank, port, str(out_dir), *args)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + JOIN_DEADLINE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
    results = [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return results


def rank_main(rank: int, port: int, out_dir: str, body: Callable[[], dict], timeout_s: float) -> None:
    """In a rank's process: join the gloo group, run ``body``, write its result (or its traceback) for the test."""
    import _interpreter_patch

    _interpreter_patch.for_tests()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=timeout_s)
    )
    result: dict = {}
    try:
        result = body()
    except Exception:  # noqa: BLE001 - reported to the test
        result = {"error": traceback.format_exc()}
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


@contextlib.contextmanager
def recorded_geometries() -> Iterator[list[Geometry]]:
    """The geometry each loss call of this process completes at, in order."""
    seen: list[Geometry] = []
    real = autograd.run_with_oom_fallback

    def recording(*args: Any, **kwargs: Any) -> Any:
        out, geometry = real(*args, **kwargs)
        seen.append(geometry)
        return out, geometry

    autograd.run_with_oom_fallback = recording
    try:
        yield seen
    finally:
        autograd.run_with_oom_fallback = real
