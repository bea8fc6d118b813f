"""The policy side of vocab parallelism: a Problem of one rank's shard, the collectives' cost, explain --tp-size."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from flce_policy.cli import main
from flce_policy.plan.collectives import BYTES_PER_ROW, COLLECTIVES_PER_CHUNK, comm_plan
from flce_policy.plan.cost_model import RATES, predict_seconds, rate_coefficients
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem, vocab_shard_sizes
from flce_policy.strategies import Fastest


@pytest.fixture(autouse=True)
def packaged_policy(monkeypatch):
    monkeypatch.delenv("FLCE_POLICY_CONFIG", raising=False)


def test_problem_knows_its_group_and_dumps_as_before_without_one():
    plain, shard = Problem(8192, 5376, 262144), Problem(8192, 5376, 131072, tp_size=2)
    assert plain.tp_size == 1 and "tp_size" not in plain.model_dump()
    assert shard.model_dump()["tp_size"] == 2
    assert Problem(**shard.model_dump()) == shard
    assert "TP group of 2" in shard.describe() and "TP" not in plain.describe()
    with pytest.raises(ValidationError, match="tp_size"):
        Problem(8, 4, 10, tp_size=0)


@pytest.mark.parametrize(
    ("vocab", "ranks", "sizes"),
    [(262144, 2, [131072, 131072]), (262208, 3, [87403, 87403, 87402]), (97, 2, [49, 48]), (5, 4, [2, 2, 1, 0])],
)
def test_vocab_shard_sizes_follow_torch_chunk(vocab, ranks, sizes):
    assert vocab_shard_sizes(vocab, ranks) == sizes


def test_comm_plan_counts_collectives_per_chunk_and_bytes():
    problem = Problem(32768, 5376, 131072, tp_size=2)
    geometry = Geometry.for_problem(problem, 4096)
    plan = comm_plan(geometry)
    # 8 chunks x (MAX + SUM), the agreeing all-gather, grad_input's all-reduce
    assert plan.collectives == 8 * COLLECTIVES_PER_CHUNK + 2
    assert plan.bytes == 32768 * BYTES_PER_ROW + 32768 * 5376 * 2
    assert comm_plan(geometry, grad_input=False).bytes == 32768 * BYTES_PER_ROW
    assert comm_plan(Geometry.for_problem(Problem(32768, 5376, 131072), 4096)) == (0, 0)


def test_cost_model_charges_collectives_per_chunk_only_under_tp():
    rates = RATES["H200"]
    shard = Problem(32768, 5376, 131072, tp_size=2)
    few, many = (predict_seconds(Geometry.for_problem(shard, rows), rates).terms for rows in (8192, 256))
    assert many["tp_collectives"] - few["tp_collectives"] == pytest.approx(
        (128 - 4) * COLLECTIVES_PER_CHUNK * rates.collective_latency_s
    )
    unsharded = predict_seconds(Geometry.for_problem(Problem(32768, 5376, 131072), 256), rates).terms
    assert unsharded["tp_collectives"] == 0.0
    # calibration fits GEMM and HBM rates only: the collectives stay out of its coefficients
    sharded = rate_coefficients(Geometry.for_problem(shard, 256))
    assert sharded == rate_coefficients(Geometry.for_problem(Problem(32768, 5376, 131072), 256))


def test_half_the_vocabulary_halves_the_slab_of_the_same_strategy():
    device = DeviceInfo.synthetic("H200")
    whole = Fastest(max_slab="1GiB").geometry(Problem(32768, 5376, 262144), device)
    shard = Fastest(max_slab="1GiB").geometry(Problem(32768, 5376, 131072, tp_size=2), device)
    assert shard.problem.tp_size == 2 and shard.slab_bytes <= 2**30
    assert shard.chunk_size * shard.vocab_chunk >= whole.chunk_size * whole.vocab_chunk // 2


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_explain_tp_size_shows_each_rank(capsys):
    args = ("explain", "--vocab", "262208", "--hidden", "5376", "--tp-size", "3", "--device", "H100")
    code, out, _ = run(capsys, *args)
    assert code == 0
    assert "V=87403 (vocab shard of a TP group of 3)" in out
    assert "Collectives:" in out and "rank 2: 87402 classes" in out
    code, out, _ = run(capsys, *args, "--strategy", "slab_budget", "--param", "max_slab=64MiB", "--json")
    data = json.loads(out)
    assert data["problem"]["tp_size"] == 3 and data["problem"]["vocab"] == 87403
    assert [r["vocab_shard"] for r in data["tp_ranks"]] == [87403, 87403, 87402]
    assert {r["runs_at"] for r in data["tp_ranks"]} == {min(r["chunk_size"] for r in data["tp_ranks"])}
    assert data["tp_collectives"]["count"] == data["num_chunks"] * COLLECTIVES_PER_CHUNK + 2


def test_explain_tp_size_with_an_empty_shard_is_an_error(capsys):
    code, _, err = run(capsys, "explain", "--vocab", "5", "--hidden", "8", "--tp-size", "4", "--device", "H100")
    assert code == 2 and "rank 3 an empty vocab shard" in err
