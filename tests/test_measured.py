"""The ``measured`` strategy on the CPU: the interpreter runs the kernels, a fake clock prices each geometry.

The clock is the only thing faked: every call runs the real loss at the geometry the search chose, and each call's
loss and gradients are compared, bit for bit, with a plain call given that geometry, and with an fp32 torch
reference on explicit logits. The times are the test's own table, so the pick is known in advance (no timing is
asserted). The disk cache lives in a temporary folder (``FLCE_POLICY_CACHE``).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from _two_ranks import rank_main, recorded_geometries, run_two_ranks
from test_loss_kernel import NEEDS_KERNEL_DEVICE

from flce_policy import DeviceRule, FLCEPolicy, OOMFallbackWarning, fused_linear_cross_entropy
from flce_policy.call import autograd
from flce_policy.engine import pick_cache
from flce_policy.kernels import KERNELS_INTERPRETED
from flce_policy.kernels.driver import inject_oom
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.measuring import BucketPick, Search, candidate_rows, pick
from flce_policy.plan.problem import Problem
from flce_policy.strategies import Measured, SlabBudget, StrategyError, strategy_from_config

pytestmark = [
    NEEDS_KERNEL_DEVICE,
    pytest.mark.skipif(not KERNELS_INTERPRETED, reason="the fake clock stands in for CUDA events on the CPU"),
]

BT, H, V = 64, 16, 96
ROWS = [8, 16, 32, 64]
#: the fake clock's seconds per rows: 32 rows within 1% of 64's, 16 rows much slower (the search stops there)
TIMES = {64: 1.0, 32: 1.005, 16: 1.5, 8: 2.0}
#: the calls a search at TIMES runs: 64, 32 and 16 rows (one untimed and two timed calls each), then the rematch of
#: the pick (32) and its rival (64, the fastest other), four timed calls each in turn
SEARCH_ROWS = [64, 64, 64, 32, 32, 32, 16, 16, 16, 64, 32, 64, 32, 64, 32, 64, 32]


class FakeClock:
    """Prices a call from the geometry it ran (``seconds(geometry)``), and records each one it timed."""

    def __init__(self, seconds=lambda g: TIMES[g.chunk_size]) -> None:
        self.price = seconds
        self.ran: list[Geometry] = []

    def start(self, device):
        return _FakeLap(self)


class _FakeLap:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def stop(self, geometry: Geometry) -> None:
        self.geometry = geometry
        self.clock.ran.append(geometry)

    def seconds(self) -> float:
        return self.clock.price(self.geometry)


@pytest.fixture(autouse=True)
def cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(pick_cache.CACHE_ENV_VAR, str(tmp_path / "picks"))
    pick_cache._warned.clear()
    return tmp_path / "picks"


@pytest.fixture
def ran(monkeypatch):
    """The geometry each loss call completed at, as the OOM fallback returned it."""
    seen: list[Geometry] = []
    real = autograd.run_with_oom_fallback

    def recording(*args, **kwargs):
        out, geometry = real(*args, **kwargs)
        seen.append(geometry)
        return out, geometry

    monkeypatch.setattr(autograd, "run_with_oom_fallback", recording)
    return seen


def measured(**params) -> Measured:
    return Measured(**{"max_slab": "1GiB", "rows": ROWS, **params})


def inputs(seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BT, H, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=gen) * 0.3).to(dtype).requires_grad_()
    y = torch.randint(0, V, (BT,), generator=gen)
    return x, w, y


def loss_and_grads(x, w, y, policy):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fused_linear_cross_entropy(x, w, y, policy=policy)
    loss.backward()
    return loss.detach(), x.grad, w.grad


def check_equal_to_plain(x, w, y, policy, geometry_seen):
    """The call under ``policy`` equals a plain call at the geometry it ran, and the fp32 reference."""
    loss, gx, gw = loss_and_grads(x, w, y, policy)
    geometry = geometry_seen[-1]
    plain = Geometry.for_problem(geometry.problem, geometry.chunk_size, slab_form=geometry.slab_form)
    ref_loss, ref_gx, ref_gw = loss_and_grads(x, w, y, plain)
    assert torch.equal(loss, ref_loss) and torch.equal(gx, ref_gx) and torch.equal(gw, ref_gw)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch_loss = F.cross_entropy(xr @ wr.T, y)
    torch_loss.backward()
    torch.testing.assert_close(loss, torch_loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, wr.grad, rtol=1e-4, atol=1e-5)
    return geometry


# --- the core ----------------------------------------------------------------------------------------------


def test_candidate_rows_are_powers_of_two_from_256_and_the_limit():
    assert candidate_rows(16384) == (16384, 8192, 4096, 2048, 1024, 512, 256)
    assert candidate_rows(3000) == (3000, 2048, 1024, 512, 256)  # BT itself when one chunk fits
    assert candidate_rows(100) == (100,)
    assert candidate_rows(64, rows=[8, 128, 16]) == (16, 8)


def test_pick_is_the_smallest_slab_within_the_tolerance():
    problem = Problem(tokens=4096, hidden=64, vocab=1024)
    g = {rows: Geometry.for_problem(problem, rows) for rows in (512, 1024, 2048)}
    assert pick({g[2048]: 1.00, g[1024]: 1.009, g[512]: 1.03}) == g[1024]
    assert pick({g[2048]: 1.00, g[1024]: 1.011, g[512]: 1.03}) == g[2048]
    assert pick({g[2048]: 1.00, g[1024]: 1.019, g[512]: 1.03}, tolerance=0.02) == g[1024]
    assert pick({g[2048]: 1.10, g[1024]: 1.00, g[512]: 1.008}) == g[512]
    rows_form = g[1024].with_slab_form("scaled_exp_rows")
    assert pick({g[1024]: 1.00, rows_form: 0.99}) == rows_form  # equal slabs: the faster
    with pytest.raises(ValueError):
        pick({})


def test_search_goes_down_each_form_until_one_is_slower():
    problem = Problem(tokens=BT, hidden=H, vocab=V)
    geometries = [Geometry.for_problem(problem, r) for r in (64, 32, 16, 8)]
    search = Search(geometries, warmup_calls=1, timed_calls=2)
    order = []
    while (step := search.next()) is not None:
        geometry, timed = step
        order.append((geometry.chunk_size, timed))
        search.record(geometry, TIMES[geometry.chunk_size] if timed else None)
    assert (
        order
        == [(64, False), (64, True), (64, True), (32, False), (32, True), (32, True)]
        + [
            (16, False),
            (16, True),
            (16, True),
        ]
        + [(64, True), (32, True)] * 4
    )  # 16 rows is 1.5x: 8 rows is never run; then the rematch
    assert search.pick().chunk_size == 32


def _searched(search: Search, seconds) -> list[int]:
    """Runs ``search`` to its end, each call priced by ``seconds(rows, rematching)``; the rows of each call."""
    rows = []
    while (step := search.next()) is not None:
        geometry, timed = step
        rows.append(geometry.chunk_size)
        search.record(geometry, seconds(geometry.chunk_size, search._rematch is not None) if timed else None)
    return rows


def test_the_rematch_keeps_the_rival_where_the_pick_falls_behind_it():
    """32 rows timed within 1% of 64 one after the other, 5% slower when the two take turns: 64 is kept."""
    problem = Problem(tokens=BT, hidden=H, vocab=V)
    geometries = [Geometry.for_problem(problem, r) for r in (64, 32, 16, 8)]
    search = Search(geometries, warmup_calls=0, timed_calls=2)
    rematch = {64: 1.0, 32: 1.05}
    rows = _searched(search, lambda r, rematching: (rematch if rematching else TIMES)[r])
    assert rows == [64, 64, 32, 32, 16, 16] + [64, 32] * 4
    assert search.pick().chunk_size == 64


def test_the_rematch_can_overturn_a_pick_that_was_the_fastest():
    """32 rows 1% faster than 64 one after the other (so picked), 5% slower when the two take turns: 64 is kept, as
    on the H200 where 2048 rows of the 5376-wide head timed fastest and then ran 5.7% behind 4096 in steady state."""
    problem = Problem(tokens=BT, hidden=H, vocab=V)
    geometries = [Geometry.for_problem(problem, r) for r in (64, 32, 16, 8)]
    search = Search(geometries, warmup_calls=0, timed_calls=2)
    blocks, rematch = {64: 1.01, 32: 1.0, 16: 1.5}, {64: 1.0, 32: 1.05}
    rows = _searched(search, lambda r, rematching: (rematch if rematching else blocks)[r])
    assert rows == [64, 64, 32, 32, 16, 16] + [64, 32] * 4
    assert search.pick().chunk_size == 64


def test_the_rematch_pits_a_pick_against_the_incumbent_not_the_runner_up():
    """Two forms: the logits slab at 64 rows timed fastest one after the other (one lucky call), the row-scaled slab
    at 64 rows is what the cost model would run unmeasured (the incumbent). The rematch is the pick against the
    incumbent, not against the runner-up (logits at 32 rows), and the incumbent wins it, as on the H100 where the
    logits slab's 4096 rows timed fastest and then ran 4.4% behind the row-scaled slab's."""
    problem = Problem(tokens=BT, hidden=H, vocab=V, dtype="bfloat16")
    geometries = [
        Geometry.for_problem(problem, r, slab_form=f) for f in ("scaled_exp_rows", "logits") for r in (64, 32, 16)
    ]
    blocks = {("scaled_exp_rows", 64): 1.04, ("scaled_exp_rows", 32): 1.06, ("logits", 64): 1.0, ("logits", 32): 1.02}
    rematch = {("scaled_exp_rows", 64): 1.0, ("logits", 64): 1.044, ("logits", 32): 1.06}
    for incumbent, kept in (("scaled_exp_rows", ("scaled_exp_rows", 64)), (None, ("logits", 64))):
        search = Search(geometries, warmup_calls=0, timed_calls=1, incumbent_form=incumbent)
        ran = []
        while (step := search.next()) is not None:
            geometry, _ = step
            key = (geometry.slab_form, geometry.chunk_size)
            ran.append(key)
            search.record(geometry, (rematch if search._rematch is not None else blocks).get(key, 1.5))
        rival = ("scaled_exp_rows", 64) if incumbent else ("logits", 32)  # without one: the fastest other
        assert ran[-8:] == [rival, ("logits", 64)] * 4
        assert (search.pick().slab_form, search.pick().chunk_size) == kept


def test_the_rematch_compares_medians_and_keeps_a_pick_within_the_tolerance():
    """One slow call of the pick in the rematch (a stall) does not overturn it; a pick within 1% of its rival
    stays; with no rival (one candidate) there is no rematch."""
    problem = Problem(tokens=BT, hidden=H, vocab=V)
    geometries = [Geometry.for_problem(problem, r) for r in (64, 32, 16, 8)]
    search = Search(geometries, warmup_calls=0, timed_calls=1)
    stall = iter([1.0, 1.0, 9.0, 1.0])  # the pick's (32 rows) rematch calls
    blocks = {64: 1.0, 32: 1.005, 16: 1.5}
    rows = _searched(search, lambda r, rematching: (next(stall) if r == 32 else 1.0) if rematching else blocks[r])
    assert rows == [64, 32, 16] + [64, 32] * 4
    assert search.pick().chunk_size == 32
    within = Search(geometries, warmup_calls=0, timed_calls=1)
    _searched(within, lambda r, rematching: ({64: 1.0, 32: 1.008} if rematching else blocks)[r])
    assert within.pick().chunk_size == 32
    alone = Search(geometries[:1], warmup_calls=1, timed_calls=2)
    assert _searched(alone, lambda r, rematching: 1.0) == [64, 64, 64]
    assert alone.pick().chunk_size == 64


# --- the strategy ------------------------------------------------------------------------------------------


def test_yaml_round_trip_and_errors():
    strategy = strategy_from_config({"strategy": "measured", "cap": {"strategy": "memory_rule"}, "rows": [256]})
    assert strategy_from_config(strategy.to_config()) == strategy
    with pytest.raises(StrategyError, match="memory limit"):
        Measured().validate_params()
    with pytest.raises(StrategyError, match="timed_calls"):
        Measured(max_slab="1GiB", timed_calls=0).validate_params()
    with pytest.raises(StrategyError, match="slab_forms"):
        Measured(max_slab="1GiB", slab_forms=["bogus"]).validate_params()


def test_nothing_measures_without_a_clock_on_the_cpu(ran):
    """The CPU is deterministic: the limit's geometry, every call."""
    policy = FLCEPolicy(default=measured(), min_chunk_size=1)
    x, w, y = inputs(0)
    for _ in range(3):
        loss_and_grads(x, w, y, policy)
    assert [g.chunk_size for g in ran] == [64, 64, 64]


