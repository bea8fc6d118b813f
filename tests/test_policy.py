"""FLCEPolicy: rule matching and order, caching, explain, the packaged default and FLCE_POLICY_CONFIG."""

from __future__ import annotations

import pytest

from flce_policy.engine import probe
from flce_policy.engine.config import ConfigError
from flce_policy.engine.policy import DeviceRule, FLCEPolicy
from flce_policy.plan.device import KNOWN_GPUS, DeviceInfo
from flce_policy.plan.problem import Problem
from flce_policy.strategies import ChunkStrategy, FixedChunkSize, HeuristicC, SlabBudget, StrategyError

GIB = 2**30
MIB = 2**20
GEMMA = Problem(tokens=8192, hidden=5376, vocab=262144)  # Gemma-4 31B head; one bf16 row is 512 KiB
H100, H200 = DeviceInfo.synthetic("H100"), DeviceInfo.synthetic("H200")


def gpu(name: str, family: str, memory: int) -> DeviceInfo:
    return DeviceInfo(name=name, family=family, total_memory_bytes=memory, source="override")


# --- matching --------------------------------------------------------------------------------------


def test_first_matching_rule_wins():
    problem = Problem(tokens=4096, hidden=64, vocab=1000)
    star_first = FLCEPolicy(rules=[DeviceRule("*", FixedChunkSize(64)), DeviceRule("H100", FixedChunkSize(128))])
    h100_first = FLCEPolicy(rules=[DeviceRule("H100", FixedChunkSize(128)), DeviceRule("*", FixedChunkSize(64))])
    assert star_first.resolve(problem, H100).chunk_size == 64
    assert h100_first.resolve(problem, H100).chunk_size == 128
    assert h100_first.resolve(problem, H200).chunk_size == 64
    assert h100_first.resolve(problem, H100).rule == "devices[0] (match H100)"
    assert h100_first.resolve(problem, H200).rule == "devices[1] (match *)"


@pytest.mark.parametrize(
    "match, device, expected",
    [
        ("H100", H100, True),
        ("h100", H100, True),  # family, case-insensitive
        ("H100", H200, False),
        ("H20", H200, False),  # a family is compared whole, never as a prefix
        ("H10", H100, False),
        ("NVIDIA H100*", H100, True),  # glob on the NVML name "NVIDIA H100 80GB HBM3"
        ("nvidia h100*", H100, True),
        ("NVIDIA H100*", H200, False),
        ("*GeForce*", DeviceInfo.synthetic("RTX 4090"), True),
        ("*GeForce*", H100, False),
        ("NVIDIA H200", H200, True),  # the exact name is a glob too
        ("*", H100, True),
        ("*", DeviceInfo.cpu(), True),  # "*" is every device, the CPU included
        ("cpu", DeviceInfo.cpu(), True),
        ("cpu", H100, False),
        ("unknown", gpu("Mystery Accelerator", "unknown", 64 * GIB), True),
    ],
)
def test_family_and_glob_matching(match, device, expected):
    assert DeviceRule(match, HeuristicC()).matches(device) is expected


def test_memory_bounds_pick_between_variants_of_a_family():
    rules = [
        DeviceRule("B300", HeuristicC(c=16), min_total_memory="200GiB"),
        DeviceRule("A100", FixedChunkSize(32), max_total_memory="48GiB"),
        DeviceRule("*", FixedChunkSize(8)),
    ]
    policy = FLCEPolicy(rules=rules)
    big_b300 = gpu("NVIDIA B300 SXM6 AC", "B300", 288 * 10**9)
    small_b300 = gpu("NVIDIA B300 cut down", "B300", 180 * GIB)
    a100_40 = gpu("NVIDIA A100-SXM4-40GB", "A100", 40 * GIB)
    a100_80 = gpu("NVIDIA A100-SXM4-80GB", "A100", 80 * GIB)
    assert policy.resolve_rule(big_b300) == ("devices[0] (match B300, total memory >= 200GiB)", HeuristicC(c=16))
    assert policy.resolve_rule(small_b300)[0] == "devices[2] (match *)"
    assert policy.resolve_rule(a100_40) == ("devices[1] (match A100, total memory <= 48GiB)", FixedChunkSize(32))
    assert policy.resolve_rule(a100_80)[0] == "devices[2] (match *)"
    # bounds are inclusive
    assert DeviceRule("B300", HeuristicC(), min_total_memory=180 * GIB).matches(small_b300)
    assert DeviceRule("B300", HeuristicC(), max_total_memory="180GiB").matches(small_b300)


