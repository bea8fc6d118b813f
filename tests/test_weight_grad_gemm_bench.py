"""The grad_weight GEMM benchmark's setup on CPU (its timing needs a GPU): the per-chunk GEMMs and the loss rows."""

from __future__ import annotations

import os

import pytest
import torch

from flce_policy.benchmarks import weight_grad_gemm_bench as bench
from flce_policy.benchmarks.measure import rotated
from flce_policy.benchmarks.methods import make_inputs
from flce_policy.plan.weight_grad_gemm import WEIGHT_GRAD_GEMM_ENV_VAR


def test_the_per_chunk_gemms_write_the_product():
    steps, (g, x, grad_weight) = bench.chunk_gemms(64, 24, 16, device="cpu")
    product = g.double().t() @ x.double()
    steps["cublas_beta0"]()
    torch.testing.assert_close(grad_weight.double(), product, rtol=2**-7, atol=1e-3)
    steps["cublas_beta1"]()
    torch.testing.assert_close(grad_weight.double(), 2 * product, rtol=2**-7, atol=2e-3)
    for name in ("gluon", "gluon_in_memory", "gluon_beta0"):
        with pytest.raises(ValueError, match="one CUDA device"):  # the Gluon kernel's rows say why they did not run
            steps[name]()


def test_the_loss_rows_run_each_under_its_setting(monkeypatch):
    monkeypatch.setenv(WEIGHT_GRAD_GEMM_ENV_VAR, "auto")  # restored after the test, whatever the rows set
    rows = bench.loss_rows(make_inputs(24, 16, 64, logit_std=4.0, device="cpu"), [8])
    settings = bench.available_settings()
    assert settings[:2] == ("auto", "cublas") and set(settings) <= {"auto", "cublas", "reduce"}
    assert list(rows) == ["floor"] + [f"{form}_chunk8_{s}" for form in bench.LOSS_FORMS for s in settings]
    seen = []
    for step, setting in rows.values():
        bench._under(lambda: seen.append(os.environ.get(WEIGHT_GRAD_GEMM_ENV_VAR)), setting)()
        step()  # the floor's GEMMs, or a fwd+bwd of the loss at 8-row chunks
    assert seen == ["auto"] + list(settings) * 2  # the floor leaves it as it was


@pytest.mark.parametrize("round_index, want", [(0, [1, 2, 3]), (1, [2, 3, 1]), (5, [3, 1, 2])])
def test_rounds_rotate(round_index, want):
    assert rotated([1, 2, 3], round_index) == want
    assert rotated([], round_index) == []


def test_a_bad_argument_is_named(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--gemm", "262144by5376"])
    assert "expected VxH (e.g. 262144x5376), got '262144by5376'" in capsys.readouterr().err
