"""The GPU benchmark of the measured policy (benchmarks/measured_policy.py), smoke-run on the CPU's interpreter.

The CPU stands for an unknown GPU the same way (its own rule removed: the default, ``measured``, applies), timed by
the host's clock; the checks' glue runs in this process (the fresh processes' side is the same function).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_loss_kernel import NEEDS_KERNEL_DEVICE

from flce_policy.benchmarks import measured_policy as bench
from flce_policy.benchmarks.methods import make_inputs
from flce_policy.engine import pick_cache
from flce_policy.kernels import KERNELS_INTERPRETED

pytestmark = [NEEDS_KERNEL_DEVICE, pytest.mark.skipif(not KERNELS_INTERPRETED, reason="the CPU's smoke run")]


@pytest.fixture(autouse=True)
def cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(pick_cache.CACHE_ENV_VAR, str(tmp_path / "picks"))


def tiny():
    return make_inputs(256, 16, 96, logit_std=4.0, dtype=torch.float32, device="cpu")


def test_unknown_gpu_policy_drops_the_rules_naming_the_device():
    from flce_policy import DeviceInfo, Problem

    gib, mib = 2**30, 2**20
    h100 = DeviceInfo.synthetic("H100")
    rule, strategy = bench.unknown_gpu_policy(h100).resolve_rule(h100)
    assert "match *" in rule and strategy.measures  # the last rule: unknown cards of 80 GB and more
    assert strategy.limit(Problem(65536, 5376, 262144), h100).slab_bytes == 2 * gib  # the H100's rule, large head
    cpu = DeviceInfo.cpu()
    rule, strategy = bench.unknown_gpu_policy(cpu).resolve_rule(cpu)
    assert rule == "default" and strategy.measures  # the CPU's own rule removed: measured
    assert strategy.limit(Problem(65536, 5376, 262144), cpu).slab_bytes == 128 * mib  # the memory rule's floor


def test_compare_shape_measures_then_times_both():
    row = bench.compare_shape(tiny(), calls=2)
    assert row["measuring_calls"] == 3  # one candidate under the CPU's limit: 1 untimed and 2 timed calls
    assert [entry[:2] for entry in row["search_ms"]] == [[256, "logits"]] * 3  # each call the search ran, in order
    assert all(entry[2] > 0 for entry in row["search_ms"])
    assert row["pick_source"] == "measured" and row["pick"].startswith("1 chunks of 256 rows")
    assert row["peak_within_limit"] and row["largest_slab_bytes"] <= row["limit_slab_bytes"]
    assert row["ratio"] > 0


def test_first_calls_and_a_second_process(monkeypatch, capsys):
    order = []

    def in_this_process(args, env):
        monkeypatch.setenv(pick_cache.CACHE_ENV_VAR, env[pick_cache.CACHE_ENV_VAR])
        ns = bench.build_parser().parse_args(args)
        order.append((ns.which, env.get("TRITON_CACHE_DIR"), env[pick_cache.CACHE_ENV_VAR]))
        return bench.first_calls(bench._inputs(ns.inputs, ns.first_shape[0], torch.device("cpu")), ns.which, 6)

    monkeypatch.setattr(bench, "_in_fresh_process", in_this_process)
    argv = ["--checks", "first-calls", "--inputs", "random", "--first-shape", "256x16x96", "--first-calls", "6"]
    assert bench.main([*argv, "--pairs", "2"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    checks = report["first_calls"]
    # the pairs take turns going first, each side on fresh Triton and pick caches; the second process on the last's
    assert [which for which, _, _ in order] == ["rule", "measured", "measured", "rule", "measured"]
    assert len({triton for _, triton, _ in order[:4]}) == 4 and len({picks for _, _, picks in order[:4]}) == 2
    assert order[4][2] == order[3][2]
    assert len(checks["pairs"]) == 2
    for pair in checks["pairs"]:
        assert (pair["rule"]["measuring_calls"], pair["measured"]["measuring_calls"]) == (0, 3)
        assert (pair["rule"]["forms_measured"], pair["measured"]["forms_measured"]) == ([], ["logits"])
        for side in ("rule", "measured"):
            assert 0 < pair[side]["first_call_seconds"] <= pair[side]["seconds"]
    assert checks["second"]["measuring_calls"] == 0
    medians = checks["median_seconds"]
    for side in ("rule", "measured"):
        assert medians[side] == pytest.approx(sum(p[side]["seconds"] for p in checks["pairs"]) / 2)
    assert checks["overhead"] == pytest.approx(medians["measured"] / medians["rule"] - 1, abs=1e-4)
    after = checks["median_seconds_after_the_first_call"]
    for side in ("rule", "measured"):
        rest = [p[side]["seconds"] - p[side]["first_call_seconds"] for p in checks["pairs"]]
        assert after[side] == pytest.approx(sum(rest) / 2)
    assert checks["overhead_after_the_first_call"] == pytest.approx(after["measured"] / after["rule"] - 1, abs=1e-4)
    printed = [line for line in captured.err.splitlines() if line.startswith("first calls, pair")]
    assert len(printed) == 4 and json.loads(printed[-1].split(": ", 1)[1])["which"] == "rule"  # pair 2: rule last
    assert report["goals_met"]["second_process_measures_nothing"] is True


def test_rule_warm_starts_each_side_from_its_own_copy_of_a_cache_the_rule_filled(monkeypatch, capsys):
    seen = []

    def in_this_process(args, env):
        ns = bench.build_parser().parse_args(args)
        cache = Path(env.get("TRITON_CACHE_DIR", Path(env[pick_cache.CACHE_ENV_VAR], "default-triton")))
        seen.append((ns.which, cache, sorted(p.name for p in cache.glob("*")) if cache.exists() else []))
        cache.mkdir(parents=True, exist_ok=True)
        (cache / f"{ns.which}.kernel").write_text("compiled")  # what this process compiles
        monkeypatch.setenv(pick_cache.CACHE_ENV_VAR, env[pick_cache.CACHE_ENV_VAR])
        return bench.first_calls(bench._inputs(ns.inputs, ns.first_shape[0], torch.device("cpu")), ns.which, 4)

    monkeypatch.setattr(bench, "_in_fresh_process", in_this_process)
    argv = ["--checks", "first-calls", "--inputs", "random", "--first-shape", "256x16x96", "--first-calls", "4"]
    assert bench.main([*argv, "--pairs", "2", "--triton-cache", "rule-warm"]) == 0
    assert json.loads(capsys.readouterr().out)["first_calls"]["triton_cache"] == "rule-warm"
    warming, *sides, second = seen
    assert warming[0] == "rule" and warming[2] == []  # the warming process starts empty
    assert [which for which, _, _ in sides] == ["rule", "measured", "measured", "rule"]
    for _, cache, found in sides:  # each side: the rule's kernels only, not another side's
        assert found == ["rule.kernel"] and cache != warming[1]
    assert len({cache for _, cache, _ in sides}) == 4
    assert second[0] == "measured"


def test_the_cold_cache_starts_each_side_empty(monkeypatch, capsys):
    seen = []

    def in_this_process(args, env):
        ns = bench.build_parser().parse_args(args)
        cache = Path(env.get("TRITON_CACHE_DIR", Path(env[pick_cache.CACHE_ENV_VAR], "default-triton")))
        seen.append(cache.exists() and any(cache.iterdir()))
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "kernel").write_text("compiled")
        monkeypatch.setenv(pick_cache.CACHE_ENV_VAR, env[pick_cache.CACHE_ENV_VAR])
        return bench.first_calls(bench._inputs(ns.inputs, ns.first_shape[0], torch.device("cpu")), ns.which, 4)

    monkeypatch.setattr(bench, "_in_fresh_process", in_this_process)
    argv = ["--checks", "first-calls", "--inputs", "random", "--first-shape", "256x16x96", "--first-calls", "4"]
    assert bench.main([*argv, "--pairs", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["first_calls"]["triton_cache"] == "cold"
    assert seen[:4] == [False] * 4  # two pairs, no side sees a kernel another compiled


@pytest.mark.parametrize("text", ["0", "two"])
def test_pairs_must_be_a_positive_integer(capsys, text):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--pairs", text])
    assert f"--pairs: expected an integer >= 1, got {text if text == '0' else repr(text)}" in capsys.readouterr().err


def test_both_sides_load_the_trained_inputs_the_parent_built(monkeypatch, tmp_path, capsys):
    """``--inputs trained``: the build happens once, in this process, and every side is handed its file: a side
    asking for ``trained`` under its own cache folder would train the model again, warming its Triton cache."""
    from flce_policy.benchmarks import trained_inputs

    data = tiny()
    built = tmp_path / "built.pt"
    calls = []

    def build(spec, device="cuda"):
        calls.append(spec)
        torch.save({"x": data.x, "weight": data.weight, "target": data.target, "key": "tiny"}, built)
        return trained_inputs.trained_inputs(torch.load(built), device), "trained tiny"

    monkeypatch.setattr(trained_inputs, "inputs_from_spec", build)
    monkeypatch.setattr(trained_inputs, "cache_path", lambda config, cache_dir=None: built)
    seen = []

    def in_this_process(args, env):
        ns = bench.build_parser().parse_args(args)
        seen.append(ns.inputs)
        loaded = torch.load(ns.inputs)
        assert loaded["key"] == "tiny"
        monkeypatch.setenv(pick_cache.CACHE_ENV_VAR, env[pick_cache.CACHE_ENV_VAR])
        return bench.first_calls(trained_inputs.trained_inputs(loaded, "cpu"), ns.which, 4)

    monkeypatch.setattr(bench, "_in_fresh_process", in_this_process)
    assert bench.main(["--checks", "first-calls", "--inputs", "trained", "--first-calls", "4", "--pairs", "2"]) == 0
    assert calls == ["trained"]  # built once, here
    assert seen == [str(built.resolve())] * 5  # two pairs and the second process: the same file
    assert json.loads(capsys.readouterr().out)["first_calls"]["second"]["measuring_calls"] == 0
