"""grad_weight_filter as an option: bad values refused, a policy rule switches it on per device, the call's
keyword wins, explain and the cost model show it, the compiled op carries it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_cli import run as run_cli
from test_weight_grad_filter import BT, EPS, H, V, leaves, peaked_inputs, run

from flce_policy import FLCEPolicy, fused_linear_cross_entropy
from flce_policy.call.options import LossOptions
from flce_policy.engine.config import ConfigError
from flce_policy.loss import FusedLinearCrossEntropyLoss
from flce_policy.plan import cost_model
from flce_policy.plan.cost_model import RATES, predict_seconds
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.plan.weight_filter import FILTER_REST_CALLS

BAD_VALUES = [
    (-1e-3, ValueError), (math.nan, ValueError), (math.inf, ValueError), (1.0, ValueError),
    (True, TypeError), ("0.01", TypeError), ([0.1], TypeError),
]  # fmt: skip


@pytest.mark.parametrize(("value", "error"), BAD_VALUES)
def test_bad_eps_refused_by_name(value, error):
    t = peaked_inputs()
    with pytest.raises(error, match="grad_weight_filter"):
        fused_linear_cross_entropy(t["x"], t["w"], t["y"], grad_weight_filter=value)
    with pytest.raises(error, match="grad_weight_filter"):
        FusedLinearCrossEntropyLoss(grad_weight_filter=value)


@pytest.mark.parametrize("value", ["x", "-1", ".nan", "true", "[0.1]", "1.5"])
def test_bad_eps_in_yaml_names_the_key(value):
    text = f"version: 1\ndevices:\n  - match: cpu\n    strategy: heuristic_c\n    grad_weight_filter: {value}\n"
    with pytest.raises(ConfigError, match=r"devices\[0\]\.grad_weight_filter: grad_weight_filter must be"):
        FLCEPolicy.from_yaml_text(text)


@pytest.mark.parametrize(
    ("text", "eps"),
    [("2**-12", 2.0**-12), ("2^-16", 2.0**-16), (" 2 ** -14 ", 2.0**-14), ("2**-13.5", 8.631674575031098e-05)],
)
def test_eps_written_as_a_power_of_two(text, eps):
    yaml_text = f"version: 1\ndevices:\n  - match: cpu\n    strategy: heuristic_c\n    grad_weight_filter: {text}\n"
    problem = Problem(tokens=BT, hidden=H, vocab=V, dtype="float32")
    assert FLCEPolicy.from_yaml_text(yaml_text).resolve(problem, DeviceInfo.cpu()).grad_weight_filter == eps


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("2**3", "in \\[0, 1\\)"), ("2**-5000", "below the smallest double"), ("2**-99999999999999999999", "below"),
     ("3**-2", "must be a number"), ("2**-13.", "must be a number"), ("2**-1e3", "must be a number")],
)  # fmt: skip
def test_a_power_of_two_out_of_range_is_refused_by_name(text, fragment):
    yaml_text = f"version: 1\ndevices:\n  - match: cpu\n    strategy: heuristic_c\n    grad_weight_filter: {text}\n"
    with pytest.raises(ConfigError, match=rf"devices\[0\]\.grad_weight_filter: .*{fragment}"):
        FLCEPolicy.from_yaml_text(yaml_text)


def _yaml(rule_eps: float | None, default_eps: float | None = None) -> str:
    rule = "" if rule_eps is None else f"    grad_weight_filter: {rule_eps!r}\n"
    default = "" if default_eps is None else f"  grad_weight_filter: {default_eps!r}\n"
    return (
        "version: 1\ndefault:\n  strategy: heuristic_c\n" + default
        + "devices:\n  - match: cpu\n    strategy: fixed_chunk_size\n    chunk_size: 64\n" + rule
    )  # fmt: skip


def test_yaml_round_trip_and_rule_precedence():
    policy = FLCEPolicy.from_yaml_text(_yaml(EPS, default_eps=1e-3))
    assert FLCEPolicy.from_yaml_text(policy.to_yaml()) == policy
    assert policy != FLCEPolicy.from_yaml_text(_yaml(None, default_eps=1e-3))
    problem = Problem(tokens=BT, hidden=H, vocab=V, dtype="float32")
    assert policy.resolve(problem, DeviceInfo.cpu()).grad_weight_filter == EPS  # the device rule's
    assert policy.resolve(problem, DeviceInfo.synthetic("H100")).grad_weight_filter == 1e-3  # the default's
    # the options follow the geometry's filter unless the call gave one
    geometry = policy.resolve(problem, DeviceInfo.cpu())
    assert LossOptions().following(geometry).grad_weight_filter == EPS
    assert LossOptions(grad_weight_filter=0.0).following(geometry).grad_weight_filter == 0.0


def test_policy_rule_filters_the_call_and_the_keyword_wins():
    t = leaves(peaked_inputs(), torch.float32)
    chunk64 = Geometry.for_problem(Problem(tokens=BT, hidden=H, vocab=V, dtype="float32"), 64)
    filtering = FLCEPolicy.from_yaml_text(_yaml(EPS))
    by_rule = run(t, policy=filtering)
    by_keyword = run(t, policy=chunk64, grad_weight_filter=EPS)
    dense = run(t, policy=chunk64)
    off = run(t, policy=filtering, grad_weight_filter=0.0)  # the call switches the rule's filter off
    assert torch.equal(by_rule[2]["w"], by_keyword[2]["w"]) and torch.equal(by_rule[2]["b"], by_keyword[2]["b"])
    assert not torch.equal(by_rule[2]["w"], dense[2]["w"])
    assert torch.equal(off[2]["w"], dense[2]["w"]) and torch.equal(off[2]["b"], dense[2]["b"])
    assert torch.equal(by_rule[0], dense[0]) and torch.equal(by_rule[2]["x"], dense[2]["x"])


def test_explain_prints_the_filter(tmp_path, capsys):
    path = tmp_path / "policy.yaml"
    path.write_text(_yaml(None, default_eps=2.0**-12).replace("match: cpu", "match: B200"))
    code, out, _ = run_cli(
        capsys, "explain", "--config", str(path), "--device", "H100", "--vocab", "131072", "--hidden", "4096"
    )
    assert code == 0
    assert "grad_weight_filter=0.000244141" in out and "70%" in out
    code, out, _ = run_cli(
        capsys, "explain", "--config", str(path), "--device", "H100", "--vocab", "131072", "--hidden", "4096", "--json"
    )
    assert '"grad_weight_filter": 0.000244140625' in out


def test_cost_model_prices_the_skipped_share():
    problem = Problem(tokens=8192, hidden=4096, vocab=131072, dtype="bfloat16")
    dense = Geometry.for_problem(problem, 2048)
    filtered = Geometry.for_problem(problem, 2048, grad_weight_filter=2.0**-12)
    rates = RATES["H200"]
    nothing = predict_seconds(filtered, rates).seconds
    most = predict_seconds(filtered, rates, skipped_share=0.7).seconds
    dense_s = predict_seconds(dense, rates).seconds
    assert most < dense_s < nothing  # skipping pays; with nothing skipped the filtered kernel costs more
    assert predict_seconds(dense, rates, skipped_share=0.7).seconds == dense_s  # no filter, nothing skipped
    with pytest.raises(ValueError, match="skipped_share"):
        predict_seconds(filtered, rates, skipped_share=1.5)


def test_cost_model_prices_the_flags_of_a_dense_chunk_once_per_call_and_rest(monkeypatch):
    """Where so much is kept that the dense GEMM runs, the flags are paid on the first chunk only (its going dense
    ends the call's flagging), and by one call in 1 + FILTER_REST_CALLS (the policy's rest)."""
    problem = Problem(tokens=8192, hidden=4096, vocab=131072, dtype="bfloat16")
    rates = RATES["H200"]

    def flag_cost(chunk: int, skipped_share: float) -> float:
        filtered = Geometry.for_problem(problem, chunk, grad_weight_filter=2.0**-12)
        dense = Geometry.for_problem(problem, chunk)
        return (
            predict_seconds(filtered, rates, skipped_share=skipped_share).seconds
            - predict_seconds(dense, rates, skipped_share=skipped_share).seconds
        )

    assert flag_cost(8192, 0.0) > 0
    assert flag_cost(2048, 0.0) == pytest.approx(flag_cost(8192, 0.0) / 4)
    assert flag_cost(2048, 0.05) == pytest.approx(flag_cost(2048, 0.0))  # 95% kept: the dense GEMM all the same
    averaged = flag_cost(8192, 0.0)
    monkeypatch.setattr(cost_model, "FILTER_REST_CALLS", 0)  # no rest: every call pays
    assert flag_cost(8192, 0.0) == pytest.approx(averaged * (1 + FILTER_REST_CALLS))


def test_compiled_op_carries_the_filter():
    t = leaves(peaked_inputs(), torch.float32)
    chunk64 = Geometry.for_problem(Problem(tokens=BT, hidden=H, vocab=V, dtype="float32"), 64)
    eager = run(t, policy=chunk64, grad_weight_filter=EPS)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss_fn(x, w, y, b):
        return fused_linear_cross_entropy(x, w, y, b, policy=chunk64, grad_weight_filter=EPS)

    for k in ("x", "w", "b"):
        t[k].grad = None
    loss_fn(t["x"], t["w"], t["y"], t["b"]).backward()
    assert torch.equal(t["x"].grad, eager[2]["x"])
    assert torch.equal(t["w"].grad, eager[2]["w"]) and torch.equal(t["b"].grad, eager[2]["b"])


def test_validate_shows_the_rule_filter(tmp_path, capsys):
    path = tmp_path / "policy.yaml"
    path.write_text(_yaml(None).replace("match: cpu", "match: H200") + "    grad_weight_filter: 0.000244140625\n")
    code, out, _ = run_cli(capsys, "validate", str(path), "--json")
    assert code == 0
    filters = {d["device"]["family"]: d["grad_weight_filter"] for d in json.loads(out)["decisions"]}
    assert filters["H200"] == 2.0**-12 and filters["H100"] is None


# --------------------------------------------------------------------------- the rescue as a policy option


def _rescue_yaml(rescue: str, eps: str | None = "2**-8") -> str:
    rule = "" if eps is None else f"    grad_weight_filter: {eps}\n"
    return (
        "version: 1\ndevices:\n  - match: cpu\n    strategy: fixed_chunk_size\n    chunk_size: 64\n" + rule
        + f"    grad_weight_filter_rescue: {rescue}\n"
    )  # fmt: skip


@pytest.mark.parametrize(
    ("rescue", "eps", "fragment"),
    [("3", "2**-8", "power of two"), ("1", "2**-8", "power of two"), ("131072", "2**-8", "power of two"),
     ("x", "2**-8", "power of two"), ("[2]", "2**-8", "must be an int"), ("16", None, "needs a grad_weight_filter")],
)  # fmt: skip
def test_bad_rescue_in_yaml_names_the_key(rescue, eps, fragment):
    with pytest.raises(ConfigError, match=rf"devices\[0\].*{fragment}") as caught:
        FLCEPolicy.from_yaml_text(_rescue_yaml(rescue, eps))
    assert "grad_weight_filter_rescue" in str(caught.value)


def test_rescue_round_trips_reaches_the_geometry_and_the_call_wins():
    policy = FLCEPolicy.from_yaml_text(_rescue_yaml("16"))
    assert FLCEPolicy.from_yaml_text(policy.to_yaml()) == policy
    assert policy != FLCEPolicy.from_yaml_text(_rescue_yaml("8"))
    problem = Problem(tokens=BT, hidden=H, vocab=V, dtype="float32")
    geometry = policy.resolve(problem, DeviceInfo.cpu())
    assert (geometry.grad_weight_filter, geometry.grad_weight_filter_rescue) == (EPS, 16)
    assert policy.resolve(problem, DeviceInfo.synthetic("H100")).grad_weight_filter_rescue is None  # default rule
    assert LossOptions().following(geometry).grad_weight_filter_rescue == 16
    assert LossOptions(grad_weight_filter_rescue=4).following(geometry).grad_weight_filter_rescue == 4
    assert "rescuing by level, at least 1 in 16" in geometry.describe()
    with pytest.raises(ValueError, match="needs a grad_weight_filter"):
        Geometry.for_problem(problem, 64, grad_weight_filter_rescue=16)
    with pytest.raises(ValueError, match="needs a grad_weight_filter"):
        FLCEPolicy(grad_weight_filter_rescue=16)


def test_the_rule_rescue_runs_as_the_keyword_does():
    """The rule's rescue gives the call the same gradients as the keyword on a Geometry, eagerly and through the
    compiled op (its config text carries the rescue)."""
    t = leaves(peaked_inputs(seed=3), torch.float32)
    chunk64 = Geometry.for_problem(Problem(tokens=BT, hidden=H, vocab=V, dtype="float32"), 64)
    by_rule = run(t, policy=FLCEPolicy.from_yaml_text(_rescue_yaml("2")))
    by_keyword = run(t, policy=chunk64, grad_weight_filter=EPS, grad_weight_filter_rescue=2)
    unrescued = run(t, policy=chunk64, grad_weight_filter=EPS)
    assert torch.equal(by_rule[2]["w"], by_keyword[2]["w"]) and torch.equal(by_rule[2]["b"], by_keyword[2]["b"])
    assert not torch.equal(by_rule[2]["w"], unrescued[2]["w"])  # some tile was rescued

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss_fn(x, w, y, b):
        return fused_linear_cross_entropy(
            x, w, y, b, policy=chunk64, grad_weight_filter=EPS, grad_weight_filter_rescue=2
        )

    for k in ("x", "w", "b"):
        t[k].grad = None
    loss_fn(t["x"], t["w"], t["y"], t["b"]).backward()
    assert torch.equal(t["w"].grad, by_keyword[2]["w"]) and torch.equal(t["b"].grad, by_keyword[2]["b"])


def test_explain_and_the_cost_model_show_the_rescue(tmp_path, capsys):
    path = tmp_path / "policy.yaml"
    path.write_text(_rescue_yaml("16", "2**-12").replace("match: cpu", "match: H100"))
    code, out, _ = run_cli(
        capsys, "explain", "--config", str(path), "--device", "H100", "--vocab", "131072", "--hidden", "4096"
    )
    assert code == 0 and "except one in 2^L of those L octaves below eps (L at most 4" in out
    problem = Problem(tokens=8192, hidden=4096, vocab=131072, dtype="bfloat16")
    plain = Geometry.for_problem(problem, 2048, grad_weight_filter=2.0**-12)
    rescued = Geometry.for_problem(problem, 2048, grad_weight_filter=2.0**-12, grad_weight_filter_rescue=4)
    rates = RATES["H200"]
    # a quarter of the skipped tiles multiplied after all: between the plain filter and one skipping less
    assert (
        predict_seconds(plain, rates, skipped_share=0.8).seconds
        < predict_seconds(rescued, rates, skipped_share=0.8).seconds
    )
    assert predict_seconds(rescued, rates, skipped_share=0.8).seconds == pytest.approx(
        predict_seconds(plain, rates, skipped_share=0.6).seconds
    )
    code, out, _ = run_cli(capsys, "validate", str(path), "--json")
    rescues = {d["device"]["family"]: d.get("grad_weight_filter_rescue") for d in json.loads(out)["decisions"]}
    assert code == 0 and rescues["H100"] == 16 and rescues["H200"] is None
