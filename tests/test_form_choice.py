"""The slab form follows the GPU whatever decides the rows: every strategy, a subclass, a pin, each fallback.

Synthetic devices stand for each architecture: sm_80 (A100), sm_89 (L40S), sm_90 (H100, H200) and sm_100 (B200).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flce_policy import DeviceInfo, DeviceRule, FLCEPolicy, Geometry, Problem
from flce_policy.engine.planned import planned_geometry
from flce_policy.engine.strategy_cache import clear_strategy_cache, strategy_geometry
from flce_policy.plan.cost_model import form_ratio_error, predict_seconds, rates_for
from flce_policy.plan.form_choice import choose_slab_form, pinned_slab_form, slab_form_candidates
from flce_policy.plan.scaled_exp import call_routing, row_scaled
from flce_policy.strategies import (
    ByHidden,
    ChunkStrategy,
    Fastest,
    FixedChunkSize,
    HeuristicC,
    ScaledExp,
    SlabBudget,
    StrategyError,
)

SMALL_HEAD = Problem(16384, 1024, 131072)  # a 0.5B-class head: the logits traffic dwarfs the epilogue's cost
WIDER_HEAD = Problem(16384, 2048, 128256)  # a 1B-3B head
GEMMA = Problem(8192, 5376, 262144)
H100_RUN = Path(__file__).resolve().parents[1] / "results/2026-12-05-h100/bench.json"


class EveryThousandRows(ChunkStrategy):
    """A user's strategy: it decides rows only."""

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return 4096


STRATEGIES = [
    HeuristicC(c=16),
    FixedChunkSize(4096),
    SlabBudget("1GiB"),
    ByHidden(3072, small={"strategy": "slab_budget", "max_slab": "5GiB"}, large=SlabBudget("2GiB")),
    EveryThousandRows(),
]


