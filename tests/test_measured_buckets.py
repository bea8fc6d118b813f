"""``measured`` under a varying BT (dynamic padding): one search and one cached pick per BT bucket, on one rank and
on two (gloo), where the ranks' BT and buckets differ.

The clock is faked as in tests/test_measured.py, pricing a call per row (its BT times the cost of a row at its
rows' power of two), so calls of any BT in a bucket time a candidate alike and the pick is known in advance: 256
rows 1.0, 128 rows 1.005 (within 1%: kept, the smaller slab), 64 rows 1.5 (the search stops there). The BT stay
small (the interpreter's time grows with the rows): the buckets BT 1-256 (at 129-256) and 257-512.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from _two_ranks import rank_main, recorded_geometries, run_two_ranks
from test_loss_kernel import NEEDS_KERNEL_DEVICE
from test_measured import FakeClock, cache_folder, check_equal_to_plain, loss_and_grads, ran  # noqa: F401

from flce_policy import FLCEPolicy
from flce_policy.kernels import KERNELS_INTERPRETED
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.problem import Problem
from flce_policy.plan.units import next_pow2
from flce_policy.strategies import Measured

pytestmark = [
    NEEDS_KERNEL_DEVICE,
    pytest.mark.skipif(not KERNELS_INTERPRETED, reason="the fake clock stands in for CUDA events on the CPU"),
]

H, V = 16, 96
ROWS = [64, 128, 256]
PER_ROW = {256: 1.0, 128: 1.005, 64: 1.5}
PICKED = 128  # the fake clock's pick: every BT here is above it
#: rows each call runs while a bucket is measured, in the search's order: 256, 128, 64, each 1 untimed + 2 timed,
#: then the rematch of the pick (128) and its rival (256), four timed calls each in turn
SEARCH = [256] * 3 + [128] * 3 + [64] * 3 + [256, 128] * 4
LOW, HIGH = (129, 256), (257, 320)  # BT of the buckets 1-256 and 257-512


def per_row_clock(per_row=PER_ROW) -> FakeClock:
    return FakeClock(lambda g: g.problem.tokens * per_row[next_pow2(g.chunk_size)])


def measured(**params) -> Measured:
    return Measured(**{"max_slab": "1GiB", "rows": ROWS, **params})


def inputs(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).requires_grad_()
    w = (torch.randn(V, H, generator=gen) * 0.3).requires_grad_()
    return x, w, torch.randint(0, V, (tokens,), generator=gen)


def tokens_in(low: int, high: int, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(count)]


def test_a_bucket_is_measured_once_over_calls_of_any_bt_in_it(ran, cache_folder):  # noqa: F811
    """20 calls of BT 129..256: one search (13 measuring calls), each call equal to a plain call at the geometry it
    ran; then the pick at every BT, min(128, BT) rows; one cache file."""
    clock = per_row_clock()
    policy = FLCEPolicy(default=measured(), min_chunk_size=1, clock=clock)
    bts = tokens_in(*LOW, 20, seed=1)
    rows = []
    for step, tokens in enumerate(bts):
        rows.append(check_equal_to_plain(*inputs(tokens, step), policy, ran).chunk_size)
        del ran[:]
    assert len(clock.ran) == len(SEARCH)
    assert rows == [min(r, t) for r, t in zip(SEARCH + [PICKED] * (20 - len(SEARCH)), bts, strict=True)]
    assert len(list(cache_folder.glob("*.json"))) == 1


def run_calls(policy, bts, seed=0):
    for step, tokens in enumerate(bts):
        loss_and_grads(*inputs(tokens, seed + step), policy)


def test_a_new_bucket_measures_again_and_a_second_policy_reuses_both(ran, cache_folder):  # noqa: F811
    clock = per_row_clock()
    policy = FLCEPolicy(default=measured(), min_chunk_size=1, clock=clock)
    run_calls(policy, tokens_in(*LOW, len(SEARCH) + 1, seed=2))
    run_calls(policy, tokens_in(*HIGH, len(SEARCH) + 1, seed=3))
    assert len(clock.ran) == 2 * len(SEARCH)
    assert {g.problem.tokens > 256 for g in clock.ran[len(SEARCH) :]} == {True}  # the second search: BT 257-512
    assert len(list(cache_folder.glob("*.json"))) == 2
    second = per_row_clock()
    policy = FLCEPolicy(default=measured(), min_chunk_size=1, clock=second)
    del ran[:]
    run_calls(policy, [130, 256, 257, 300])
    assert second.ran == []  # no measuring call: both buckets from the cache
    assert [g.chunk_size for g in ran] == [PICKED] * 4
    _, source = policy.measured_pick(Problem(500, H, V, dtype="float32"), DeviceInfo.cpu())
    assert source.startswith("cache, measured ")


def test_picks_apply_to_their_bucket_and_one_chunk_stays_one_chunk():
    """A seeded pick at BT=300 holds for BT 257-512; its one chunk of 300 rows is one chunk of any BT there."""
    cpu = DeviceInfo.cpu()
    one_chunk = {"tokens": 300, "hidden": H, "vocab": V, "dtype": "float32", "chunk_size": 300}
    chunked = {"tokens": 1000, "hidden": H, "vocab": V, "dtype": "float32", "chunk_size": 128}
    clock = per_row_clock()
    policy = FLCEPolicy(default=measured(picks=[one_chunk, chunked]), min_chunk_size=1, clock=clock)
    for tokens, rows in ((257, 257), (500, 500), (600, 128), (1024, 128)):  # resolved, not run: any BT
        geometry, _, trial = policy.resolve_call(Problem(tokens, H, V, dtype="float32"), cpu)
        assert (geometry.chunk_size, trial) == (rows, None)
    assert clock.ran == []
    assert "from picks (" in policy.explain(Problem(400, H, V, dtype="float32"), cpu)
    assert "(the bucket BT 257-512)" in policy.explain(Problem(400, H, V, dtype="float32"), cpu)


# --- two ranks ---------------------------------------------------------------------------------------------

WORLD_TIMEOUT_S = 300
#: Per rank, the BT of each call: the same bucket (1-256) at other BT; and other buckets, rank 1 in 257-512 while
#: rank 0 measures 1-256, then the other way round, then rank 1 back in 257-512 once rank 0 has its pick.
_ONE = len(SEARCH) + 1  # a bucket's search and one call at its pick
CASES = {
    "same bucket": (tokens_in(*LOW, _ONE + 2, seed=4), tokens_in(*LOW, _ONE + 2, seed=5)),
    "other buckets": (
        tokens_in(*LOW, _ONE, seed=6) + tokens_in(*HIGH, _ONE + 4, seed=7),
        tokens_in(*HIGH, _ONE, seed=8) + tokens_in(*LOW, _ONE, seed=9) + tokens_in(*HIGH, 4, seed=10),
    ),
}


def _rank_worker(rank: int, port: int, out_dir: str) -> None:
    import os

    from flce_policy.engine import pick_cache

    def body() -> dict:
        result = {}
        for case, bts in CASES.items():
            os.environ[pick_cache.CACHE_ENV_VAR] = str(Path(out_dir, case, f"picks{rank}"))
            # rank 1's clock would pick 64 rows: every rank must run rank 0's choices
            clock = per_row_clock(PER_ROW if rank == 0 else {256: 3.0, 128: 2.0, 64: 1.0})
            policy = FLCEPolicy(default=measured(), min_chunk_size=1, clock=clock)
            with recorded_geometries() as seen:
                run_calls(policy, bts[rank])
            picks = {
                bucket: policy.measured_pick(Problem(bucket, H, V, dtype="float32"), DeviceInfo.cpu())
                for bucket in (256, 512)
            }
            result[case] = {
                "rows": [g.chunk_size for g in seen],
                "timed": len(clock.ran),
                "picks": {b: None if p is None else p[0].chunk_size for b, p in picks.items()},
            }
        return result

    rank_main(rank, port, out_dir, body, timeout_s=60)


def test_ranks_with_other_bt_and_other_buckets_agree_without_a_hang(tmp_path):
    """Each case's calls pair up (a hang fails at the gloo timeout, or the join's); rank 0 alone times; a rank
    runs rank 0's candidate in rank 0's bucket, rank 0's pick once settled, else its limit (one chunk here)."""
    results = run_two_ranks(_rank_worker, tmp_path)

    same = [r["same bucket"] for r in results]
    for rank in range(2):  # both measure 257-512 in lockstep, each at its own BT
        assert same[rank]["rows"] == [
            min(r, t) for r, t in zip(SEARCH + [PICKED] * 3, CASES["same bucket"][rank], strict=True)
        ]
    assert (same[0]["timed"], same[1]["timed"]) == (len(SEARCH), 0)

    other = [r["other buckets"] for r in results]
    bts0, bts1 = CASES["other buckets"]
    assert other[0]["timed"] == 2 * len(SEARCH) and other[1]["timed"] == 0
    assert other[0]["rows"][:_ONE] == [min(r, t) for r, t in zip(SEARCH + [PICKED], bts0[:_ONE], strict=True)]
    assert other[1]["rows"][:_ONE] == bts1[:_ONE]  # 257-512 has no pick yet: its limit, one chunk
    assert other[1]["rows"][_ONE : 2 * _ONE] == [PICKED] * _ONE  # 1-256: rank 0's pick
    assert other[1]["rows"][-1] == PICKED  # 257-512, once rank 0 has measured it
    assert other[0]["picks"] == other[1]["picks"] == {"256": PICKED, "512": PICKED}
