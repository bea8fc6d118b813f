"""The policy YAML schema: round-trips, user strategies by import path, and errors naming file and key path."""

from __future__ import annotations

import textwrap

import pytest

from flce_policy.engine.config import ConfigError
from flce_policy.engine.policy import DeviceRule, FLCEPolicy
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.problem import Problem
from flce_policy.strategies import FixedChunkSize, HeuristicC, SlabBudget

GOOD = """\
version: 1
default:
  strategy: heuristic_c
  c: 1
devices:
  - match: H100
    strategy: slab_budget
    max_slab: 1GiB
  - match: B300
    min_total_memory: 200GiB
    strategy: heuristic_c
    c: 16
  - match: "NVIDIA GeForce*"
    max_total_memory: 32GiB
    strategy: fixed_chunk_size
    chunk_size: 128
"""


def write(tmp_path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_good_file_builds_the_policy_written(tmp_path):
    policy = FLCEPolicy.from_yaml(write(tmp_path, GOOD))
    expected = FLCEPolicy(
        default=HeuristicC(c=1),
        rules=[
            DeviceRule("H100", SlabBudget("1GiB")),
            DeviceRule("B300", HeuristicC(c=16), min_total_memory="200GiB"),
            DeviceRule("NVIDIA GeForce*", FixedChunkSize(128), max_total_memory="32GiB"),
        ],
    )
    assert policy == expected


def test_round_trip_keeps_parameters_as_written(tmp_path):
    policy = FLCEPolicy.from_yaml(write(tmp_path, GOOD))
    assert policy.to_dict() == {
        "version": 1,
        "oom_fallback": True,  # left out of the file: the defaults, written out
        "min_chunk_size": 64,
        "default": {"strategy": "heuristic_c", "c": 1},
        "devices": [
            {"match": "H100", "strategy": "slab_budget", "max_slab": "1GiB"},
            {"match": "B300", "min_total_memory": "200GiB", "strategy": "heuristic_c", "c": 16},
            {
                "match": "NVIDIA GeForce*",
                "max_total_memory": "32GiB",
                "strategy": "fixed_chunk_size",
                "chunk_size": 128,
            },
        ],
    }
    again = FLCEPolicy.from_yaml_text(policy.to_yaml())
    assert again == policy
    assert again.to_yaml() == policy.to_yaml()
    assert FLCEPolicy.from_yaml(write(tmp_path, policy.to_yaml(), "dumped.yaml")) == policy


def test_packaged_default_round_trips():
    policy = FLCEPolicy.packaged()
    assert FLCEPolicy.from_yaml_text(policy.to_yaml()) == policy
    assert FLCEPolicy.from_dict(policy.to_dict()) == policy


def test_oom_settings_round_trip_and_count_in_equality(tmp_path):
    text = "version: 1\noom_fallback: false\nmin_chunk_size: 128\n"
    policy = FLCEPolicy.from_yaml(write(tmp_path, text))
    assert (policy.oom_fallback, policy.min_chunk_size) == (False, 128)
    assert policy == FLCEPolicy(oom_fallback=False, min_chunk_size=128)
    assert policy != FLCEPolicy() and policy != FLCEPolicy(oom_fallback=False)
    assert FLCEPolicy.from_yaml_text(policy.to_yaml()) == policy
    assert list(policy.to_dict())[:3] == ["version", "oom_fallback", "min_chunk_size"]
    # left out, each keeps its default
    only_floor = FLCEPolicy.from_yaml_text("version: 1\nmin_chunk_size: 16\n")
    assert (only_floor.oom_fallback, only_floor.min_chunk_size) == (True, 16)


def test_default_may_be_left_out_and_devices_empty():
    policy = FLCEPolicy.from_dict({"version": 1, "devices": None})
    assert policy == FLCEPolicy(default=HeuristicC(c=1), rules=[])


# Each case: file text, then the "key path: message" fragment the error must contain after the file name.
BAD = {
    "unknown strategy": (
        "version: 1\ndevices:\n  - match: H100\n    strategy: nope\n",
        "devices[0].strategy: unknown strategy 'nope'",
    ),
    "unknown key beside a built-in": (
        "version: 1\ndevices:\n  - match: H100\n    strategy: heuristic_c\n    max_slab: 1GiB\n",
        "devices[0].max_slab: unknown key",
    ),
    "unknown key in default": (
        "version: 1\ndefault:\n  strategy: slab_budget\n  max_slab: 1GiB\n  chunk: 4\n",
        "default.chunk: unknown key",
    ),
    "unparsable budget": (
        "version: 1\ndevices:\n  - match: H100\n    strategy: slab_budget\n    max_slab: 1GiB\n"
        "  - match: H200\n    strategy: slab_budget\n    max_slab: lots\n",
        "devices[1].max_slab: cannot parse 'lots' as a byte size",
    ),
    "negative budget": (
        "version: 1\ndevices:\n  - match: H100\n    strategy: slab_budget\n    max_slab: -5\n",
        "devices[0].max_slab: a byte size cannot be negative",
    ),
    "negative budget with unit": (
        "version: 1\ndevices:\n  - match: H100\n    strategy: slab_budget\n    max_slab: -1GiB\n",
        "devices[0].max_slab: cannot parse '-1GiB'",
    ),
    "zero budget": (
        "version: 1\ndefault:\n  strategy: slab_budget\n  max_slab: 0\n",
        "default.max_slab: max_slab must be positive",
    ),
    "negative c": (
        "version: 1\ndefault:\n  strategy: heuristic_c\n  c: -2\n",
        "default.c: c must be a positive integer",
    ),
    "missing strategy parameter": (
        "version: 1\ndevices:\n  - match: H100\n    strategy: slab_budget\n",
        "devices[0].max_slab: required parameter",
    ),
    "unparsable memory bound": (
        "version: 1\ndevices:\n  - match: H100\n    min_total_memory: huge\n    strategy: heuristic_c\n",
        "devices[0].min_total_memory: cannot parse 'huge'",
    ),
    "wrong version": ("version: 2\n", "version: unsupported version 2"),
    "missing version": ("default:\n  strategy: heuristic_c\n", "version: required key is missing"),
    "empty file": ("", "the file is empty"),
    "only a comment": ("# nothing here\n", "the file is empty"),
    "yaml syntax error": (
        "version: 1\ndevices:\n  - match: H100\n   strategy: heuristic_c\n",
        "line 4, column 4: YAML syntax error",
    ),
    "duplicate key": (
        "version: 1\ndefault:\n  strategy: heuristic_c\n  strategy: slab_budget\n",
        "line 4, column 3: YAML syntax error: duplicate key 'strategy'",
    ),
    "devices not a list": ("version: 1\ndevices:\n  match: H100\n", "devices: expected a list"),
    "match missing": ("version: 1\ndevices:\n  - strategy: heuristic_c\n", "devices[0].match: required key is missing"),
    "strategy missing": ("version: 1\ndevices:\n  - match: H100\n", "devices[0].strategy: required key is missing"),
    "unknown top-level key": (
        "version: 1\nrules: []\n",
        "rules: unknown key; a policy file's top-level keys are version, oom_fallback, min_chunk_size, default, "
        "devices",
    ),
    "top level not a mapping": ("- version: 1\n", "expected a mapping at the top level"),
    "oom_fallback not a boolean": ("version: 1\noom_fallback: 1\n", "oom_fallback: expected true or false, got 1"),
    "min_chunk_size zero": (
        "version: 1\nmin_chunk_size: 0\n",
        "min_chunk_size: expected a positive number of rows, got 0",
    ),
    "min_chunk_size not an integer": (
        "version: 1\nmin_chunk_size: 64.5\n",
        "min_chunk_size: expected a positive number of rows, got 64.5",
    ),
    "min above max": (
        "version: 1\ndevices:\n  - match: H100\n    min_total_memory: 2GiB\n    max_total_memory: 1GiB\n"
        "    strategy: heuristic_c\n",
        "devices[0]: min_total_memory '2GiB' is larger than max_total_memory '1GiB'",
    ),
}


@pytest.mark.parametrize("text, fragment", list(BAD.values()), ids=list(BAD))
def test_bad_file_error_names_file_and_key_path(tmp_path, text, fragment):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        FLCEPolicy.from_yaml(path)
    assert f"{path}: {fragment}" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_every_problem_is_reported_once_per_line(tmp_path):
    text = (
        "version: 1\ndevices:\n  - match: H100\n    strategy: nope\n"
        "  - match: H200\n    strategy: slab_budget\n    max_slab: x\n"
    )
    with pytest.raises(ConfigError) as info:
        FLCEPolicy.from_yaml(write(tmp_path, text))
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert [path for path, _ in info.value.problems] == ["devices[0].strategy", "devices[1].max_slab"]


def test_missing_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match="nothere.yaml: no such file"):
        FLCEPolicy.from_yaml(tmp_path / "nothere.yaml")


