"""Fastest under another strategy's memory: ``max_peak`` given as a strategy or its YAML mapping; shape sets."""

from __future__ import annotations

import pytest
import yaml

from flce_policy.benchmarks.suite import SHAPE_SETS, expand_shapes, parse_shapes
from flce_policy.engine.config import load_yaml_file, parse_config
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.memory import predict_peak
from flce_policy.plan.problem import Problem
from flce_policy.strategies import Fastest, HeuristicC, StrategyError, strategy_from_config

H200 = DeviceInfo.synthetic("H200")
SMALL_HEADS = [(16384, 896, 151936), (16384, 1152, 262144), (16384, 3072, 128256)]


@pytest.mark.parametrize("shape", SMALL_HEADS)
def test_pick_fits_under_liger_c16_peak_and_is_the_bytes_limit_pick(shape):
    problem = Problem(*shape, dtype="bfloat16")
    liger_peak = predict_peak(HeuristicC(16).geometry(problem, H200)).total_bytes
    pick = Fastest(max_slab="64GiB", max_peak=HeuristicC(16)).geometry(problem, H200)
    assert predict_peak(pick).total_bytes <= liger_peak
    # the same answer as the limit written out in bytes, and as the YAML mapping
    by_bytes = Fastest(max_slab="64GiB", max_peak=liger_peak).geometry(problem, H200)
    by_mapping = Fastest(max_slab="64GiB", max_peak={"strategy": "heuristic_c", "c": 16}).geometry(problem, H200)
    assert (pick.chunk_size, pick.vocab_chunk) == (by_bytes.chunk_size, by_bytes.vocab_chunk)
    assert (pick.chunk_size, pick.vocab_chunk) == (by_mapping.chunk_size, by_mapping.vocab_chunk)


def test_a_smaller_peak_strategy_gives_a_smaller_pick():
    problem = Problem(16384, 896, 151936, dtype="bfloat16")
    loose = Fastest(max_slab="64GiB", max_peak=HeuristicC(16)).geometry(problem, H200)
    tight = Fastest(max_slab="64GiB", max_peak=HeuristicC(1)).geometry(problem, H200)
    assert predict_peak(tight).total_bytes < predict_peak(loose).total_bytes


def test_mapping_round_trips_through_yaml():
    strategy = Fastest(max_slab="64GiB", max_peak={"strategy": "heuristic_c", "c": 16})
    config = yaml.safe_load(yaml.safe_dump(strategy.to_config()))
    assert config["max_peak"] == {"strategy": "heuristic_c", "c": 16}
    assert strategy_from_config(config) == strategy


def test_object_writes_itself_as_a_mapping():
    assert Fastest(max_peak=HeuristicC(16)).to_config()["max_peak"] == {"strategy": "heuristic_c", "c": 16}


@pytest.mark.parametrize(
    "max_peak, message",
    [
        ({"strategy": "heuristic_c", "c": 0}, r"fastest: max_peak\.c: c must be a positive integer, got 0"),
        ({"strategy": "no_such"}, r"fastest: max_peak: .*no_such"),
        ("lots", r"fastest: max_peak: cannot parse 'lots'"),
    ],
)
def test_bad_max_peak_names_the_parameter(max_peak, message):
    with pytest.raises(StrategyError, match=message):
        Fastest(max_peak=max_peak).validate_params()


def test_policy_file_with_a_strategy_peak(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\ndefault:\n  strategy: fastest\n  max_slab: 64GiB\n  max_peak: {strategy: heuristic_c, c: 16}\n"
    )
    config = parse_config(load_yaml_file(path))
    problem = Problem(16384, 1024, 131072, dtype="bfloat16")
    geometry = config.default.geometry(problem, H200)
    assert predict_peak(geometry).total_bytes <= predict_peak(HeuristicC(16).geometry(problem, H200)).total_bytes


def test_policy_file_with_a_bad_strategy_peak_names_the_path(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\ndefault:\n  strategy: fastest\n  max_peak: {strategy: heuristic_c, c: -1}\n")
    with pytest.raises(ValueError, match=r"default\.max_peak\.c"):
        parse_config(load_yaml_file(path))


# --- shape sets ------------------------------------------------------------------------------------


def test_small_heads_set_is_the_six_issue_shapes():
    assert parse_shapes("small-heads") == (
        (16384, 896, 151936),
        (16384, 1024, 131072),
        (16384, 1152, 262144),
        (16384, 2048, 128256),
        (16384, 2048, 151936),
        (16384, 3072, 128256),
    )
    assert parse_shapes("Large-Heads") == SHAPE_SETS["large-heads"]


def test_expand_shapes_keeps_order_and_drops_repeats():
    values = [parse_shapes("8192x5376x262144"), parse_shapes("large-heads")]
    assert expand_shapes(values) == [(8192, 5376, 262144), (32768, 5376, 262144), (32768, 4096, 128256)]
    assert expand_shapes(None) == list(SHAPE_SETS["default"])


def test_unknown_set_lists_the_sets():
    with pytest.raises(ValueError, match="small-heads"):
        parse_shapes("tiny-heads")
