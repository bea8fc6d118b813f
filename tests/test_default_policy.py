"""The packaged default.yaml follows its own documented rule, entry by entry.

Measured rules (H200, H100) run as written. Every other GPU is ``measured`` within a derived limit, which is what
runs where nothing measures (a GPU planned without it, as here): on cards of 80 GB and more the H100's measured rule,
a 5 GiB slab for heads up to H=3072 and for larger heads 2 GiB or the memory rule's slab where larger; on smaller
cards the memory rule, max_slab = max(128 MiB, largest power of two <= 3% of (total - 64 GiB)), with the total
memory of the family's common part (DeviceInfo.synthetic). H200's entry is measured (results/) and must agree with
the rule as well at V=262144; its budget (2.5 GiB) gives Qwen's 151936 classes 8192 rows where 2 GiB gives 4096;
the heads on its Gluon GEMM (H <= 3072) get a 5 GiB slab. The CPU keeps Liger-Kernel's c=1.
"""

from __future__ import annotations

import pytest

from flce_policy import DeviceInfo, FLCEPolicy, Problem
from flce_policy.engine import pick_cache
from flce_policy.plan.device import KNOWN_GPUS

GIB, MIB = 2**30, 2**20


def rule_budget(total_bytes: int) -> int:
    share = 0.03 * (total_bytes - 64 * GIB)
    power = 1
    while power * 2 <= share:
        power *= 2
    return max(128 * MIB, power)


EIGHTY_GB = 80 * 10**9


@pytest.mark.parametrize("family", [gpu.family for gpu in KNOWN_GPUS if gpu.family != "H200"])
def test_each_known_gpu_gets_the_rule_budget(family):
    device = DeviceInfo.synthetic(family)
    policy = FLCEPolicy.packaged()
    # Gemma-4 31B head at 64k tokens: BT never caps the chunk, so the slab is the budget's.
    large = policy.resolve(Problem(65536, 5376, 262144), device)
    # a 0.5B-class head: 5 GiB holds 20480 rows of V=131072, the power of two below is 16384 (4 GiB)
    small = policy.resolve(Problem(65536, 1024, 131072), device)
    assert large.rule != "default", f"{family} falls through to the default rule"
    budget = rule_budget(device.total_memory_bytes)
    if device.total_memory_bytes >= EIGHTY_GB:
        assert large.slab_bytes == max(2 * GIB, budget), family
        assert small.slab_bytes == 4 * GIB, family
    else:
        assert large.slab_bytes == small.slab_bytes == budget, family


def test_the_144gb_gh200_gets_the_same_rule():
    big = DeviceInfo.synthetic("GH200").model_copy(update={"total_memory_bytes": 141 * GIB})
    geometry = FLCEPolicy.packaged().resolve(Problem(65536, 5376, 262144), big)
    assert geometry.slab_bytes == max(2 * GIB, rule_budget(141 * GIB)) == 2 * GIB


def test_the_40gb_a100_gets_the_floor():
    small = DeviceInfo.synthetic("A100").model_copy(update={"total_memory_bytes": 40 * GIB})
    geometry = FLCEPolicy.packaged().resolve(Problem(65536, 5376, 262144), small)
    assert geometry.slab_bytes == 128 * MIB


def test_the_h200_gives_small_heads_a_5gib_slab_and_the_large_heads_the_rule_slab():
    h200 = DeviceInfo.synthetic("H200")
    policy = FLCEPolicy.packaged()
    # the Gluon GEMM's heads (H <= 3072) take a 5 GiB slab: one chunk of 16384 tokens at V <= 151936 (4.64 GiB)
    assert policy.resolve(Problem(16384, 896, 151936), h200).chunk_size == 16384
    assert policy.resolve(Problem(16384, 2048, 151936), h200).chunk_size == 16384
    assert policy.resolve(Problem(65536, 1024, 131072), h200).chunk_size == 16384  # 4 GiB: 20480 rows would be 5
    # 8192 rows at V=262144 (4 GiB; 10240 rows would be 5 GiB)
    assert policy.resolve(Problem(16384, 1152, 262144), h200).chunk_size == 8192
    assert policy.resolve(Problem(16384, 3072, 262144), h200).chunk_size == 8192
    assert policy.resolve(Problem(4096, 1152, 262144), h200).chunk_size == 4096  # BT caps it
    assert policy.resolve(Problem(16384, 3080, 262144), h200).chunk_size == 4096  # over ws_max_hidden: 2 GiB
    assert policy.resolve(Problem(32768, 4096, 128256), h200).chunk_size == 8192  # 1.96 GiB


