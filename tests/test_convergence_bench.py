"""The convergence benchmark on the tiny CPU build: trainings from one seed, the filter off and on, two of each."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_trained_inputs import TINY, tiny_sources  # noqa: E402

from flce_policy.benchmarks.convergence import build_parser, compare_arms, run_all  # noqa: E402
from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED  # noqa: E402

pytestmark = pytest.mark.skipif(
    not KERNELS_INTERPRETED, reason="the tiny build trains on the CPU, under the interpreter"
)


def test_two_runs_per_arm_from_one_seed():
    result = run_all(TINY.model_copy(update={"steps": 2}), 0.5, sources=tiny_sources, log=lambda _m: None)
    off1, on1, off2, on2 = result["runs"]
    assert [r["label"] for r in result["runs"]] == ["filter off #1", "filter on #1", "filter off #2", "filter on #2"]
    assert on1["options"] == on2["options"] == {"grad_weight_filter": 0.5}
    assert off1["options"] == off2["options"] == {}
    # on the CPU the same seed and batches give the same run twice: no noise
    assert off1["losses"] == off2["losses"] and on1["losses"] == on2["losses"]
    assert result["noise"] == 0.0 and result["standard_error"] == 0.0
    # the first step's loss comes before any update, so the filter cannot change it; at eps 0.5 it
    # drops most of grad_weight, so the updates after it differ
    assert on1["losses"][0] == off1["losses"][0]
    assert on1["losses"][1:] != off1["losses"][1:]
    assert result["filter_effect"] == on1["held_out_ce"] - off1["held_out_ce"] != 0.0
    assert result["within_noise"] is False


def test_compare_arms_against_hand_computed_statistics():
    runs = [
        {"options": {}, "held_out_ce": 2.90},
        {"options": {"grad_weight_filter": 0.1}, "held_out_ce": 2.93},
        {"options": {}, "held_out_ce": 2.94},
        {"options": {"grad_weight_filter": 0.1}, "held_out_ce": 2.95},
    ]
    result = compare_arms(runs)
    # off: mean 2.92, sample std sqrt(2 * 0.02**2 / 1) = 0.028284; on: mean 2.94, std 0.014142
    assert result["arms"]["off"]["mean"] == pytest.approx(2.92)
    assert result["arms"]["on"]["std"] == pytest.approx(0.0141421, rel=1e-5)
    assert result["noise"] == pytest.approx(0.0282843, rel=1e-5)
    assert result["filter_effect"] == pytest.approx(0.02)
    # standard error of the difference: sqrt(0.0282843**2 / 2 + 0.0141421**2 / 2) = 0.0223607
    assert result["standard_error"] == pytest.approx(0.0223607, rel=1e-5)
    assert result["within_noise"] is True  # 0.02 <= 2 * 0.0224
    moved = [{**run, "held_out_ce": run["held_out_ce"] + 0.07} if run["options"] else run for run in runs]
    result = compare_arms(moved)
    assert result["filter_effect"] == pytest.approx(0.09)
    assert result["within_noise"] is False  # 0.09 > 2 * 0.0224


def test_one_run_per_arm_is_refused():
    with pytest.raises(ValueError, match="runs_per_arm must be >= 2"):
        run_all(TINY, 0.5, runs_per_arm=1, sources=tiny_sources, log=lambda _m: None)


@pytest.mark.parametrize(
    ("text", "eps"),
    [("2**-16", 2.0**-16), ("1.52587890625e-05", 2.0**-16), ("2^-12", 2.0**-12), ("2**-13.5", 2.0**-13.5)],
)
def test_the_filter_option_reads_a_number_or_a_power_of_two(text, eps):
    assert build_parser().parse_args(["--out", "d", "--filter", text]).filter == eps


@pytest.mark.parametrize("text", ["0", "2**0", "-1", "x"])
def test_a_filter_that_filters_nothing_or_is_not_an_eps_is_refused(text, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--out", "d", "--filter", text])
    assert exit_info.value.code == 2
    assert "--filter" in capsys.readouterr().err


def test_the_rescue_reaches_the_filtered_arm_only():
    result = run_all(TINY.model_copy(update={"steps": 2}), 0.5, rescue=2, sources=tiny_sources, log=lambda _m: None)
    off1, on1, _, _ = result["runs"]
    assert on1["options"] == {"grad_weight_filter": 0.5, "grad_weight_filter_rescue": 2} and off1["options"] == {}
    assert result["rescue"] == 2
    assert build_parser().parse_args(["--out", "d", "--rescue", "16"]).rescue == 16
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--out", "d", "--rescue", "3"])
