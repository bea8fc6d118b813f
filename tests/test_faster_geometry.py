"""explain's hint: a geometry predicted faster than the chosen one in no more slab or peak memory."""

import json

import pytest

from flce_policy import FLCEPolicy, Problem
from flce_policy.benchmarks.suite import SHAPE_SETS
from flce_policy.cli import main
from flce_policy.engine.faster_geometry import HINT_MARGIN, faster_within
from flce_policy.plan.cost_model import predict_seconds, rates_for
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.memory import predict_peak
from flce_policy.plan.units import parse_bytes
from flce_policy.strategies import Fastest, FixedChunkSize, SlabBudget

GEMMA = Problem(8192, 5376, 262144)
H100 = DeviceInfo.synthetic("H100")


def _chosen(strategy, problem=GEMMA, device=H100):
    """The geometry a policy of ``strategy`` runs (the engine's slab form on its rows) and the rule's strategy."""
    policy = FLCEPolicy(default=strategy)
    return policy.resolve(problem, device), policy.resolve_rule(device)[1]


def test_a_128mib_slab_of_the_gemma_head_gets_vocab_tiles_within_its_slab_and_peak():
    # measured on the H100: all rows over 8192-column tiles 1.446x the floor against 256-row chunks' 1.518x
    chosen, strategy = _chosen(SlabBudget("128MiB"))
    assert chosen.chunk_size == 256 and chosen.is_row_only
    hint = faster_within(chosen, strategy, H100)
    assert hint is not None
    faster = hint.geometry
    assert not faster.is_row_only  # vocab tiles
    assert faster.slab_bytes <= chosen.slab_bytes == 128 * 2**20
    assert predict_peak(faster).total_bytes <= predict_peak(chosen).total_bytes
    rates = rates_for(H100)
    assert hint.chosen_s == predict_seconds(chosen, rates).seconds
    assert hint.predicted_s == predict_seconds(faster, rates).seconds <= hint.chosen_s * (1 - HINT_MARGIN)


def test_the_hints_strategy_picks_the_hinted_geometry_and_its_limits_are_exact():
    chosen, strategy = _chosen(FixedChunkSize(256))
    hint = faster_within(chosen, strategy, H100)
    assert hint is not None
    again = hint.strategy.geometry(GEMMA, H100)
    assert (again.chunk_size, again.vocab_chunk, again.slab_form) == (
        hint.geometry.chunk_size,
        hint.geometry.vocab_chunk,
        hint.geometry.slab_form,
    )
    assert parse_bytes(hint.strategy.max_peak) == predict_peak(chosen).total_bytes
    assert parse_bytes(hint.strategy.max_slab) == chosen.slab_bytes


def test_fp32_accumulation_is_kept_in_the_hint():
    policy = FLCEPolicy(default=Fastest(max_slab="128MiB", accum="fp32"))
    fastest_fp32 = policy.resolve(GEMMA, H100)
    chosen = _chosen(FixedChunkSize(256))[0]
    fp32_rows = chosen.__class__.for_problem(GEMMA, 256, accum_dtype="float32", slab_form=chosen.slab_form)
    hint = faster_within(fp32_rows, FixedChunkSize(256), H100)
    assert hint is not None and hint.strategy.accum == "fp32"
    assert hint.geometry.accum_dtype == fastest_fp32.accum_dtype == "float32"


@pytest.mark.parametrize("family", ["H100", "H200"])
@pytest.mark.parametrize("shape", [*SHAPE_SETS["small-heads"], *SHAPE_SETS["large-heads"]])
def test_the_packaged_rules_of_the_measured_gpus_get_no_hint(family, shape):
    device = DeviceInfo.synthetic(family)
    problem = Problem(*shape)
    policy = FLCEPolicy.packaged()
    geometry = policy.resolve(problem, device)
    assert faster_within(geometry, policy.resolve_rule(device)[1], device) is None


def test_a_large_slab_already_fastest_gets_no_hint():
    chosen, strategy = _chosen(SlabBudget("2GiB"))
    assert faster_within(chosen, strategy, H100) is None


@pytest.mark.parametrize(
    "case",
    ["cpu", "fastest", "filter", "side stream", "tensor parallel"],
)
def test_no_hint_where_the_cost_model_does_not_price_the_alternative(case):
    strategy, problem, device = FixedChunkSize(256), GEMMA, H100
    if case == "cpu":
        device = DeviceInfo.cpu()
    elif case == "fastest":
        # its own rates (as `tune` writes them) chose 256 rows: the family's rates must not second-guess them
        strategy = Fastest(max_slab="128MiB", rates={"matmul_flops": 7e14, "hbm_bytes_per_s": 1e14})
    elif case == "tensor parallel":
        problem = Problem(8192, 5376, 262144, tp_size=2)
    geometry = strategy.geometry(problem, device)
    if case == "filter":
        geometry = geometry.with_filter(2.0**-13)
    elif case == "side stream":
        geometry = geometry.with_overlap_weight_grad()
    assert faster_within(geometry, strategy, device) is None


def test_explain_prints_the_hint_and_its_json_key(capsys):
    args = ["--model", "gemma-4-31b", "--tokens", "8192", "--device", "H100", "--strategy", "slab_budget"]
    assert main(["explain", *args, "--param", "max_slab=128MiB"]) == 0
    text = capsys.readouterr().out
    assert "Faster:" in text and "vocab tiles of" in text and "Fastest(max_slab='128MiB'" in text
    assert main(["explain", *args, "--param", "max_slab=128MiB", "--json"]) == 0
    faster = json.loads(capsys.readouterr().out)["faster_within"]
    assert faster["strategy"] == "fastest" and faster["slab_bytes"] <= 128 * 2**20
    assert faster["vocab_chunk"] < 262144 and faster["params"]["max_slab"] == "128MiB"
    assert main(["explain", *args, "--param", "max_slab=2GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["faster_within"] is None
    assert main(["explain", *args, "--param", "max_slab=2GiB"]) == 0
    assert "Faster:" not in capsys.readouterr().out