# --- measuring on the calls --------------------------------------------------------------------------------


def test_every_call_equals_a_plain_call_at_its_geometry_and_the_pick_is_kept(ran):
    clock = FakeClock()
    policy = FLCEPolicy(default=measured(), min_chunk_size=1, clock=clock)
    rows = []
    for step in range(len(SEARCH_ROWS) + 3):
        rows.append(check_equal_to_plain(*inputs(step), policy, ran).chunk_size)
        del ran[:]
    assert rows == [*SEARCH_ROWS, 32, 32, 32]
    assert [g.chunk_size for g in clock.ran] == SEARCH_ROWS  # nothing timed after the pick
    assert policy.measured_pick(Problem(tokens=BT, hidden=H, vocab=V, dtype="float32"), _cpu())[0].chunk_size == 32


def _cpu():
    from flce_policy.plan.device import DeviceInfo

    return DeviceInfo.cpu()


def run_calls(policy, count, seed=0, dtype=torch.float32):
    for step in range(count):
        loss_and_grads(*inputs(seed + step, dtype), policy)


def test_a_second_run_starts_from_the_cached_pick(cache_folder):
    first = FakeClock()
    run_calls(FLCEPolicy(default=measured(), min_chunk_size=1, clock=first), len(SEARCH_ROWS) + 1)
    assert len(first.ran) == len(SEARCH_ROWS)
    files = list(cache_folder.glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert (stored["chunk_size"], stored["slab_form"]) == (32, "logits")
    assert stored["key"]["problem"] == f"BT 1-256 H={H} V={V} float32 tp1"  # BT={BT}: the first bucket
    second = FakeClock()
    policy = FLCEPolicy(default=measured(), min_chunk_size=1, clock=second)
    run_calls(policy, 3)
    assert second.ran == []  # no measuring call
    pick_, source = policy.measured_pick(Problem(tokens=BT, hidden=H, vocab=V, dtype="float32"), _cpu())
    assert pick_.chunk_size == 32 and source.startswith("cache, measured ")


def test_the_cache_key_holds_the_gpu_the_versions_the_problem_the_kind_and_the_strategy():
    from flce_policy.plan.device import DeviceInfo

    problem = Problem(tokens=BT, hidden=H, vocab=V)
    key = pick_cache.pick_key(DeviceInfo.synthetic("H100"), problem, "", measured().params_key())
    assert key.gpu == "NVIDIA H100 80GB HBM3"
    assert key.total_memory_bytes == DeviceInfo.synthetic("H100").total_memory_bytes
    assert key.torch == torch.__version__ and key.driver and key.triton and key.flce_policy
    others = [
        pick_cache.pick_key(DeviceInfo.synthetic("H200"), problem, "", measured().params_key()),
        pick_cache.pick_key(DeviceInfo.synthetic("H100"), Problem(tokens=BT * 8, hidden=H, vocab=V), "", key.strategy),
        pick_cache.pick_key(DeviceInfo.synthetic("H100"), problem, "bias", key.strategy),
        pick_cache.pick_key(DeviceInfo.synthetic("H100"), problem, "", measured(max_slab="2GiB").params_key()),
        key.model_copy(update={"triton": "0.0"}),
    ]
    assert len({pick_cache._path(k) for k in [key, *others]}) == 6
    same_bucket = pick_cache.pick_key(
        DeviceInfo.synthetic("H100"), Problem(tokens=BT * 2, hidden=H, vocab=V), "", key.strategy
    )
    assert same_bucket == key  # BT 64 and 128 share the bucket BT 1-256


@pytest.mark.parametrize("damage", ["garbage", "foreign", "bad_rows"])
def test_a_corrupt_or_foreign_cache_file_is_ignored_with_one_warning(cache_folder, damage):
    run_calls(FLCEPolicy(default=measured(), min_chunk_size=1, clock=FakeClock()), len(SEARCH_ROWS) + 1)
    (path,) = cache_folder.glob("*.json")
    data = json.loads(path.read_text())
    if damage == "garbage":
        path.write_text("{not json")
    elif damage == "foreign":
        data["key"]["torch"] = "0.0-elsewhere"
        data["chunk_size"] = 8
        path.write_text(json.dumps(data))
    else:
        data["chunk_size"] = -4
        path.write_text(json.dumps(data))
    clock = FakeClock()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_calls(FLCEPolicy(default=measured(), min_chunk_size=1, clock=clock), len(SEARCH_ROWS) + 1)
        run_calls(FLCEPolicy(default=measured(), min_chunk_size=1, clock=FakeClock()), 1)
    ours = [w for w in caught if issubclass(w.category, pick_cache.PickCacheWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert len(clock.ran) == len(SEARCH_ROWS)  # measured again, never trusted
    assert json.loads(path.read_text())["chunk_size"] == 32  # and rewritten


def test_an_oom_during_measuring_drops_the_candidate_and_the_call_is_right(ran):
    clock = FakeClock()
    policy = FLCEPolicy(default=measured(), min_chunk_size=1, clock=clock)
    rows = []
    with inject_oom(above_rows=32), warnings.catch_warnings():
        warnings.simplefilter("ignore", OOMFallbackWarning)
        for step in range(16):
            rows.append(check_equal_to_plain(*inputs(step), policy, ran).chunk_size)
            del ran[:]
    # 64 rows ran out of memory: that call completed at 32, and the search went on from 32 down; then the rematch
    assert rows == [32, 32, 32, 32, 16, 16, 16] + [16, 32] * 4 + [32]
    assert 64 not in {g.chunk_size for g in clock.ran}


def test_the_forms_are_measured_and_a_rule_pins_one(ran):
    """bf16 (the scaled-exp slab's forms need 16-bit logits): each form measured from its most rows down; the
    scaled-exp rows slab 5% faster here, so kept."""
    clock = FakeClock(lambda g: TIMES[g.chunk_size] * (0.95 if g.slab_form == "scaled_exp_rows" else 1.0))
    policy = FLCEPolicy(default=measured(slab_forms=["logits", "scaled_exp_rows"]), min_chunk_size=1, clock=clock)
    run_calls(policy, 28, dtype=torch.bfloat16)
    assert [(g.chunk_size, g.slab_form[0]) for g in clock.ran[:18:3]] == [(64, "s"), (32, "s"), (16, "s")] + [
        (64, "l"),
        (32, "l"),
        (16, "l"),
    ]
    # the pick (32 rows, scaled-exp) against its rival (64 rows, scaled-exp), in turn
    assert [(g.chunk_size, g.slab_form[0]) for g in clock.ran[18:]] == [(64, "s"), (32, "s")] * 4
    assert (ran[-1].chunk_size, ran[-1].slab_form) == (32, "scaled_exp_rows")
    pinned = FLCEPolicy(default=measured(), min_chunk_size=1, clock=FakeClock(), slab_form="scaled_exp_rows")
    run_calls(pinned, 10, dtype=torch.bfloat16)
    assert {g.slab_form for g in ran[-10:]} == {"scaled_exp_rows"}


def test_a_strategy_given_to_the_loss_measures_in_its_own_policy(ran, monkeypatch):
    # given directly there is no policy to hold a clock: on the CPU nothing measures, the limit runs
    run_calls(measured(), 2)
    assert [g.chunk_size for g in ran] == [64, 64]


# --- several ranks -----------------------------------------------------------------------------------------


def _rank_worker(rank: int, port: int, out_dir: str, cache: str) -> None:
    import os

    def body() -> dict:
        os.environ[pick_cache.CACHE_ENV_VAR] = cache
        # rank 1's clock would pick 16 rows; rank 0's picks 32: every rank must run rank 0's choices
        times = TIMES if rank == 0 else {64: 3.0, 32: 2.0, 16: 1.0, 8: 1.2}
        clock = FakeClock(lambda g: times[g.chunk_size])
        policy = FLCEPolicy(default=measured(), min_chunk_size=1, clock=clock)
        with recorded_geometries() as seen:
            for step in range(len(SEARCH_ROWS) + 3):
                loss_and_grads(*inputs(step), policy)
        return {"rows": [g.chunk_size for g in seen], "timed": len(clock.ran)}

    rank_main(rank, port, out_dir, body, timeout_s=120)


def test_rank_0_measures_and_every_rank_runs_its_choices(tmp_path):
    results = run_two_ranks(_rank_worker, tmp_path, str(tmp_path / "picks"))
    expected = [*SEARCH_ROWS, 32, 32, 32]
    assert results[0]["rows"] == results[1]["rows"] == expected
    assert results[0]["timed"] == len(SEARCH_ROWS) and results[1]["timed"] == 0  # rank 1 follows, timing nothing


# --- explain and the cache command --------------------------------------------------------------------------


def test_explain_shows_a_cached_pick_and_the_cache_command_lists_and_clears_it(cache_folder, capsys):
    from flce_policy.cli import main
    from flce_policy.plan.device import DeviceInfo

    gpu = DeviceInfo.synthetic("L4").model_copy(update={"index": 0, "source": "nvml"})  # as probed
    problem = Problem(tokens=8192, hidden=4096, vocab=128256)

    def policy() -> FLCEPolicy:  # the L4 measured within its packaged slab
        return FLCEPolicy(rules=[DeviceRule("L4", Measured(cap=SlabBudget("128MiB")))])

    assert "Measured:    not yet" in policy().explain(problem, gpu)
    strategy = policy().resolve_rule(gpu)[1]
    geometry = Geometry.for_problem(problem, 256)
    pick = BucketPick.of(geometry)
    pick_cache.store(pick_cache.pick_key(gpu, problem, "", strategy.params_key()), pick, {geometry: 0.0125})
    text = policy().explain(problem, gpu)
    assert "Measured:    256 rows on the logits slab, from cache, measured 20" in text
    assert "(the bucket BT 4097-8192)" in text
    assert "Chunk size:  256 rows" in text
    assert main(["cache", "list", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)["picks"]
    assert (listed["gpu"], listed["chunk_size"]) == ("NVIDIA L4", 256)
    assert listed["problem"] == "BT 4097-8192 H=4096 V=128256 bfloat16 tp1"
    assert listed["times_ms"] == {"256 logits": 12.5}
    assert main(["cache", "clear"]) == 0
    assert "deleted 1 picks" in capsys.readouterr().out
    assert "Measured:    not yet" in policy().explain(problem, gpu)


# --- the forms measured --------------------------------------------------------------------------------------


def _forms(family: str, problem: Problem, **params) -> list[str]:
    """The forms a measured search of ``problem`` times on a synthetic ``family`` GPU (its candidates' forms)."""
    from flce_policy.engine.measured_head import MeasuredHead
    from flce_policy.plan.device import DeviceInfo

    device = DeviceInfo.synthetic(family)
    strategy = Measured(max_slab="2GiB", **params)
    head = MeasuredHead(strategy, device, rule="default", slab_form=None, fallback=None, clock=None)  # type: ignore[arg-type]
    search = head._search(problem, "")
    return list(dict.fromkeys(g.slab_form for g in search.search.geometries))


def test_form_margin_prunes_the_forms_predicted_slow():
    """On an H100 at a 1024-wide head the logits slab is predicted over 20% slower than the scaled-exp forms: not
    measured (its kernels not compiled), the Triton GEMM's form 1.3% slower than the Gluon GEMM's: both measured; at
    a 5376-wide head the logits slab 2% slower: measured; None measures every form it runs."""
    small, large = Problem(16384, 1024, 131072), Problem(8192, 5376, 262144)
    assert _forms("H100", small) == ["scaled_exp_ws", "scaled_exp_rows"]
    assert _forms("H100", large) == ["scaled_exp_rows", "logits"]
    assert _forms("H100", small, form_margin=None) == ["scaled_exp_ws", "scaled_exp_rows", "logits"]
    assert _forms("H200", small, form_margin=None) == ["scaled_exp_ws", "scaled_exp_rows", "logits"]
    assert _forms("H100", small, slab_forms=["logits"]) == ["logits"]  # a list is measured as given
    assert _forms("A100", small) == ["logits"]  # the only form before Hopper


def test_form_margin_round_trips_and_is_checked():
    for margin in (0.25, None, 0):
        strategy = Measured(max_slab="1GiB", form_margin=margin)
        assert strategy_from_config(strategy.to_config()) == strategy
        assert strategy_from_config(strategy.to_config()).form_margin == margin
    for bad in (-0.1, "10%", True):
        with pytest.raises(StrategyError, match="form_margin must be a number >= 0"):
            Measured(max_slab="1GiB", form_margin=bad).validate_params()
