"""The convergence benchmark on the tiny CPU build: three trainings from one seed, filter off, off, on."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_trained_inputs import TINY, tiny_sources  # noqa: E402

from flce_policy.benchmarks.convergence import run_all  # noqa: E402
from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED  # noqa: E402

pytestmark = pytest.mark.skipif(
    not KERNELS_INTERPRETED, reason="the tiny build trains on the CPU, under the interpreter"
)


def test_three_runs_from_one_seed():
    result = run_all(TINY.model_copy(update={"steps": 3}), 0.5, sources=tiny_sources, log=lambda _m: None)
    off, again, on = result["runs"]
    assert [r["label"] for r in result["runs"]] == ["filter off", "filter off, again", "filter on"]
    assert on["options"] == {"grad_weight_filter": 0.5} and off["options"] == again["options"] == {}
    # on the CPU the same seed and batches give the same run twice: no noise
    assert off["losses"] == again["losses"] and result["noise"] == 0.0
    # the first step's loss comes before any update, so the filter cannot change it; at eps 0.5 it
    # drops most of grad_weight, so the updates after it differ
    assert on["losses"][0] == off["losses"][0]
    assert on["losses"][1:] != off["losses"][1:]
    assert result["filter_effect"] == on["held_out_ce"] - off["held_out_ce"]
    assert result["within_noise"] is (abs(result["filter_effect"]) <= result["noise"])