def test_no_rule_means_default():
    policy = FLCEPolicy(default=FixedChunkSize(16), rules=[DeviceRule("H100", FixedChunkSize(128))])
    geometry = policy.resolve(Problem(tokens=100, hidden=8, vocab=10), DeviceInfo.cpu())
    assert (geometry.chunk_size, geometry.rule) == (16, "default")
    assert policy.resolve_rule(H200) == ("default", FixedChunkSize(16))


def test_constructor_defaults_to_liger_c1():
    # Liger with c=1 on Gemma-4 31B at 8k: inc = cdiv(262144, 5376) = 49, cdiv(8192, 49) = 168 -> 256 rows.
    assert FLCEPolicy().resolve(GEMMA, H100).chunk_size == 256
    assert FLCEPolicy() == FLCEPolicy(default=HeuristicC(c=1))


def test_rule_and_policy_reject_bad_objects():
    with pytest.raises(ValueError, match="non-empty"):
        DeviceRule("  ", HeuristicC())
    with pytest.raises(ValueError, match="exceeds"):
        DeviceRule("H100", HeuristicC(), min_total_memory="2GiB", max_total_memory="1GiB")
    with pytest.raises(ValueError, match="cannot parse"):
        DeviceRule("H100", HeuristicC(), min_total_memory="lots")
    with pytest.raises(StrategyError, match="max_slab"):
        DeviceRule("H100", SlabBudget("lots"))
    with pytest.raises(TypeError):
        FLCEPolicy(rules=[("H100", HeuristicC())])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"oom_fallback": "yes"}, "oom_fallback must be True or False, got 'yes'"),
        ({"oom_fallback": 1}, "oom_fallback must be True or False, got 1"),
        ({"min_chunk_size": 0}, "min_chunk_size must be a positive number of rows, got 0"),
        ({"min_chunk_size": True}, "got True"),
        ({"min_chunk_size": 64.0}, "got 64.0"),
    ],
)
def test_oom_settings_are_checked(settings, fragment):
    with pytest.raises(ValueError) as info:
        FLCEPolicy(**settings)
    assert fragment in str(info.value)


def test_oom_fallback_for_hands_out_the_policy_settings():
    policy = FLCEPolicy(min_chunk_size=32)
    fallback = policy.oom_fallback_for(GEMMA, H100)
    assert fallback.min_chunk_size == 32
    fallback.remember(FixedChunkSize(128).geometry(GEMMA, H100))  # remembered for GEMMA on H100 only
    assert policy.resolve(GEMMA, H100).chunk_size == 128
    assert policy.resolve(GEMMA, H200).chunk_size == 256  # Liger's c=1 (test_constructor_defaults_to_liger_c1)
    assert FLCEPolicy(oom_fallback=False).oom_fallback_for(GEMMA, H100) is None


def test_equality_is_by_content_not_source():
    a = FLCEPolicy(default=HeuristicC(c=1), rules=[DeviceRule("H100", SlabBudget("1GiB"))], source="a.yaml")
    b = FLCEPolicy.from_dict(
        {
            "version": 1,
            "default": {"strategy": "heuristic_c"},
            "devices": [{"match": "H100", "strategy": "slab_budget", "max_slab": "1GiB"}],
        }
    )
    assert a == b
    assert a != FLCEPolicy(default=HeuristicC(c=1), rules=[DeviceRule("H100", SlabBudget("512MiB"))])
    assert a != FLCEPolicy(default=HeuristicC(c=2), rules=[DeviceRule("H100", SlabBudget("1GiB"))])


# --- caching ---------------------------------------------------------------------------------------


class CountingChunks(ChunkStrategy):
    """Always 64 rows; counts how often it is asked."""

    calls = 0

    def __init__(self, rows: int = 64) -> None:
        self.rows = rows

    def pick_chunk_size(self, problem, device):
        type(self).calls += 1
        return self.rows