MEASURED_RULES = ("H200", "H100")


def test_every_gpu_without_a_measured_rule_measures_and_the_measured_rules_stay():
    """The issue's rule: the H200's and H100's rules stay as measured; every other known GPU measures (its limit,
    the derived rule, is checked above: the geometry that runs where nothing measures)."""
    policy = FLCEPolicy.packaged()
    for gpu in KNOWN_GPUS:
        strategy = policy.resolve_rule(DeviceInfo.synthetic(gpu.family))[1]
        assert strategy.measures == (gpu.family not in MEASURED_RULES), gpu.family
    h100 = policy.resolve(Problem(65536, 5376, 262144), DeviceInfo.synthetic("H100"))
    assert "match H100" in h100.rule and h100.slab_bytes == 2 * GIB  # the measured rule: 2 GiB above H=3072
    assert policy.default_strategy.measures


def test_the_cpu_keeps_liger_c1_and_measures_nothing():
    """No GPU: Liger-Kernel's chunk rule at c=1, next_pow2(cdiv(BT, cdiv(V, H))), by a rule of its own."""
    rule, strategy = FLCEPolicy.packaged().resolve_rule(DeviceInfo.cpu())
    assert rule == "devices[0] (match cpu)" and not strategy.measures
    for tokens, hidden, vocab in [(8192, 4096, 128256), (1000, 896, 151936), (37, 61, 509)]:
        rows = -(-tokens // -(-vocab // hidden))
        liger = 1 << (rows - 1).bit_length()
        geometry = FLCEPolicy.packaged().resolve(Problem(tokens, hidden, vocab), DeviceInfo.cpu())
        assert geometry.chunk_size == min(liger, tokens), (tokens, hidden, vocab)


@pytest.mark.parametrize("total_gib", [24, 48, 79, 80, 96, 141, 288])
def test_an_unknown_gpu_measures_within_the_memory_rule(total_gib):
    """A GPU no rule names: below 80 GB the default, the memory rule's slab; from 80 GB the last rule, the H100's
    rule or the memory rule's slab where larger."""
    unknown = DeviceInfo(name="NVIDIA Future GPU", family="unknown", total_memory_bytes=total_gib * GIB, source="nvml")
    policy = FLCEPolicy.packaged()
    assert policy.resolve_rule(unknown)[1].measures
    large = policy.resolve(Problem(65536, 5376, 262144), unknown)
    small = policy.resolve(Problem(65536, 1024, 131072), unknown)
    budget = rule_budget(unknown.total_memory_bytes)
    if unknown.total_memory_bytes >= EIGHTY_GB:
        assert "match *" in large.rule
        assert large.slab_bytes == max(2 * GIB, budget) and small.slab_bytes == max(4 * GIB, budget)
    else:
        assert large.rule == "default" and large.slab_bytes == small.slab_bytes == budget


def test_explain_on_a_derived_gpu_says_not_yet_measured_and_shows_the_limit(tmp_path, monkeypatch):
    """An L4 as probed, nothing cached: measured, not yet, and the limit: 128 MiB holds 523 rows of V=128256 in
    bf16, so 512 rows."""
    monkeypatch.setenv(pick_cache.CACHE_ENV_VAR, str(tmp_path))
    l4 = DeviceInfo.synthetic("L4").model_copy(update={"index": 0, "source": "nvml"})
    text = FLCEPolicy.packaged().explain(Problem(8192, 4096, 128256), l4)
    assert "Rule:        devices[15] (match L4)" in text
    assert "Measured:    not yet: the first calls of its BT bucket (the bucket BT 4097-8192)" in text
    assert "within the limit below" in text and "Chunk size:  512 rows" in text
    planned = FLCEPolicy.packaged().explain(Problem(8192, 4096, 128256), DeviceInfo.synthetic("L4"))
    assert "Measured:    on that GPU" in planned and "Chunk size:  512 rows" in planned