def test_dict_errors_name_their_source():
    with pytest.raises(ConfigError, match=r"^<dict>: version: unsupported version 3"):
        FLCEPolicy.from_dict({"version": 3})
    with pytest.raises(ConfigError, match=r"^mine: default: expected a mapping"):
        FLCEPolicy.from_dict({"version": 1, "default": "heuristic_c"}, source="mine")


USER_MODULE = """
from flce_policy.strategies import ChunkStrategy


class QuarterTokens(ChunkStrategy):
    \"\"\"A user rule: a quarter of BT, at least ``floor`` rows.\"\"\"

    def __init__(self, floor: int = 1) -> None:
        self.floor = floor

    def pick_chunk_size(self, problem, device):
        return max(self.floor, problem.tokens // 4)
"""


def test_user_strategy_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "user_rules_cfg.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    text = "version: 1\ndevices:\n  - match: '*'\n    strategy: user_rules_cfg:QuarterTokens\n    floor: 3\n"
    policy = FLCEPolicy.from_yaml(write(tmp_path, text))
    geometry = policy.resolve(Problem(tokens=1000, hidden=64, vocab=512), DeviceInfo.synthetic("H100"))
    assert geometry.chunk_size == 128  # 1000 // 4 = 250, floored to a power of two
    assert geometry.num_chunks == 8
    assert geometry.rule == "devices[0] (match *)"
    assert policy.to_dict()["devices"] == [{"match": "*", "strategy": "user_rules_cfg:QuarterTokens", "floor": 3}]
    assert FLCEPolicy.from_yaml_text(policy.to_yaml()) == policy