@pytest.mark.parametrize("family", ["A100", "L40S"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
def test_before_hopper_every_strategy_runs_the_logits_slab(family, strategy):
    device = DeviceInfo.synthetic(family)
    geometry = planned_geometry(strategy, SMALL_HEAD, device)
    assert geometry.slab_form == "logits"
    capability = "".join(map(str, device.compute_capability))
    assert f"sm_{capability} has no TMA" in slab_form_candidates(geometry, device)["scaled_exp_rows"]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize(
    ("family", "problem", "form"),
    [
        ("H100", SMALL_HEAD, "scaled_exp_ws"),
        ("H800", SMALL_HEAD, "scaled_exp_ws"),
        ("H200", SMALL_HEAD, "scaled_exp_ws"),
        ("H100", WIDER_HEAD, "scaled_exp_rows"),  # over the H100's ws_max_hidden: the Triton GEMM
        ("H200", WIDER_HEAD, "scaled_exp_ws"),
    ],
)
def test_on_hopper_every_strategy_gets_the_fastest_form(strategy, family, problem, form):
    device = DeviceInfo.synthetic(family)
    geometry = planned_geometry(strategy, problem, device)
    assert geometry.slab_form == form
    assert geometry.chunk_size == strategy.geometry(problem, device).chunk_size  # the rows stay the strategy's


def test_the_pick_is_the_fastest_predicted_form_at_the_rows():
    device, rates = DeviceInfo.synthetic("H100"), rates_for(DeviceInfo.synthetic("H100"))
    for problem in (SMALL_HEAD, GEMMA):
        for rows in (512, 4096):
            geometry = Geometry.for_problem(problem, rows)
            choice = choose_slab_form(geometry, device, rates)
            times = {
                form: predict_seconds(geometry.with_slab_form(form), rates).seconds
                for form, why_not in slab_form_candidates(geometry, device).items()
                if why_not is None
            }
            assert times[choice.slab_form] == min(times.values()), (problem, rows, times)


def test_the_h100_picks_the_form_its_measurements_found_faster():
    # the H100's terms are fitted to this sweep; the test holds them to it: a retuned term that picks the slower
    # form where it costs more than 1% of the sweep's time fails, as does losing the row-scaled form at 512 rows
    # of the Gemma-4 head (1.199x against the logits slab's 1.215x there)
    from flce_policy.benchmarks.suite import Record
    from flce_policy.cli.tune import form_pairs

    device = DeviceInfo.synthetic("H100")
    rates = rates_for(device)
    documents = json.loads(H100_RUN.read_text())["slab_forms_2026_12_06"].values()
    pairs = form_pairs(Record.from_dict(record) for document in documents for record in document["records"])
    assert len(pairs) == 54  # nine shapes x (256 to 4096 rows and one chunk)
    lost = best = 0.0
    for pair in pairs:
        times = {"logits": pair.logits_seconds, "scaled_exp_rows": pair.scaled_exp_seconds}
        # the faster predicted of the two forms measured (the Gluon GEMM's form, not in this sweep, aside)
        picked = min(times, key=lambda form: predict_seconds(pair.logits.with_slab_form(form), rates).seconds)
        lost += times[picked] - min(times.values())
        best += min(times.values())
    assert lost <= 0.01 * best, (lost, best)
    # how much faster one form is than the other, as measured: within 2.5% on average (an epilogue priced as a share
    # of the GEMM, not per logit, was 3.4% off, 13% at the smallest heads)
    assert form_ratio_error(pairs, rates) <= 0.025
    assert planned_geometry(FixedChunkSize(512), GEMMA, device).slab_form == "scaled_exp_rows"


def test_blackwell_runs_the_triton_form_never_the_hopper_only_gemm():
    device = DeviceInfo.synthetic("B200")
    assert device.compute_capability >= (10, 0)
    geometry = planned_geometry(FixedChunkSize(4096), SMALL_HEAD, device)
    assert geometry.slab_form == "scaled_exp_rows"
    assert "Hopper's (sm_90)" in slab_form_candidates(geometry, device)["scaled_exp_ws"]
    pinned = pinned_slab_form("scaled_exp_ws", geometry, device)
    assert pinned.slab_form == "scaled_exp_rows" and "sm_100" in pinned.reason


def test_each_hopper_runs_the_warp_specialised_gemm_up_to_its_measured_hidden_size():
    small = Geometry.for_problem(SMALL_HEAD, 4096)
    for family in ("H100", "H800", "H200"):  # the H800 is the H100's chip: its measurements stand for it
        assert slab_form_candidates(small, DeviceInfo.synthetic(family))["scaled_exp_ws"] is None
    wider = Geometry.for_problem(WIDER_HEAD, 4096)
    for family in ("H100", "H800"):
        assert "H=2048 is above 1152" in slab_form_candidates(wider, DeviceInfo.synthetic(family))["scaled_exp_ws"]
    assert rates_for(DeviceInfo.synthetic("H800")) == rates_for(DeviceInfo.synthetic("H100"))
    assert slab_form_candidates(wider, DeviceInfo.synthetic("H200"))["scaled_exp_ws"] is None
    large = Geometry.for_problem(Problem(16384, 4096, 131072), 4096)
    assert "above 3072" in slab_form_candidates(large, DeviceInfo.synthetic("H200"))["scaled_exp_ws"]


@pytest.mark.parametrize(
    ("problem", "vocab_chunk", "why"),
    [
        (Problem(4096, 1024, 32768, dtype="float32"), None, "float32 logits"),
        (Problem(4096, 1024, 32768), 8192, "vocab tiles"),
        (Problem(4096, 1024, 32768, tp_size=2), None, "vocab-parallel shard"),
        (Problem(4096, 1020, 32768), None, "TMA loads rows"),
    ],
)
def test_problems_the_scaled_exp_slab_cannot_run_fall_back_to_logits(problem, vocab_chunk, why):
    device = DeviceInfo.synthetic("H100")
    geometry = Geometry.for_problem(problem, 1024, vocab_chunk=vocab_chunk)
    assert why in slab_form_candidates(geometry, device)["scaled_exp_rows"]
    assert choose_slab_form(geometry, device, rates_for(device)).slab_form == "logits"
    assert pinned_slab_form("scaled_exp_rows", geometry, device).slab_form == "logits"


def test_calls_the_slab_cannot_serve_take_their_forms_at_call_time():
    assert call_routing(None) is None
    assert call_routing(30.0, row_scaled=True) is None  # the row-scaled form caps its logits in fp32
    assert call_routing(32.0, row_scaled=True) is None
    assert "over 32" in call_routing(32.5, row_scaled=True)
    assert "outside the row-scaled form" in call_routing(30.0)
    assert "eager" in call_routing(30.0, row_scaled=True, eager_rounding=True)
    assert "argmax" in call_routing(30.0, row_scaled=True, argmax_or_entropy=True)
    assert row_scaled("scaled_exp_rows", bias=False, label_smoothing=0.0)
    assert not row_scaled("scaled_exp_rows", bias=True, label_smoothing=0.0)  # a bias: the per-tile form
    assert not row_scaled("scaled_exp_rows", bias=False, label_smoothing=0.1)  # label smoothing: per tile
    assert not row_scaled("scaled_exp_rows", bias=False, label_smoothing=0.0, dtype="float16")


def test_a_rule_pins_a_form_and_explain_says_why():
    device = DeviceInfo.synthetic("H100")
    pinned = FLCEPolicy(rules=[DeviceRule("H100", FixedChunkSize(4096), slab_form="logits")])
    free = FLCEPolicy(rules=[DeviceRule("H100", FixedChunkSize(4096))])
    assert pinned.resolve(SMALL_HEAD, device).slab_form == "logits"
    assert free.resolve(SMALL_HEAD, device).slab_form == "scaled_exp_ws"
    assert pinned.explain_dict(SMALL_HEAD, device)["slab_form_reason"] == "pinned"
    assert free.explain_dict(SMALL_HEAD, device)["slab_form_reason"].startswith("fastest predicted at 4096 rows")
    assert "Form:        scaled_exp_ws: fastest predicted" in free.explain(SMALL_HEAD, device)


def test_the_pin_reads_and_writes_yaml_and_a_bad_one_is_named():
    text = "version: 1\ndevices:\n  - {match: H100, strategy: fixed_chunk_size, chunk_size: 4096, slab_form: logits}\n"
    policy = FLCEPolicy.from_yaml_text(text)
    assert policy.rules[0].slab_form == "logits"
    assert FLCEPolicy.from_dict(policy.to_dict()) == policy
    with pytest.raises(ValueError, match=r"devices\[0\]\.slab_form: .*one of logits, scaled_exp"):
        FLCEPolicy.from_yaml_text(text.replace("slab_form: logits", "slab_form: fast"))


def test_fastest_takes_the_pin_as_its_own_parameter():
    text = "version: 1\ndevices:\n  - {match: H100, strategy: fastest, max_slab: 1GiB, slab_form: logits}\n"
    policy = FLCEPolicy.from_yaml_text(text)
    assert policy.rules[0].strategy.slab_form == "logits" and policy.rules[0].slab_form is None
    assert policy.resolve(SMALL_HEAD, DeviceInfo.synthetic("H100")).slab_form == "logits"


def test_fastest_prices_every_form_the_gpu_runs():
    device = DeviceInfo.synthetic("H100")
    forms = {g.slab_form for g in Fastest(max_slab="4GiB").candidates(SMALL_HEAD, device) if g.is_row_only}
    assert forms == {"logits", "scaled_exp_rows", "scaled_exp_ws"}
    forms = {g.slab_form for g in Fastest(max_slab="4GiB").candidates(WIDER_HEAD, device) if g.is_row_only}
    assert forms == {"logits", "scaled_exp_rows"}  # over the H100's ws_max_hidden
    assert {g.slab_form for g in Fastest(max_slab="4GiB").candidates(SMALL_HEAD, DeviceInfo.synthetic("A100"))} == {
        "logits"
    }


def test_a_strategy_that_chose_its_form_keeps_it():
    device = DeviceInfo.synthetic("H200")
    per_tile = ScaledExp(FixedChunkSize(4096))  # the per-tile scaled-exp slab, asked for by the strategy
    assert planned_geometry(per_tile, SMALL_HEAD, device).slab_form == "scaled_exp"


def test_a_strategy_given_to_the_loss_gets_the_form_too():
    clear_strategy_cache()
    assert strategy_geometry(SlabBudget("1GiB"), SMALL_HEAD, DeviceInfo.synthetic("H100")).slab_form == "scaled_exp_ws"
    assert strategy_geometry(SlabBudget("1GiB"), WIDER_HEAD, DeviceInfo.synthetic("H100")).slab_form == (
        "scaled_exp_rows"
    )


def test_the_cpu_runs_the_logits_slab_unless_a_form_is_pinned():
    cpu = DeviceInfo.cpu()
    assert planned_geometry(FixedChunkSize(4096), SMALL_HEAD, cpu).slab_form == "logits"
    pinned = planned_geometry(FixedChunkSize(4096), SMALL_HEAD, cpu, slab_form="scaled_exp_rows")
    assert pinned.slab_form == "scaled_exp_rows"


def test_by_hidden_splits_at_its_hidden_size_and_round_trips():
    strategy = ByHidden(3072, small=SlabBudget("5GiB"), large={"strategy": "slab_budget", "max_slab": "2GiB"})
    device = DeviceInfo.synthetic("H100")
    assert strategy.geometry(Problem(16384, 3072, 131072), device).chunk_size == 16384  # 4 GiB within 5
    assert strategy.geometry(Problem(16384, 3080, 131072), device).chunk_size == 8192  # 2 GiB
    policy = FLCEPolicy(rules=[DeviceRule("H100", strategy)])
    assert FLCEPolicy.from_yaml_text(policy.to_yaml()) == policy
    with pytest.raises(StrategyError, match="max_hidden must be a positive integer"):
        ByHidden(0, small=SlabBudget("1GiB"), large=SlabBudget("1GiB")).validate_params()
    with pytest.raises(StrategyError, match="small must be a strategy"):
        ByHidden(3072, small=None, large=SlabBudget("1GiB")).validate_params()


def test_the_loss_keyword_pins_the_form_of_one_call():
    import torch

    from flce_policy import fused_linear_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    w = (torch.randn(256, 32) * 0.5).to(torch.bfloat16)
    y = torch.randint(0, 256, (64,))
    reference = torch.nn.functional.cross_entropy(x.float() @ w.float().t(), y)

    def run(**kwargs):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fused_linear_cross_entropy(xs, ws, y, **kwargs)
        loss.backward()
        return loss.detach(), xs.grad, ws.grad

    strategy = FixedChunkSize(16)
    keyword = run(policy=strategy, slab_form="scaled_exp_rows")
    policy_pin = run(policy=FLCEPolicy(default=strategy, slab_form="scaled_exp_rows"))
    logits = run(policy=strategy)  # the CPU's own pick: the logits slab
    for got, want in zip(keyword, policy_pin, strict=True):
        assert torch.equal(got, want)
    assert not all(torch.equal(a, b) for a, b in zip(keyword[1:], logits[1:], strict=True))  # another form ran
    assert torch.allclose(keyword[0], reference, rtol=2e-2)
    with pytest.raises(ValueError, match="slab_form must be one of logits"):
        run(policy=strategy, slab_form="exp")
