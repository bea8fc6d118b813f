"""Built-in chunk strategies, user strategies, and the registry's YAML round-trip."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.problem import Problem
from flce_policy.strategies import (
    BUILTIN_STRATEGIES,
    ByHidden,
    ChunkStrategy,
    Fastest,
    FixedChunkSize,
    FreeMemory,
    HeuristicC,
    Measured,
    MemoryRule,
    ScaledExp,
    SlabBudget,
    StrategyError,
    strategy_class,
    strategy_from_config,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
H100 = DeviceInfo.synthetic("H100")
GEMMA3 = dict(hidden=5376, vocab=262144)  # the shape of Liger's table


@pytest.fixture
def tests_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``tests._custom_strategies`` importable however pytest was started (tests/ has no __init__.py)."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))


# --- heuristic_c: Liger-Kernel's rule ----------------------------------------------------------------------------


def liger_chunk_size(tokens: int, hidden: int, vocab: int, c: int) -> int:
    """Liger-Kernel's FLCE chunk rule, written out from its formula, with the memory constant c."""
    inc_factor = math.ceil(Fraction(vocab, c * hidden))
    wanted = math.ceil(Fraction(tokens, inc_factor))
    chunk = 1
    while chunk < wanted:
        chunk *= 2
    return min(chunk, tokens)


LIGER_TABLE = {c: (32, 256) for c in (1,)}
LIGER_TABLE |= {c: (16, 512) for c in (2, 3)}
LIGER_TABLE |= {c: (8, 1024) for c in (4, 5, 6)}
LIGER_TABLE |= {c: (4, 2048) for c in range(7, 17)}


@pytest.mark.parametrize("c", sorted(LIGER_TABLE))
def test_heuristic_c_reproduces_the_liger_table(c):
    num_chunks, chunk_size = LIGER_TABLE[c]
    geometry = HeuristicC(c=c).geometry(Problem(8192, **GEMMA3), H100)
    assert (geometry.num_chunks, geometry.chunk_size) == (num_chunks, chunk_size)
    assert liger_chunk_size(8192, GEMMA3["hidden"], GEMMA3["vocab"], c) == chunk_size  # the oracle agrees


@pytest.mark.parametrize(
    ("tokens", "hidden", "vocab"),
    list(
        itertools.product(
            [1, 3, 7, 100, 1000, 4097, 8192, 12345, 65536],  # BT: tiny, odd, not a power of two, large
            [1, 64, 4096, 5376],
            [2, 1000, 32000, 151936, 262144],  # V: tiny (V < H) to large
        )
    ),
)
def test_heuristic_c_matches_liger_formula_over_a_grid(tokens, hidden, vocab):
    problem = Problem(tokens, hidden, vocab)
    for c in (1, 2, 3, 7, 16):
        want = liger_chunk_size(tokens, hidden, vocab, c)
        geometry = HeuristicC(c=c).geometry(problem, H100)
        assert geometry.chunk_size == want, (tokens, hidden, vocab, c)
        assert geometry.num_chunks == math.ceil(tokens / want)


def test_heuristic_c_ignores_the_device():
    problem = Problem(8192, **GEMMA3)
    on_cpu = HeuristicC(c=4).geometry(problem, DeviceInfo.cpu())
    on_b300 = HeuristicC(c=4).geometry(problem, DeviceInfo.synthetic("B300"))
    assert on_cpu.chunk_size == on_b300.chunk_size == 1024


def test_heuristic_c_clamps_to_tokens_when_the_power_of_two_exceeds_them():
    # V < H: inc_factor = 1, so Liger wants next_pow2(1000) = 1024 rows, more than BT = 1000.
    geometry = HeuristicC().geometry(Problem(1000, 4096, 1000), H100)
    assert (geometry.chunk_size, geometry.num_chunks) == (1000, 1)


@pytest.mark.parametrize("c", [0, -2, 1.5, False, "2", None])
def test_heuristic_c_rejects_invalid_c(c):
    with pytest.raises(StrategyError, match=r"\bc must be a positive integer"):
        HeuristicC(c=c).geometry(Problem(8192, **GEMMA3), H100)


# --- fixed_chunk_size --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk_size", "tokens", "want"),
    [(100, 8192, 64), (64, 8192, 64), (1, 8192, 1), (4096, 1000, 1000), (1000, 1000, 512), (8192, 8192, 8192)],
)
def test_fixed_chunk_size_floors_to_pow2_and_clamps_to_tokens(chunk_size, tokens, want):
    geometry = FixedChunkSize(chunk_size).geometry(Problem(tokens, 4096, 32000), H100)
    assert geometry.chunk_size == want
    assert geometry.num_chunks == math.ceil(tokens / want)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "x", None])
