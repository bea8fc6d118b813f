"""A ZeRO-3-partitioned head handed to the loss (DeepSpeed duck-typed: not installed in CI), and explain's note.

The DTensor case needs a process group: tests/test_fsdp2.py checks it on two gloo ranks.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from flce_policy import FLCEPolicy, fused_linear_cross_entropy
from flce_policy.distributed.sharded import gathered_zero3, is_zero3_partitioned
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.memory import gathered_head_bytes
from flce_policy.plan.problem import Problem
from flce_policy.strategies import SlabBudget


def zero3_param(shape: tuple[int, int], status: str) -> torch.nn.Parameter:
    """A parameter as DeepSpeed ZeRO-3 leaves it: empty local data when partitioned, the full one when gathered."""
    p = torch.nn.Parameter(torch.zeros(shape if status == "AVAILABLE" else (0,)))
    p.ds_id, p.ds_shape, p.ds_status = 7, torch.Size(shape), SimpleNamespace(name=status)
    return p


def test_partitioned_weight_raises_a_clear_error_not_a_shape_error():
    weight = zero3_param((96, 16), "NOT_AVAILABLE")
    with pytest.raises(TypeError) as err:
        fused_linear_cross_entropy(torch.randn(4, 16), weight, torch.zeros(4, dtype=torch.long))
    message = str(err.value)
    for fragment in (
        "weight as a DeepSpeed ZeRO-3 partitioned parameter",
        "ds_id 7",
        "NOT_AVAILABLE",
        "full shape (96, 16)",
        "local shape (0,)",
        "GatheredParameters",
        "apply_flce",
        "tp_group",
    ):
        assert fragment in message, fragment
    bias = zero3_param((96,), "INFLIGHT")
    with pytest.raises(TypeError, match=r"got bias as a DeepSpeed ZeRO-3 partitioned parameter .*INFLIGHT"):
        fused_linear_cross_entropy(torch.randn(4, 16), torch.randn(96, 16), torch.zeros(4, dtype=torch.long), bias)


def test_gathered_weight_is_an_ordinary_tensor():
    weight = zero3_param((96, 16), "AVAILABLE")
    hidden, target = torch.randn(5, 16), torch.randint(0, 96, (5,))
    got = fused_linear_cross_entropy(hidden, weight, target)
    expected = torch.nn.functional.cross_entropy(hidden @ weight.detach().T, target)
    assert torch.allclose(got, expected, rtol=1e-5)
    assert not is_zero3_partitioned(weight) and not is_zero3_partitioned(torch.zeros(3))


def test_gather_is_a_no_op_without_partitioned_parameters():
    sys.modules.pop("deepspeed", None)
    with gathered_zero3(torch.zeros(2), None, zero3_param((4, 2), "AVAILABLE")) as gathered:
        assert gathered is False
    assert "deepspeed" not in sys.modules  # never imported for ordinary or gathered parameters


def test_explain_shows_the_gathered_head_beside_the_peak():
    problem = Problem(tokens=8192, hidden=5376, vocab=262144)
    assert gathered_head_bytes(problem) == 262144 * 5376 * 2  # the bf16 head: 2.62 GiB
    h100 = DeviceInfo.synthetic("H100")
    policy = FLCEPolicy(rules=[], default=SlabBudget("256MiB"))
    d = policy.explain_dict(problem, h100)
    assert d["gathered_head_bytes"] == gathered_head_bytes(problem)
    text = policy.explain(problem, h100)
    assert "Sharded W:   under FSDP2 / ZeRO-3 the gathered head (2.62 GiB) is held beside that peak" in text
