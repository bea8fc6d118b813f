"""The cost model against the H200 measurements committed in results/, and the Fastest strategy.

The measured file is the one the benchmark wrote on the H200; the model is never fitted to it in
the test (its rates are the module's constants), so a model change that stops describing the
measurements fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flce_policy import DeviceInfo, Geometry, Problem
from flce_policy.plan.cost_model import RATES, DeviceRates, predict_seconds
from flce_policy.strategies import Fastest, StrategyError, strategy_from_config

MEASURED = Path(__file__).resolve().parents[1] / "results/2026-11-29-h200-vocab-tiled/bench.json"
H200 = DeviceInfo.synthetic("H200")
GIB, MIB = 2**30, 2**20


def measured_rows():
    """(geometry, accum, measured ms) for every row of ours in the committed H200 run."""
    rows = []
    for record in json.loads(MEASURED.read_text())["records"]:
        name = record["method"]
        if not name.startswith("ours_") or name.startswith("ours_default") or record["median_ms"] is None:
            continue
        problem = Problem(*record["shape"])
        geometry = Geometry.for_problem(problem, record["chunk_size"], vocab_chunk=record["vocab_chunk"])
        rows.append((geometry, "float32" if record["accum"] == "fp32" else None, record["median_ms"]))
    return rows


def test_model_describes_every_measured_row_within_12_percent():
    rows = measured_rows()
    assert len(rows) == 69  # 3 shapes x (2 x 6 row-only + 4 vocab-tiled + 7 Fastest picks)
    for geometry, accum, measured_ms in rows:
        predicted_ms = predict_seconds(geometry, RATES["H200"], accum_dtype=accum).seconds * 1e3
        assert abs(predicted_ms / measured_ms - 1) <= 0.12, (geometry.describe(), accum, measured_ms, predicted_ms)


@pytest.mark.parametrize("max_slab", [128 * MIB, 256 * MIB, 512 * MIB, GIB, 2 * GIB, 4 * GIB, 64 * GIB])
@pytest.mark.parametrize("accum", [None, "float32"])
def test_the_predicted_fastest_is_within_10_percent_of_the_measured_fastest(max_slab, accum):
    by_shape: dict = {}
    for geometry, row_accum, measured_ms in measured_rows():
        # fp32-accurate picks: fp32-accumulated rows, and vocab tiles over one row chunk (no accumulator)
        fits_accum = row_accum == accum or (accum == "float32" and not geometry.is_row_only)
        if fits_accum and geometry.slab_bytes <= max_slab:
            by_shape.setdefault(geometry.problem, []).append((geometry, row_accum, measured_ms))
    assert by_shape
    for rows in by_shape.values():
        fastest_ms = min(ms for _, _, ms in rows)
        picked = min(rows, key=lambda r: predict_seconds(r[0], RATES["H200"], accum_dtype=r[1]).seconds)
        assert picked[2] <= 1.10 * fastest_ms, (picked[0].describe(), picked[2], fastest_ms)


def test_fastest_stays_within_the_slab_and_peak_limits():
    problem = Problem(32768, 5376, 262144)
    strategy = Fastest(max_slab="256MiB", accum="fp32", max_peak="4GiB")
    geometry = strategy.geometry(problem, H200)
    assert geometry.slab_bytes <= 256 * MIB
    # fp32 accuracy in 4 GiB leaves no room for a [V, H] fp32 accumulator: one row chunk, vocab tiles
    assert geometry.num_chunks == 1 and not geometry.is_row_only


def test_free_memory_traffic_makes_three_gemms_win():
    # With HBM traffic free, row chunks cost only their three GEMMs; vocab tiles pay a fourth.
    problem = Problem(8192, 4096, 65536)
    strategy = Fastest(max_slab="64MiB", rates={"matmul_flops": 6.6e14, "hbm_bytes_per_s": 1e30})
    geometry = strategy.geometry(problem, H200)
    assert geometry.is_row_only


def test_slow_memory_makes_vocab_tiles_win_under_a_small_slab():
    # Row chunks of a 64 MiB slab re-write grad_weight 32 times; with slow HBM that dominates.
    problem = Problem(8192, 4096, 65536)
    strategy = Fastest(max_slab="64MiB", rates={"matmul_flops": 6.6e14, "hbm_bytes_per_s": 5e11})
    geometry = strategy.geometry(problem, H200)
    assert not geometry.is_row_only


def test_yaml_round_trip_and_rule_provenance():
    strategy = Fastest(
        max_slab="512MiB", accum="fp32", max_peak="6GiB", rates={"matmul_flops": 1e15, "hbm_bytes_per_s": 8e12}
    )
    assert strategy_from_config(strategy.to_config()) == strategy
    geometry = strategy.geometry(Problem(8192, 5376, 262144), H200, rule="devices[0] (match H200)")
    assert geometry.rule == "devices[0] (match H200)" and geometry.strategy.startswith("Fastest(")


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"accum": "fp16"}, "accum"),
        ({"max_slab": "lots"}, "max_slab"),
        ({"max_slab": 0}, "max_slab"),
        ({"max_peak": "-1GiB"}, "max_peak"),
        ({"rates": {"flops": 1.0}}, "rates"),
        ({"slab_form": "exp"}, "slab_form"),
        ({"chunk_multiple": 0}, "chunk_multiple"),
        ({"chunk_multiple": True}, "chunk_multiple"),
    ],
)
def test_bad_parameters_name_the_parameter(kwargs, param):
    with pytest.raises(StrategyError) as err:
        Fastest(**kwargs).geometry(Problem(1024, 1024, 32768), H200)
    assert err.value.param == param and param in str(err.value)


def test_unreachable_limits_say_so():
    # the two bf16 gradients alone are 2.95 GiB
    with pytest.raises(StrategyError, match="max_peak"):
        Fastest(max_slab="256MiB", accum="fp32", max_peak="2.9GiB").geometry(Problem(32768, 5376, 262144), H200)


def test_fp32_accuracy_at_the_memory_of_the_bf16_gradients():
    # 5 GiB under liger-kernel's fp32 accumulation (8.20 GiB measured at this shape)
    problem = Problem(32768, 5376, 262144)
    geometry = Fastest(max_slab="256MiB", accum="fp32", max_peak="3276MiB").geometry(problem, H200)
    assert geometry.num_chunks == 1 and not geometry.is_row_only


def test_rates_table_has_the_h200_calibrated_on_the_committed_run():
    from flce_policy.benchmarks.suite import Record
    from flce_policy.cli.tune import calibrate

    records = [Record.from_dict(r) for r in json.loads(MEASURED.read_text())["records"]]
    fitted, _ = calibrate(records, H200)
    table = RATES["H200"]
    assert fitted.matmul_flops == pytest.approx(table.matmul_flops, rel=0.005)
    assert fitted.hbm_bytes_per_s == pytest.approx(table.hbm_bytes_per_s, rel=0.005)
    # the H100's GEMM and HBM rates derived by datasheet ratios (its scaled-exp terms: tests/test_form_choice.py)
    assert RATES["H100"].matmul_flops == pytest.approx(table.matmul_flops)
    assert RATES["H100"].hbm_bytes_per_s == pytest.approx(table.hbm_bytes_per_s * 3.35 / 4.8)


def test_explain_predicts_with_the_accumulation_and_rates_the_strategy_planned():
    from flce_policy import FLCEPolicy
    from flce_policy.engine.policy import DeviceRule
    from flce_policy.plan.memory import predict_peak

    problem = Problem(32768, 5376, 262144)
    rates = {"matmul_flops": 5e14, "hbm_bytes_per_s": 3e12}
    strategy = Fastest(max_slab="256MiB", accum="fp32", rates=rates)
    d = FLCEPolicy(rules=[DeviceRule("H200", strategy)]).explain_dict(problem, H200)
    geometry = strategy.geometry(problem, H200)
    assert geometry.num_chunks > 1  # several row chunks: an fp32 [V, H] accumulator, then one cast
    assert d["accum_dtype"] == "float32" and d["rates"] == rates
    assert d["predicted_peak_bytes"] == predict_peak(geometry, accum_dtype="float32").total_bytes
    assert d["predicted_peak_bytes"] > problem.vocab * problem.hidden * 4  # the fp32 buffer is counted
    assert d["predicted_ms"] == pytest.approx(
        predict_seconds(geometry, DeviceRates(**rates), accum_dtype="float32").seconds * 1e3, abs=1e-3
    )
    assert d["weight_grad_low_precision_steps"] == 1


@pytest.mark.parametrize(
    ("rates", "param", "fragment"),
    [
        ({"matmul_flops": -7e14, "hbm_bytes_per_s": 4.6e12}, "rates.matmul_flops", "must be finite and positive"),
        ({"matmul_flops": 7e14, "hbm_bytes_per_s": 0}, "rates.hbm_bytes_per_s", "must be finite and positive, got 0"),
        ({"matmul_flops": "fast", "hbm_bytes_per_s": 4.6e12}, "rates.matmul_flops", "must be a number, got 'fast'"),
        ({"matmul_flops": float("inf"), "hbm_bytes_per_s": 4.6e12}, "rates.matmul_flops", "finite"),
        ({"matmul_flops": float("nan"), "hbm_bytes_per_s": 4.6e12}, "rates.matmul_flops", "finite"),
        ({"matmul_flops": True, "hbm_bytes_per_s": 4.6e12}, "rates.matmul_flops", "must be a number"),
        ({"matmul_flops": 7e14, "hbm_bytes_per_s": 4.6e12, "ce_efficiency": 1.5}, "rates.ce_efficiency", "(0, 1]"),
        ({"matmul_flops": 7e14}, "rates", "missing hbm_bytes_per_s"),
        ([7e14, 4.6e12], "rates", "rates must be a mapping"),
        (
            {"matmul_flops": 7e14, "hbm_bytes_per_s": 4.6e12, "scaled_exp_epilogue_flops": -1},
            "rates.scaled_exp_epilogue_flops",
            "must be finite and >= 0, got -1",
        ),
    ],
)
def test_bad_rates_name_the_rate(rates, param, fragment):
    with pytest.raises(StrategyError) as err:
        strategy_from_config({"strategy": "fastest", "rates": rates})
    assert err.value.param == param
    assert f"fastest: {param}" in str(err.value) and fragment in str(err.value)


def test_rates_written_as_yaml_reads_them_are_numbers():
    # YAML 1.1 reads 7.0e14 (no sign in the exponent) as a string: taken as the number it spells
    import yaml

    written = yaml.safe_load("{matmul_flops: 7.0e14, hbm_bytes_per_s: 4.6e12}")
    assert written == {"matmul_flops": "7.0e14", "hbm_bytes_per_s": "4.6e12"}
    problem = Problem(4096, 4096, 128256)
    as_strings = Fastest(max_slab="256MiB", rates=written)
    as_numbers = Fastest(max_slab="256MiB", rates={"matmul_flops": 7.0e14, "hbm_bytes_per_s": 4.6e12})
    assert as_strings.planned_rates(H200) == DeviceRates(7.0e14, 4.6e12)
    picked = [s.geometry(problem, H200) for s in (as_strings, as_numbers)]
    assert picked[0].chunk_size == picked[1].chunk_size and picked[0].vocab_chunk == picked[1].vocab_chunk


def test_an_epilogue_of_nothing_is_a_rate_it_takes():
    # a GPU whose exp epilogue hides under its GEMM: 0 FLOPs a logit is a value, not a missing rate
    rates = {"matmul_flops": 7e14, "hbm_bytes_per_s": 4.6e12, "scaled_exp_epilogue_flops": 0}
    assert Fastest(max_slab="256MiB", rates=rates).planned_rates(H200).scaled_exp_epilogue_flops == 0.0


def test_rates_so_small_that_every_prediction_overflows_are_refused():
    strategy = Fastest(rates={"matmul_flops": 1e-300, "hbm_bytes_per_s": 1e-300})
    with pytest.raises(StrategyError, match="overflows") as err:
        strategy.geometry(Problem(1024, 1024, 32768), H200)
    assert err.value.param == "rates"


@pytest.mark.parametrize("shape", [(16384, 1024, 131072), (16384, 2048, 128256), (8192, 5376, 262144)])
def test_within_a_peak_on_the_row_scaled_slab(shape):
    """The row-scaled slab within Liger C=16's predicted peak: its partials and scaled x_c count, so the largest
    multiple of 128 rows that fits is below Liger's chunk, and 128 rows more would not fit (by hand, the memory
    model); without chunk_multiple the largest power of two that fits."""
    from flce_policy.plan.memory import predict_peak
    from flce_policy.strategies import HeuristicC

    problem = Problem(*shape)
    limit = predict_peak(HeuristicC(16).geometry(problem, H200)).total_bytes
    fitted = Fastest(max_slab="64GiB", max_peak=HeuristicC(16), slab_form="scaled_exp_rows", chunk_multiple=128)
    geometry = fitted.geometry(problem, H200)
    assert geometry.slab_form == "scaled_exp_rows" and geometry.chunk_size % 128 == 0
    assert predict_peak(geometry).total_bytes <= limit
    one_more = Geometry.for_problem(problem, geometry.chunk_size + 128, slab_form="scaled_exp_rows")
    assert predict_peak(one_more).total_bytes > limit
    powers = Fastest(max_slab="64GiB", max_peak=HeuristicC(16), slab_form="scaled_exp_rows").geometry(problem, H200)
    assert powers.chunk_size & (powers.chunk_size - 1) == 0 and powers.chunk_size < geometry.chunk_size


def test_slab_form_only_where_it_runs():
    problem = Problem(16384, 1024, 131072)
    strategy = Fastest(max_slab="1GiB", slab_form="scaled_exp_rows")
    assert strategy.geometry(problem, DeviceInfo.synthetic("A100")).slab_form == "logits"  # no TMA before Hopper
    assert strategy.geometry(Problem(16384, 1024, 131072, "float32"), H200).slab_form == "logits"
    assert strategy.geometry(problem, H200).slab_form == "scaled_exp_rows"
    config = strategy_from_config({**strategy.to_config(), "chunk_multiple": 128}).to_config()
    assert config["slab_form"] == "scaled_exp_rows" and config["chunk_multiple"] == 128