def test_fixed_chunk_size_rejects_invalid_params(bad):
    with pytest.raises(StrategyError, match="chunk_size"):
        FixedChunkSize(bad).geometry(Problem(8192, 4096, 32000), H100)
    with pytest.raises(StrategyError, match="chunk_size"):
        strategy_from_config({"strategy": "fixed_chunk_size", "chunk_size": bad})


# --- slab_budget -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_slab", "dtype", "want"),
    [
        ("1GiB", "bfloat16", 2048),  # 2**30 / (262144 * 2)
        ("512MiB", "bfloat16", 1024),
        ("1GB", "bfloat16", 1024),  # 10**9 // 524288 = 1907 rows, floored to 1024
        (2**30, "bfloat16", 2048),
        (300_000_000, "bfloat16", 512),  # 572 rows fit, floored to 512
        (524288, "bfloat16", 1),  # exactly one row
        ("1GiB", "float32", 1024),  # fp32 rows are twice as large
        ("1GiB", "float16", 2048),
        ("4GiB", "bfloat16", 8192),
        ("64GiB", "bfloat16", 8192),  # more than BT rows fit: clamped to BT
    ],
)
def test_slab_budget_rows(max_slab, dtype, want):
    problem = Problem(8192, 5376, 262144, dtype)
    geometry = SlabBudget(max_slab).geometry(problem, H100)
    assert geometry.chunk_size == want
    assert geometry.slab_bytes <= SlabBudget(max_slab).max_slab_bytes


def test_slab_budget_smaller_than_one_row_states_the_minimum():
    with pytest.raises(StrategyError, match=r"minimum is 524288 bytes"):
        SlabBudget(524287).geometry(Problem(8192, 5376, 262144), H100)
    with pytest.raises(StrategyError, match=r"minimum is 1048576 bytes"):
        SlabBudget("1000").geometry(Problem(8192, 5376, 262144, "fp32"), H100)


@pytest.mark.parametrize("bad", ["lots", "1.5XB", "-1GiB", -5, 0, "0B", True, None, ""])
def test_slab_budget_rejects_unparsable_or_non_positive_budgets(bad):
    with pytest.raises(StrategyError, match="max_slab"):
        SlabBudget(bad).geometry(Problem(8192, 5376, 262144), H100)
    with pytest.raises(StrategyError, match="max_slab"):
        strategy_from_config({"strategy": "slab_budget", "max_slab": bad})


# --- user strategies ---------------------------------------------------------------------------------------------


class QuarterTokens(ChunkStrategy):
    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return problem.tokens // 4


class Returns(ChunkStrategy):
    def __init__(self, value: object) -> None:
        self.value = value

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return self.value  # type: ignore[return-value]


@pytest.mark.parametrize(("tokens", "want"), [(8192, 2048), (1000, 128), (4, 1), (7, 1)])
def test_custom_subclass_goes_through_geometry(tokens, want):
    geometry = QuarterTokens().geometry(Problem(tokens, 64, 1000), H100)
    assert geometry.chunk_size == want  # tokens // 4, floored to a power of two
    assert geometry.strategy == "QuarterTokens()"


@pytest.mark.parametrize("bad", [0, -3, 2.5, 64.0, True, "64", None])
def test_custom_subclass_returning_a_non_positive_or_non_int_is_an_error(bad):
    with pytest.raises(StrategyError, match="pick_chunk_size|at least 1 row"):
        Returns(bad).geometry(Problem(1000, 64, 1000), H100)


def test_custom_subclass_returning_zero_for_tiny_problem_is_an_error():
    with pytest.raises(StrategyError, match="chunk_size=0"):
        QuarterTokens().geometry(Problem(3, 64, 1000), H100)


def test_abstract_strategy_cannot_be_instantiated():
    with pytest.raises(TypeError):
        ChunkStrategy()  # type: ignore[abstract]