def test_resolve_caches_per_problem_and_device():
    CountingChunks.calls = 0
    policy = FLCEPolicy(default=CountingChunks())
    first = policy.resolve(Problem(tokens=1024, hidden=8, vocab=100), H100)
    for _ in range(50):  # equal (not identical) problem objects hit the cache too
        assert policy.resolve(Problem(tokens=1024, hidden=8, vocab=100), H100) is first
    assert CountingChunks.calls == 1
    policy.resolve(Problem(tokens=2048, hidden=8, vocab=100), H100)
    policy.resolve(Problem(tokens=1024, hidden=8, vocab=100), H200)
    assert CountingChunks.calls == 3
    policy.clear_cache()
    policy.resolve(Problem(tokens=1024, hidden=8, vocab=100), H100)
    assert CountingChunks.calls == 4


def test_resolve_without_device_probes_once(monkeypatch):
    probes = []
    monkeypatch.setattr(probe, "probe_device", lambda index=None: probes.append(index) or H200)
    CountingChunks.calls = 0
    policy = FLCEPolicy(default=HeuristicC(), rules=[DeviceRule("H200", CountingChunks(128))])
    for _ in range(10):
        geometry = policy.resolve(Problem(tokens=1024, hidden=8, vocab=100))
    assert geometry.chunk_size == 128 and geometry.rule == "devices[0] (match H200)"
    assert len(probes) == 1
    assert CountingChunks.calls == 1


# --- explain ---------------------------------------------------------------------------------------


def test_explain_names_device_rule_strategy_and_geometry():
    policy = FLCEPolicy(default=HeuristicC(), rules=[DeviceRule("H100", SlabBudget("256MiB"))])
    text = policy.explain(GEMMA, H100)
    # 256 MiB / 512 KiB a row = 512 rows; 8192 / 512 = 16 chunks
    for fragment in (
        "NVIDIA H100 80GB HBM3",
        "family H100",
        "via override",
        "devices[0] (match H100)",
        "slab_budget",
        "max_slab='256MiB'",
        "512 rows",
        "16 chunks",
        "256.00 MiB",
        "On OOM:      on: retried at half the rows down to 64",
    ):
        assert fragment in text, fragment
    off = FLCEPolicy(rules=[DeviceRule("H100", SlabBudget("256MiB"))], oom_fallback=False).explain(GEMMA, H100)
    assert "On OOM:      off: an out-of-memory error on the slab propagates" in off


def test_explain_dict_has_the_numbers():
    policy = FLCEPolicy(default=SlabBudget("1GiB"))
    d = policy.explain_dict(Problem(tokens=5000, hidden=4096, vocab=128256), H200)
    # 1 GiB / (128256 * 2 B) = 4186 rows -> 4096, clamped to BT=5000 stays 4096; 2 chunks, last 904 rows
    assert d["chunk_size"] == 4096
    assert d["num_chunks"] == 2
    assert d["last_chunk_size"] == 904
    assert d["slab_bytes"] == 4096 * 128256 * 2
    assert d["slab"] == "1002.00 MiB"
    assert (d["rule"], d["strategy"], d["params"]) == ("default", "slab_budget", {"max_slab": "1GiB"})
    assert d["device"]["family"] == "H200"


# --- the packaged default and FLCE_POLICY_CONFIG ----------------------------------------------------


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("FLCE_POLICY_CONFIG", raising=False)


def test_packaged_default_on_gemma(no_env):
    policy = FLCEPolicy.default()
    assert policy == FLCEPolicy.packaged()
    on_h100 = policy.resolve(GEMMA, H100)
    on_h200 = policy.resolve(GEMMA, H200)
    # measured on the H100: 2 GiB (4096 rows) runs 1.00-1.02x the floor; where it does not fit (the field report's
    # saturation) the OOM fallback halves it (docs/results.md, H100)
    assert on_h100.slab_bytes == 2 * GIB and on_h100.slab_form == "scaled_exp_rows"
    assert on_h200.slab_bytes >= on_h100.slab_bytes
    assert policy.resolve(GEMMA, DeviceInfo.synthetic("B300")).slab_bytes >= on_h200.slab_bytes
    # no GPU: Liger's c=1, 256 rows (see test_constructor_defaults_to_liger_c1)
    assert policy.resolve(GEMMA, DeviceInfo.cpu()).chunk_size == 256


