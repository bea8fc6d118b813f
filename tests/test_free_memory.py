"""FreeMemory: the slab sized from live memory, capped by another strategy, in YAML, never cached.

Live memory comes through one seam, ``flce_policy.plan.memory_now.available_bytes``, replaced here by
synthetic numbers; expected rows are worked out by hand from the byte counts in the comments.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from flce_policy.cli import main
from flce_policy.engine.config import ConfigError
from flce_policy.engine.policy import DeviceRule, FLCEPolicy
from flce_policy.plan import memory_now
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.memory import held_beside_slab, predict_peak
from flce_policy.plan.problem import Problem
from flce_policy.strategies import (
    FixedChunkSize,
    FreeMemory,
    HeuristicC,
    NotEnoughFreeMemoryError,
    SlabBudget,
    StrategyError,
    strategy_from_config,
)

GIB, MIB, KIB = 2**30, 2**20, 2**10
GEMMA = Problem(tokens=8192, hidden=5376, vocab=262144)  # one bf16 row of logits: 512 KiB
# Beside the slab, for GEMMA: grad_input 8192*5376*2 = 88,080,384; grad_weight 262144*5376*2 = 2,818,572,288
# (x2 in fp32); per-row buffers 8192*(3*4 + 8) = 163,840.
HELD_BF16 = 88_080_384 + 2_818_572_288 + 163_840  # 2,906,816,512
HELD_FP32 = 88_080_384 + 2 * 2_818_572_288 + 163_840  # 5,725,388,800
LIVE_H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", family="H100", total_memory_bytes=80 * GIB, index=0, source="nvml")


@pytest.fixture
def available(monkeypatch):
    """Set what the device can give now: ``available(bytes)``; records the devices asked about."""
    asked: list[DeviceInfo] = []
    state = {"bytes": 0}

    def fake(device: DeviceInfo) -> int:
        asked.append(device)
        return state["bytes"]

    monkeypatch.setattr(memory_now, "available_bytes", fake)

    def set_bytes(n: int) -> list[DeviceInfo]:
        state["bytes"] = n
        return asked

    return set_bytes


def test_held_beside_slab_is_the_loop_phase_less_the_slab():
    assert held_beside_slab(GEMMA) == HELD_BF16
    assert held_beside_slab(GEMMA, accum_dtype="float32") == HELD_FP32
    # predict_peak's loop phase at any chunk is this plus the slab (bf16: the loop is the peak)
    from flce_policy.plan.geometry import Geometry

    geometry = Geometry.for_problem(GEMMA, 1024)
    assert predict_peak(geometry).total_bytes == HELD_BF16 + 1024 * 512 * KIB


@pytest.mark.parametrize(
    ("free", "strategy", "chunk"),
    [
        # (8 GiB - 1 GiB - HELD_BF16) * 0.5 = 2,304,688,128 B = 4395.9 rows -> 4395 -> 4096 (a 2 GiB slab)
        (8 * GIB, FreeMemory(), 4096),
        # same memory, fraction 1: 4,609,376,256 B = 8791.7 rows -> 8192 = BT
        (8 * GIB, FreeMemory(fraction=1.0), 8192),
        # reserve 4 GiB: (8 GiB - 4 GiB - HELD_BF16) * 0.5 = 694,075,392 B = 1323.8 rows -> 1024
        (8 * GIB, FreeMemory(reserve="4GiB"), 1024),
        # reserve in bytes, 0: (8 GiB - HELD_BF16) * 0.5 = 2,841,559,040 B = 5419.8 rows -> 4096
        (8 * GIB, FreeMemory(reserve=0), 4096),
        # 12 GiB: bf16 accumulator (12 GiB - 1 GiB - HELD_BF16) * 0.5 = 4,452,171,776 B = 8491.8 rows -> 8192
        (12 * GIB, FreeMemory(), 8192),
        # fp32 accumulator holds 2.6 GiB more: (12 GiB - 1 GiB - HELD_FP32) * 0.5 = 3,042,885,632 B = 5803.9 -> 4096
        (12 * GIB, FreeMemory(accum_dtype="float32"), 4096),
        # just enough for one row: 1 GiB + HELD_BF16 + 2 rows of 512 KiB, halved = 1 row
        (GIB + HELD_BF16 + 2 * 512 * KIB, FreeMemory(), 1),
    ],
)
def test_rows_that_fit_in_what_is_available(available, free, strategy, chunk):
    asked = available(free)
    geometry = strategy.geometry(GEMMA, LIVE_H100)
    assert geometry.chunk_size == chunk
    assert asked == [LIVE_H100]
    assert geometry.strategy == repr(strategy)


def test_too_little_memory_says_what_is_available_and_needed(available):
    available(GIB + HELD_BF16 + 512 * KIB)  # half a row after the fraction
    with pytest.raises(torch.cuda.OutOfMemoryError) as info:
        FreeMemory().geometry(GEMMA, LIVE_H100)
    assert isinstance(info.value, NotEnoughFreeMemoryError) and isinstance(info.value, StrategyError)
    message = str(info.value)
    assert "3.71 GiB available on NVIDIA H100 80GB HBM3" in message  # 1 GiB + 2.71 GiB + 512 KiB
    assert "one row of logits needs 512.00 KiB" in message
    # reserve + held + a row / fraction = 1 GiB + HELD_BF16 + 1 MiB
    assert "at least 3.71 GiB must be available" in message
    available(0)  # less than the reserve: the budget is negative, still a clear error
    with pytest.raises(StrategyError, match="leaves 0 B for the slab"):
        FreeMemory().geometry(GEMMA, LIVE_H100)


@pytest.mark.parametrize("device", [DeviceInfo.cpu(), DeviceInfo.synthetic("H100")], ids=["cpu", "planned_h100"])
def test_a_device_that_is_not_live_is_a_clear_error(device):
    with pytest.raises(StrategyError, match="not a live CUDA device") as info:
        FreeMemory().geometry(GEMMA, device)
    assert not isinstance(info.value, torch.cuda.OutOfMemoryError)  # a planning mistake, not an OOM


@pytest.mark.parametrize("as_policy", [False, True], ids=["strategy", "policy"])
def test_the_loss_raises_an_oom_a_training_loop_catches_without_a_fallback(available, monkeypatch, as_policy):
    """Nothing fits: the loss call raises torch.cuda.OutOfMemoryError before running, with no halving retry."""
    import warnings

    from flce_policy import fused_linear_cross_entropy
    from flce_policy.engine import probe
    from flce_policy.kernels import resilient

    monkeypatch.setattr(probe, "device_for_tensor_device", lambda device: LIVE_H100)  # CPU tensors, a "live" H100
    monkeypatch.setattr(resilient, "run_geometry", lambda *a, **k: pytest.fail("the driver must not run"))
    available(GIB)  # less than the 1 GiB reserve
    x, w, y = torch.randn(8, 16), torch.randn(32, 16), torch.randint(0, 32, (8,))
    policy = FLCEPolicy(default=FreeMemory()) if as_policy else FreeMemory()
    skipped = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an OOMFallbackWarning would fail the test
        for _ in range(2):  # a training step that skips the batch on OOM
            try:
                fused_linear_cross_entropy(x, w, y, policy=policy)
            except torch.cuda.OutOfMemoryError as err:
                assert "1.00 GiB available on NVIDIA H100 80GB HBM3, less the reserve 1.00 GiB" in str(err)
                skipped += 1
    assert skipped == 2


def test_available_bytes_adds_free_and_cached_but_unallocated(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: calls.append(("info", i)) or (10 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: calls.append(("reserved", i)) or 7 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: calls.append(("allocated", i)) or 5 * GIB)
    device = LIVE_H100.model_copy(update={"index": 3})
    assert memory_now.available_bytes(device) == 12 * GIB  # 10 free + (7 - 5) cached
    assert {index for _, index in calls} == {3}


# --- the cap ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("free", "cap", "chunk"),
    [
        (64 * GIB, HeuristicC(c=16), 2048),  # plenty of memory: Liger's C=16, 2048 rows at 8k
        (8 * GIB, HeuristicC(c=16), 2048),  # 4096 rows would fit (see above): the cap's 2048
        # (5 GiB - 1 GiB - HELD_BF16) * 0.5 = 694,075,392 B = 1323.8 rows -> 1024, under the cap
        (5 * GIB, HeuristicC(c=16), 1024),
        (5 * GIB, {"strategy": "heuristic_c", "c": 16}, 1024),  # the YAML form of the same cap
        (64 * GIB, {"strategy": "slab_budget", "max_slab": "256MiB"}, 512),
        (64 * GIB, FixedChunkSize(8192), 8192),
    ],
)
def test_cap_bounds_the_rows_that_fit(available, free, cap, chunk):
    available(free)
    strategy = FreeMemory(cap=cap)
    geometry = strategy.geometry(GEMMA, LIVE_H100, rule="devices[0] (match H100)")
    assert geometry.chunk_size == chunk
    assert geometry.strategy == repr(strategy) and geometry.rule == "devices[0] (match H100)"


def test_cap_clamped_to_the_tokens_stays_one_chunk(available):
    # BT=1000 < V/H: Liger wants 1024 rows, clamped to one chunk of 1000; free memory allows far more.
    available(64 * GIB)
    problem = Problem(tokens=1000, hidden=4096, vocab=1000)
    assert FreeMemory(cap=HeuristicC()).geometry(problem, LIVE_H100).chunk_size == 1000


def test_cap_is_built_once_from_its_mapping(available, monkeypatch):
    from flce_policy.strategies import registry

    built = []
    real = registry.strategy_from_config
    monkeypatch.setattr(registry, "strategy_from_config", lambda config: built.append(config) or real(config))
    available(5 * GIB)
    strategy = FreeMemory(cap={"strategy": "heuristic_c", "c": 16})
    for _ in range(5):
        strategy.geometry(GEMMA, LIVE_H100)
    assert len(built) == 1
    strategy.cap["c"] = 1  # a changed mapping is built again
    available(64 * GIB)
    assert strategy.geometry(GEMMA, LIVE_H100).chunk_size == 256  # Liger's C=1 at 8k
    assert len(built) == 2


# --- parameters, errors and YAML ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "param", "fragment"),
    [
        ({"fraction": 0}, "fraction", "fraction must be a number in (0, 1], got 0"),
        ({"fraction": 1.5}, "fraction", "got 1.5"),
        ({"fraction": True}, "fraction", "got True"),
        ({"fraction": "0.5"}, "fraction", "got '0.5'"),
        ({"fraction": float("nan")}, "fraction", "got nan"),
        ({"reserve": "lots"}, "reserve", "reserve: cannot parse 'lots'"),
        ({"reserve": -1}, "reserve", "cannot be negative"),
        ({"accum_dtype": "fp64"}, "accum_dtype", "one of bfloat16, float16, float32 (or a torch dtype"),
        ({"cap": "heuristic_c"}, "cap", "cap must be a strategy mapping"),
        ({"cap": {"c": 16}}, "cap", "cap: missing key 'strategy'"),
        ({"cap": {"strategy": "nope"}}, "cap", "cap: unknown strategy 'nope'"),
        ({"cap": {"strategy": "heuristic_c", "c": 0}}, "cap.c", "cap.c: c must be a positive integer, got 0"),
        ({"cap": {"strategy": "heuristic_c", "chunk": 2}}, "cap.chunk", "unknown parameter(s) chunk"),
        ({"cap": {"strategy": "slab_budget"}}, "cap.max_slab", "required parameter 'max_slab' is missing"),
        ({"cap": HeuristicC(c=0)}, "cap.c", "cap.c: c must be a positive integer"),
        ({"cap": {"strategy": "free_memory", "cap": {"strategy": "heuristic_c", "c": -1}}}, "cap.cap.c", "got -1"),
    ],
)
def test_bad_parameters_name_the_parameter(params, param, fragment):
    with pytest.raises(StrategyError) as info:
        strategy_from_config({"strategy": "free_memory", **params})
    assert info.value.param == param
    assert fragment in str(info.value)
    assert str(info.value).startswith("free_memory: ")


def test_nested_cap_errors_name_the_key_path_in_a_policy_file(tmp_path):
    text = """\