# --- registry and round-trip -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "config"),
    [
        (HeuristicC(), {"strategy": "heuristic_c", "c": 1}),
        (HeuristicC(c=4), {"strategy": "heuristic_c", "c": 4}),
        (FixedChunkSize(512), {"strategy": "fixed_chunk_size", "chunk_size": 512}),
        (SlabBudget("1GiB"), {"strategy": "slab_budget", "max_slab": "1GiB"}),
        (SlabBudget(123456789), {"strategy": "slab_budget", "max_slab": 123456789}),
    ],
)
def test_builtin_round_trip(strategy, config):
    assert strategy.to_config() == config
    assert strategy.get_params() == {k: v for k, v in config.items() if k != "strategy"}
    rebuilt = strategy_from_config(yaml.safe_load(yaml.safe_dump(strategy.to_config())))
    assert type(rebuilt) is type(strategy)
    assert rebuilt == strategy
    assert rebuilt.to_config() == config


def test_builtins_are_registered_by_short_name():
    assert BUILTIN_STRATEGIES == {
        "heuristic_c": HeuristicC,
        "fixed_chunk_size": FixedChunkSize,
        "slab_budget": SlabBudget,
        "free_memory": FreeMemory,
        "fastest": Fastest,
        "scaled_exp": ScaledExp,
        "by_hidden": ByHidden,
        "measured": Measured,
        "memory_rule": MemoryRule,
    }
    assert strategy_class("slab_budget") is SlabBudget


def test_equality_compares_type_and_params():
    assert HeuristicC() == HeuristicC(c=1)
    assert HeuristicC(c=2) != HeuristicC(c=3)
    assert FixedChunkSize(1) != HeuristicC(c=1)
    assert repr(SlabBudget("1GiB")) == "SlabBudget(max_slab='1GiB')"


def test_unknown_strategy_name_lists_the_builtins():
    with pytest.raises(
        StrategyError,
        match="fixed_chunk_size, free_memory, heuristic_c, measured, memory_rule, scaled_exp, slab_budget",
    ):
        strategy_from_config({"strategy": "heuristic"})


@pytest.mark.parametrize("name", ["", "   ", 3, None])
def test_strategy_name_must_be_a_non_empty_string(name):
    with pytest.raises(StrategyError):
        strategy_class(name)


def test_missing_strategy_key_is_an_error():
    with pytest.raises(StrategyError, match="'strategy'"):
        strategy_from_config({"c": 2})


def test_unknown_parameter_lists_the_accepted_ones():
    with pytest.raises(StrategyError, match=r"unknown parameter\(s\) chunk.*accepts: c\b"):
        strategy_from_config({"strategy": "heuristic_c", "c": 2, "chunk": 3})
    with pytest.raises(StrategyError, match="accepts: max_slab"):
        strategy_from_config({"strategy": "slab_budget", "budget": "1GiB"})


def test_missing_required_parameter_is_an_error():
    with pytest.raises(StrategyError, match="chunk_size"):
        strategy_from_config({"strategy": "fixed_chunk_size"})


def test_import_path_strategy_works(tests_importable):
    cls = strategy_class("tests._custom_strategies:HalfTokens")
    assert cls.__name__ == "HalfTokens" and issubclass(cls, ChunkStrategy)
    strategy = strategy_from_config({"strategy": "tests._custom_strategies:HalfTokens"})
    assert strategy.geometry(Problem(1000, 64, 1000), H100).chunk_size == 256  # 500 floored
    assert strategy.to_config() == {"strategy": "tests._custom_strategies:HalfTokens"}
    assert strategy_from_config(strategy.to_config()) == strategy


def test_import_path_strategy_with_params_round_trips(tests_importable):
    config = {"strategy": "tests._custom_strategies:FractionOfTokens", "divisor": 8}
    strategy = strategy_from_config(config)
    assert strategy.geometry(Problem(4096, 64, 1000), H100).chunk_size == 512
    assert strategy.to_config() == config
    with pytest.raises(StrategyError, match="accepts: divisor"):
        strategy_from_config({**config, "divisr": 8})


def test_import_path_to_a_non_strategy_class_is_an_error(tests_importable):
    with pytest.raises(StrategyError, match="not a concrete subclass"):
        strategy_class("tests._custom_strategies:NotAStrategy")
    with pytest.raises(StrategyError, match="not a concrete subclass"):
        strategy_class("flce_policy.strategies:ChunkStrategy")  # abstract


def test_import_path_to_a_missing_module_or_attribute_is_an_error(tests_importable):
    with pytest.raises(StrategyError, match="cannot import module"):
        strategy_class("tests._no_such_module:HalfTokens")
    with pytest.raises(StrategyError, match="has no attribute"):
        strategy_class("tests._custom_strategies:NoSuchClass")


# --- issue 28: what a user gets wrong is named -------------------------------------------------------------------