def test_user_strategy_unknown_parameter_names_the_key(tmp_path, monkeypatch):
    (tmp_path / "user_rules_cfg2.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    text = "version: 1\ndevices:\n  - match: '*'\n    strategy: user_rules_cfg2:QuarterTokens\n    my_param: 3\n"
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"config.yaml: devices\[0\].my_param: unknown key.*accepts: floor"):
        FLCEPolicy.from_yaml(path)


def test_user_strategy_missing_module_names_the_strategy_key(tmp_path):
    text = "version: 1\ndefault:\n  strategy: no_such_pkg_xyz.rules:Mine\n"
    with pytest.raises(
        ConfigError, match=r"config.yaml: default.strategy: .*cannot import module 'no_such_pkg_xyz.rules'"
    ):
        FLCEPolicy.from_yaml(write(tmp_path, text))


# --- issue 28 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nested",
    ["[" * 5000 + "]" * 5000, "{a: " * 5000 + "1" + "}" * 5000],
    ids=["lists", "mappings"],
)
def test_yaml_nested_thousands_deep_is_one_line_naming_the_file(tmp_path, nested):
    path = write(tmp_path, f"version: 1\ndefault: {{strategy: heuristic_c, c: {nested}}}\n")
    with pytest.raises(ConfigError) as err:
        FLCEPolicy.from_yaml(path)
    assert str(err.value) == f"{path}: nested too deeply to read (a policy needs at most 32 levels)"


def test_a_mapping_nested_past_the_limit_names_where():
    from flce_policy.engine.config import MAX_NESTING

    data: dict = {"strategy": "heuristic_c"}
    for _ in range(MAX_NESTING):
        data = {"strategy": "free_memory", "cap": data}
    with pytest.raises(ConfigError) as err:
        FLCEPolicy.from_dict({"version": 1, "default": data}, source="mine")
    assert str(err.value) == f"mine: default{'.cap' * MAX_NESTING}: nested more than {MAX_NESTING} levels deep"
    # a few levels, as real files nest, are fine
    assert FLCEPolicy.from_dict(
        {"version": 1, "default": {"strategy": "free_memory", "cap": {"strategy": "heuristic_c"}}}
    )


@pytest.mark.parametrize(
    ("strategy", "fragment"),
    [
        ("':Foo'", "default.strategy: strategy ':Foo': an import path is 'package.module:Class'"),
        ("'..foo:Bar'", "default.strategy: strategy '..foo:Bar': an import path is 'package.module:Class'"),
        (
            "cfg_syntax_err:Mine",
            "default.strategy: strategy 'cfg_syntax_err:Mine': module 'cfg_syntax_err' has a syntax error "
            "({tmp}/cfg_syntax_err.py, line 1)",
        ),
        (
            "cfg_raises:Mine",
            "default.strategy: strategy 'cfg_raises:Mine': importing module 'cfg_raises' raised "
            "ZeroDivisionError: division by zero ({tmp}/cfg_raises.py, line 1)",
        ),
    ],
)
def test_a_bad_strategy_import_names_the_file_and_key(tmp_path, monkeypatch, strategy, fragment):
    (tmp_path / "cfg_syntax_err.py").write_text("class Mine(:\n    pass\n")
    (tmp_path / "cfg_raises.py").write_text("1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, f"version: 1\ndefault:\n  strategy: {strategy}\n")
    with pytest.raises(ConfigError) as err:
        FLCEPolicy.from_yaml(path)
    assert str(err.value).startswith(f"{path}: {fragment.format(tmp=tmp_path)}")
    assert "\n" not in str(err.value)