version: 1
devices:
  - match: H100
    strategy: slab_budget
    max_slab: 1GiB
  - match: H200
    strategy: free_memory
    cap:
      strategy: heuristic_c
      c: 0
  - match: '*'
    strategy: free_memory
    cap:
      strategy: heuristic_c
      chunk: 4
"""
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        FLCEPolicy.from_yaml(path)
    assert info.value.problems == [
        ("devices[1].cap.c", "c must be a positive integer, got 0"),
        ("devices[2].cap.chunk", "strategy 'heuristic_c' got unknown parameter(s) chunk; it accepts: c"),
    ]
    assert f"{path}: devices[1].cap.c: c must be a positive integer, got 0" in str(info.value)


def test_round_trip_with_a_nested_cap(tmp_path):
    strategy = FreeMemory(fraction=0.25, reserve="2GiB", cap=HeuristicC(c=16), accum_dtype="float32")
    config = {
        "strategy": "free_memory",
        "fraction": 0.25,
        "reserve": "2GiB",
        "cap": {"strategy": "heuristic_c", "c": 16},
        "accum_dtype": "float32",
    }
    assert strategy.to_config() == config
    rebuilt = strategy_from_config(yaml.safe_load(yaml.safe_dump(config)))
    assert rebuilt == strategy and hash(rebuilt) == hash(strategy)
    assert rebuilt.cap == {"strategy": "heuristic_c", "c": 16}  # stored as written
    assert rebuilt.to_config() == config

    policy = FLCEPolicy(rules=[DeviceRule("H100", strategy), DeviceRule("*", FreeMemory())])
    assert FLCEPolicy.from_yaml_text(policy.to_yaml()) == policy
    assert policy.to_dict()["devices"][1] == {
        "match": "*",
        "strategy": "free_memory",
        "fraction": 0.5,
        "reserve": "1GiB",
        "cap": None,
        "accum_dtype": None,
    }


def test_a_cap_mapping_is_written_with_its_defaults_filled_in():
    # as a top-level strategy is: `strategy: heuristic_c` reads back as HeuristicC(c=1)
    written = FreeMemory(cap={"strategy": "heuristic_c"})
    assert written.to_config()["cap"] == {"strategy": "heuristic_c", "c": 1}
    assert written == FreeMemory(cap=HeuristicC())
    assert written != FreeMemory(cap=HeuristicC(c=2))
    assert FreeMemory(cap=SlabBudget("1GiB")) != FreeMemory(cap=SlabBudget("1024MiB"))  # kept as written


# --- in a policy: asked on every call, under what an OOM fallback remembered --------------------------


def test_policy_asks_a_dynamic_strategy_on_every_call(available):
    policy = FLCEPolicy(rules=[DeviceRule("H100", FreeMemory(cap=HeuristicC(c=16)))])
    assert FreeMemory.dynamic and not SlabBudget.dynamic
    available(8 * GIB)
    first = policy.resolve(GEMMA, LIVE_H100)
    available(5 * GIB)  # the rest of the step took 3 GiB since
    second = policy.resolve(GEMMA, LIVE_H100)
    available(8 * GIB)
    third = policy.resolve(GEMMA, LIVE_H100)
    assert (first.chunk_size, second.chunk_size, third.chunk_size) == (2048, 1024, 2048)
    assert first.rule == "devices[0] (match H100)"


def test_a_remembered_geometry_caps_a_dynamic_strategy(available):
    from flce_policy.plan.geometry import Geometry

    policy = FLCEPolicy(rules=[DeviceRule("H100", FreeMemory())])
    available(12 * GIB)
    assert policy.resolve(GEMMA, LIVE_H100).chunk_size == 8192
    fallback = policy.oom_fallback_for(GEMMA, LIVE_H100)
    fallback.remember(Geometry.for_problem(GEMMA, 2048, strategy="oom fallback from 8192 rows (...)"))
    assert policy.resolve(GEMMA, LIVE_H100).chunk_size == 2048  # 8192 would fit by the numbers; it did not
    available(5 * GIB)
    assert policy.resolve(GEMMA, LIVE_H100).chunk_size == 1024  # still asked: less fits now
    policy.clear_cache()
    available(12 * GIB)
    assert policy.resolve(GEMMA, LIVE_H100).chunk_size == 8192


def test_remember_rejects_a_geometry_of_another_problem():
    from flce_policy.plan.geometry import Geometry

    policy = FLCEPolicy()
    other = Geometry.for_problem(Problem(tokens=4096, hidden=5376, vocab=262144), 256)
    with pytest.raises(ValueError, match="made for BT=4096"):
        policy.remember(GEMMA, LIVE_H100, other)


def test_explain_says_the_strategy_is_asked_on_every_call(available):
    available(8 * GIB)
    text = FLCEPolicy(default=FreeMemory()).explain(GEMMA, LIVE_H100)
    assert "free_memory (fraction=0.5, reserve='1GiB', cap=None, accum_dtype=None); asked again on every call" in text
    assert "4096 rows" in text


def test_cli_explain_on_a_planned_device_says_it_decides_at_call_time(capsys):
    # as validate's table does (issue 28): a planned GPU has no free memory to read
    argv = ["explain", "--model", "gemma-4-31b", "--device", "H100", "--strategy", "free_memory"]
    assert main([*argv, "--param", "cap={strategy: heuristic_c, c: 16}"]) == 0
    out, err = capsys.readouterr()
    assert "Chunk size:  sized at every call from the memory free on the GPU" in out and err == ""


def test_cli_validate_accepts_a_free_memory_policy(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(
        "version: 1\ndevices:\n  - match: H100\n    strategy: free_memory\n"
        "    cap: {strategy: slab_budget, max_slab: 256MiB}\n"
    )
    assert main(["validate", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert f"OK: {path}" in out