@pytest.mark.parametrize("name", [":Foo", "..foo:Bar", ".foo:Bar", "math:", "a b:C", "math:Foo..Bar", "math:1x"])
def test_a_malformed_import_path_says_what_one_looks_like(name):
    with pytest.raises(StrategyError) as err:
        strategy_class(name)
    assert str(err.value) == (
        f"strategy {name!r}: an import path is 'package.module:Class', an absolute module path and a class name, "
        "each of dotted Python identifiers (no leading dots, nothing empty)"
    )


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("def broken(:\n    pass\n", "has a syntax error ({path}, line 1): "),
        (
            "import math\n\nraise RuntimeError('boom\\non two lines')\n",
            "raised RuntimeError: boom on two lines ({path}, line 3)",
        ),
    ],
)
def test_a_user_module_failing_at_import_is_one_line_naming_its_file(tmp_path, monkeypatch, source, fragment):
    module = f"user_mod_{abs(hash(source))}"
    path = tmp_path / f"{module}.py"
    path.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(StrategyError) as err:
        strategy_class(f"{module}:Mine")
    message = str(err.value)
    assert message.startswith(f"strategy '{module}:Mine': ")
    assert fragment.format(path=path) in message
    assert "\n" not in message


def test_a_missing_module_hints_at_the_import_path(tests_importable):
    with pytest.raises(StrategyError, match=r"No module named 'no_such_pkg_q'.*PYTHONPATH"):
        strategy_class("no_such_pkg_q.rules:Mine")


class KeepsItUnderAnotherName(ChunkStrategy):
    def __init__(self, rows: int = 64) -> None:
        self._rows = rows  # not self.rows: get_params cannot read it back

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return self._rows


def test_a_parameter_kept_under_another_name_is_named():
    from flce_policy.engine.policy import DeviceRule, FLCEPolicy

    strategy = KeepsItUnderAnotherName(32)
    expected = r"KeepsItUnderAnotherName.__init__ takes a parameter 'rows' but the object has no attribute 'rows'"
    with pytest.raises(TypeError, match=expected):
        strategy.get_params()
    with pytest.raises(TypeError, match=expected):
        FLCEPolicy(default=strategy)
    with pytest.raises(TypeError, match=expected):
        DeviceRule("H100", strategy)


class AnswersWithRows(ChunkStrategy):
    """Overrides geometry() itself, wrongly: an int instead of a Geometry."""

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return 64

    def geometry(self, problem, device, *, rule=None):  # type: ignore[override]
        return 64


def test_a_geometry_that_is_not_a_geometry_is_named_where_it_is_asked():
    from flce_policy.engine.policy import FLCEPolicy

    with pytest.raises(
        StrategyError, match=r"AnswersWithRows.geometry\(\) returned int 64, not a flce_policy.Geometry"
    ):
        FLCEPolicy(default=AnswersWithRows()).resolve(Problem(1024, 64, 1000), H100)


def test_a_geometry_that_is_not_a_geometry_is_named_when_the_loss_is_given_the_strategy():
    import torch

    from flce_policy import fused_linear_cross_entropy

    x, w, y = torch.randn(8, 16), torch.randn(32, 16), torch.randint(0, 32, (8,))
    with pytest.raises(
        StrategyError, match=r"AnswersWithRows.geometry\(\) returned int 64, not a flce_policy.Geometry"
    ):
        fused_linear_cross_entropy(x, w, y, policy=AnswersWithRows())


@pytest.mark.parametrize("config", ["heuristic_c", ["heuristic_c"], None, 5])
def test_strategy_from_config_wants_a_mapping(config):
    with pytest.raises(TypeError, match="strategy_from_config expects a mapping") as err:
        strategy_from_config(config)  # type: ignore[arg-type]
    if isinstance(config, str):
        assert "write {'strategy': 'heuristic_c'}" in str(err.value)


def test_a_parameter_kept_under_another_name_is_named_from_a_config(tmp_path, monkeypatch):
    (tmp_path / "renamed_param_rules.py").write_text(
        "from flce_policy.strategies import ChunkStrategy\n\n\n"
        "class Renamed(ChunkStrategy):\n"
        "    def __init__(self, rows: int = 64) -> None:\n"
        "        self._rows = rows\n\n"
        "    def pick_chunk_size(self, problem, device):\n"
        "        return self._rows\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        StrategyError, match=r"^strategy 'renamed_param_rules:Renamed': Renamed.__init__ takes .*'rows'"
    ):
        strategy_from_config({"strategy": "renamed_param_rules:Renamed", "rows": 8})
