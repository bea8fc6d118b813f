"""apply_flce under FSDP2 (``fully_shard``) on 2 CPU ranks with gloo, against HF's own loss under the same sharding.

One process-group launch for the module (``tests/_fsdp2_worker.py`` runs every variant: untied and
tied Llama, either order of patching and sharding, ``reshard_after_forward`` either way, the head
in its own group, bf16 mixed precision), and one test per kind of check reading its results.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from pathlib import Path

import _warm_start
import pytest
import torch

pytest.importorskip("transformers")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

#: One worker of pytest-xdist runs the module: its tests read the results of one launch (a module fixture).
pytestmark = pytest.mark.xdist_group("fsdp2")

WORKER = Path(__file__).with_name("_fsdp2_worker.py")
WORLD = 2
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def _results(tmp: str) -> list[dict]:
    port = _free_port()
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    paths = [Path(tmp) / f"rank{r}.json" for r in range(WORLD)]
    logs = [Path(tmp) / f"rank{r}.log" for r in range(WORLD)]
    script = WORKER.read_text()
    procs = [  # as ``python tests/_fsdp2_worker.py ...``, forked from a process that imported torch already
        _warm_start.run_script(
            script, [str(WORKER), str(r), str(WORLD), str(port), str(paths[r])], tmp, env, str(logs[r])
        )
        for r in range(WORLD)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    for r, p in enumerate(procs):
        assert p.exitcode == 0 and paths[r].exists(), f"rank {r} exited {p.exitcode}:\n{logs[r].read_text()[-4000:]}"
    return [json.loads(path.read_text()) for path in paths]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return _results(str(tmp_path_factory.mktemp("fsdp2")))


def _failures(results: list[dict], keep) -> list[str]:
    return [
        f"rank {r['rank']} [{c['variant']}] {c['check']}: {c['value']:.3g} > {c['tol']:.3g}"
        for r in results
        for c in r["checks"]
        if keep(c) and not c["ok"]
    ]


def test_every_variant_ran_on_every_rank(results):
    for r in results:
        assert not r["errors"], r["errors"][0]["variant"] + "\n" + r["errors"][0]["traceback"]
        ran = {c["variant"] for c in r["checks"]}
        assert ran == set(r["variants"]) and len(ran) >= 12


def test_patch_survives_fully_shard(results):
    assert not _failures(results, lambda c: "kept" in c["check"] or "class" in c["check"] or "tied" in c["check"])


def test_fp32_loss_and_every_gradient_match_hf(results):
    fp32 = lambda c: "bf16=False" in c["variant"] and (c["check"].endswith("loss") or "grad" in c["check"])  # noqa: E731
    assert sum(fp32(c) for c in results[0]["checks"]) > 100  # every parameter, two steps, every variant
    assert not _failures(results, fp32)


def test_bf16_mixed_precision_as_close_to_fp32_as_hf(results):
    bf16 = lambda c: "bf16=True" in c["variant"] and "vs fp32" in c["check"]  # noqa: E731
    assert sum(bf16(c) for c in results[0]["checks"]) > 20
    assert not _failures(results, bf16)


def test_no_logits_in_training(results):
    assert not _failures(results, lambda c: "logits" in c["check"] or "same parameters" in c["check"])


def test_sharded_weight_outside_forward_raises_flce_error(results):
    raised = lambda c: "raises" in c["check"]  # noqa: E731
    assert sum(raised(c) for c in results[0]["checks"]) == len(results[0]["variants"])
    assert not _failures(results, raised)