def test_packaged_default_is_monotone_in_memory_and_covers_every_known_gpu(no_env):
    policy = FLCEPolicy.packaged()
    slabs = []
    for known in KNOWN_GPUS:
        device = DeviceInfo.synthetic(known.family)
        geometry = policy.resolve(GEMMA, device)
        assert geometry.rule != "default", known.family
        slabs.append((device.total_memory_bytes, geometry.slab_bytes, known.family))
    for mem_a, slab_a, fam_a in slabs:
        for mem_b, slab_b, fam_b in slabs:
            if mem_a < mem_b:
                assert slab_a <= slab_b, f"{fam_a} ({slab_a}) > {fam_b} ({slab_b})"


def test_packaged_default_memory_variants():
    policy = FLCEPolicy.packaged()
    a100_40 = gpu("NVIDIA A100-SXM4-40GB", "A100", 40 * GIB)
    assert policy.resolve(GEMMA, a100_40).slab_bytes <= policy.resolve(GEMMA, DeviceInfo.synthetic("A100")).slab_bytes


def test_env_var_selects_a_user_file(tmp_path, monkeypatch):
    path = tmp_path / "mine.yaml"
    path.write_text("version: 1\ndefault:\n  strategy: fixed_chunk_size\n  chunk_size: 32\n")
    monkeypatch.setenv("FLCE_POLICY_CONFIG", str(path))
    policy = FLCEPolicy.default()
    assert policy == FLCEPolicy(default=FixedChunkSize(32))
    assert str(path) in policy.source and "FLCE_POLICY_CONFIG" in policy.source
    assert FLCEPolicy.packaged() != policy  # packaged() ignores the variable


def test_env_var_empty_means_packaged(monkeypatch):
    monkeypatch.setenv("FLCE_POLICY_CONFIG", "")
    assert FLCEPolicy.default() == FLCEPolicy.packaged()


def test_env_var_missing_file_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("FLCE_POLICY_CONFIG", str(tmp_path / "gone.yaml"))
    with pytest.raises(ConfigError, match=r"FLCE_POLICY_CONFIG=.*gone.yaml: no such file"):
        FLCEPolicy.default()


def test_env_var_bad_file_names_file_and_variable(tmp_path, monkeypatch):
    path = tmp_path / "bad.yaml"
    path.write_text("version: 1\ndefault:\n  strategy: slab_budget\n  max_slab: lots\n")
    monkeypatch.setenv("FLCE_POLICY_CONFIG", str(path))
    with pytest.raises(ConfigError, match=r"bad.yaml \(from FLCE_POLICY_CONFIG\): default.max_slab: cannot parse"):
        FLCEPolicy.default()


# --- issue 28: misuse is named -------------------------------------------------------------------


@pytest.mark.parametrize("rules", [5, "H100", DeviceRule("H100", HeuristicC())])
def test_rules_must_be_a_list_of_rules(rules):
    with pytest.raises(TypeError, match=r"rules must be a list of DeviceRule objects, got"):
        FLCEPolicy(rules=rules)  # type: ignore[arg-type]


@pytest.mark.parametrize("problem", [(8192, 4096, 128256), "8192x4096x128256", [8192, 4096, 128256]])
def test_resolve_names_a_problem_that_is_not_one(problem):
    with pytest.raises(TypeError, match=r"resolve\(problem, device\): problem must be a flce_policy.Problem"):
        FLCEPolicy().resolve(problem, DeviceInfo.synthetic("H100"))  # type: ignore[arg-type]


def test_resolve_names_a_device_given_as_a_family():
    with pytest.raises(TypeError, match=r"device must be a flce_policy.DeviceInfo.*DeviceInfo.synthetic\('H100'\)"):
        FLCEPolicy().resolve(Problem(8192, 4096, 128256), "H100")  # type: ignore[arg-type]


@pytest.mark.parametrize("family", [None, 100, ("H100",)])
def test_synthetic_device_names_a_family_that_is_not_a_name(family):
    with pytest.raises(TypeError, match=r"DeviceInfo.synthetic\(family\): family must be a GPU family name"):
        DeviceInfo.synthetic(family)  # type: ignore[arg-type]
