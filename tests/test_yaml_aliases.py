"""Bad YAML never hangs: a policy file's aliases are refused as they are read, before anything expands them.

The alias bomb below is half a kilobyte: nine anchors, each a list of nine aliases of the one before, so
its last anchor stands for 9**9 (387 million) values. Composed, it is a few dozen shared nodes; walked
(the nesting check, validation), it is every one of those values, which ran past two minutes.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from flce_policy.cli import main
from flce_policy.engine.config import ALIASES_REFUSED, ConfigError, dump_yaml, load_yaml_text
from flce_policy.engine.policy import DeviceRule, FLCEPolicy
from flce_policy.loss import fused_linear_cross_entropy
from flce_policy.strategies import FixedChunkSize, FreeMemory, HeuristicC, strategy_from_config

#: More than any validation or loss call needs to refuse the file; the expanded walk takes minutes.
SECONDS = 1.0
#: When a test stops waiting: a regression fails in seconds, not after the minutes of the walk.
WATCHDOG_SECONDS = 10.0


def alias_bomb(levels: int = 9) -> str:
    lines = ["version: 1", "a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    lines.append(f"default: {{strategy: heuristic_c, c: *a{levels - 1}}}")
    return "\n".join(lines) + "\n"


#: Where the bomb's first alias stands: line 3 (``a1: &a1 [*a0, ...``), column 10.
FIRST_ALIAS = "line 3, column 10: alias *a0"


@pytest.fixture
def bomb(tmp_path) -> Iterator[Path]:
    """The bomb's file, and a watchdog: a TimeoutError in the test after :data:`WATCHDOG_SECONDS`."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {WATCHDOG_SECONDS:g} s: the alias bomb was expanded")

    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, WATCHDOG_SECONDS)
    try:
        yield path
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_the_bomb_is_small_and_stands_for_hundreds_of_millions_of_values():
    """What the refusal is for: a file under 1 KB whose last anchor expands to 9**9 values."""
    text = alias_bomb()
    assert len(text.encode()) < 1024
    small = yaml.safe_load(alias_bomb(levels=3))  # nine lists of nine lists of nine values, under plain PyYAML
    assert len(small["a2"]) == 9 and all(len(inner) == 9 for inner in small["a2"])
    assert sum(len(inner) for row in small["a2"] for inner in row) == 9**3


def test_validate_refuses_the_bomb_in_under_a_second(bomb, capsys):
    start = time.perf_counter()
    code = main(["validate", str(bomb)])
    seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert seconds < SECONDS, f"validate took {seconds:.2f} s"
    assert (code, out) == (2, "")
    assert err.splitlines() == [f"error: {bomb}: {FIRST_ALIAS}: {ALIASES_REFUSED}"]


def test_validate_json_lists_the_one_error(bomb, capsys):
    assert main(["validate", str(bomb), "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report == {"file": str(bomb), "valid": False, "errors": [f"{bomb}: {FIRST_ALIAS}: {ALIASES_REFUSED}"]}


def test_a_loss_call_under_FLCE_POLICY_CONFIG_refuses_the_bomb_in_under_a_second(bomb, monkeypatch):
    """The first loss call reads the policy the variable names: one ConfigError line, not a hang."""
    monkeypatch.setenv("FLCE_POLICY_CONFIG", str(bomb))
    x, w, y = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        fused_linear_cross_entropy(x, w, y)
    seconds = time.perf_counter() - start
    assert seconds < SECONDS, f"the loss call took {seconds:.2f} s"
    assert str(err.value) == f"{bomb} (from FLCE_POLICY_CONFIG): {FIRST_ALIAS}: {ALIASES_REFUSED}"


def test_one_alias_is_refused_where_it_stands(tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text("version: 1\ndefault: &rule {strategy: fixed_chunk_size, chunk_size: 32}\ndevices:\n  - *rule\n")
    with pytest.raises(ConfigError) as err:
        FLCEPolicy.from_yaml(path)
    assert str(err.value) == f"{path}: line 4, column 5: alias *rule: {ALIASES_REFUSED}"


def test_yaml_without_aliases_still_loads(tmp_path):
    """An anchor nothing refers to, and ordinary nesting, read as before."""
    path = tmp_path / "fine.yaml"
    path.write_text(
        "version: 1\n"
        "default: &unused\n"
        "  strategy: free_memory\n"
        "  cap: {strategy: heuristic_c, c: 16}\n"
        "devices:\n"
        "  - match: H100\n"
        "    strategy: fixed_chunk_size\n"
        "    chunk_size: 32\n"
    )
    policy = FLCEPolicy.from_yaml(path)
    assert policy == FLCEPolicy(default=FreeMemory(cap=HeuristicC(16)), rules=[DeviceRule("H100", FixedChunkSize(32))])


def test_a_value_shared_in_a_policy_is_written_out_twice():
    """``to_yaml`` (and so ``tune``'s output) never writes an alias the reader would refuse.

    Two rules sharing one strategy share its ``rates`` mapping: PyYAML's own dumper writes it once,
    anchored, and aliases it after.
    """
    shared = strategy_from_config({"strategy": "fastest", "rates": {"matmul_flops": 7e14, "hbm_bytes_per_s": 4.6e12}})
    policy = FLCEPolicy(default=shared, rules=[DeviceRule("H100", shared), DeviceRule("H200", shared)])
    assert "*id001" in yaml.safe_dump(policy.to_dict(), sort_keys=False)  # what a plain dump would write
    text = policy.to_yaml()
    assert "&" not in text and "*" not in text
    assert FLCEPolicy.from_yaml_text(text) == policy
    assert load_yaml_text(dump_yaml({"a": [1], "b": {"c": None}})) == {"a": [1], "b": {"c": None}}


def test_a_param_value_is_read_by_the_same_reader(capsys):
    """``--param`` values go through the policy files' reader: a duplicate key is refused there too, not
    silently the last one (the value stays text, which the strategy refuses by name)."""
    argv = ["explain", "--model", "llama-3-8b", "--device", "H100", "--strategy", "free_memory"]
    assert main([*argv, "--param", "cap={strategy: heuristic_c, c: 16}", "--json"]) == 0
    capsys.readouterr()
    assert main([*argv, "--param", "cap={strategy: heuristic_c, c: 16, c: 8}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: --param cap: ") and len(err.splitlines()) == 1
