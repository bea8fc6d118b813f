"""The packaged default.yaml follows its own documented rule, entry by entry.

Derived entries: on cards of 80 GB and more the H100's measured rule, a 5 GiB slab for heads up to H=3072 and for
larger heads 2 GiB or the memory rule's slab where larger; on smaller cards the memory rule,
max_slab = max(128 MiB, largest power of two <= 3% of (total - 64 GiB)), with
the total memory of the family's common part (DeviceInfo.synthetic). H200's entry is measured
(results/) and must agree with the rule as well at V=262144; its budget (2.5 GiB) gives Qwen's 151936 classes
8192 rows where 2 GiB gives 4096; the heads on its Gluon GEMM (H <= 3072) get a 5 GiB slab.
"""

from __future__ import annotations

import pytest

from flce_policy import DeviceInfo, FLCEPolicy, Problem
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
