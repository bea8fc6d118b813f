"""The flce-policy command line, called through main([...])."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest

from flce_policy import probe
from flce_policy.cli import main
from flce_policy.device import DeviceInfo

TABLE_FAMILIES = ("H100", "H200", "B200", "B300", "A100", "L40S", "RTX 4090")


@pytest.fixture(autouse=True)
def packaged_policy(monkeypatch):
    monkeypatch.delenv("FLCE_POLICY_CONFIG", raising=False)


@pytest.fixture
def no_gpu(monkeypatch):
    """Behave as on a machine without a GPU, even where one is present."""
    monkeypatch.setattr(probe, "probe_device", lambda index=None: DeviceInfo.cpu())
    monkeypatch.setattr(probe, "probe_device_verbose", lambda index=None: (DeviceInfo.cpu(), ["no GPU (test)"]))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def packaged_yaml() -> str:
    return str(files("flce_policy.configs").joinpath("default.yaml"))


# --- explain ---------------------------------------------------------------------------------------


def test_explain_for_a_named_device(capsys):
    code, out, _ = run(capsys, "explain", "--model", "gemma-4-31b", "--device", "H100")
    assert code == 0
    for fragment in ("NVIDIA H100", "devices[", "match H100", "slab_budget", "rows", "chunks", "MiB"):
        assert fragment in out, fragment


def test_explain_json_with_a_strategy_override(capsys):
    code, out, _ = run(
        capsys, "explain", "--vocab", "128256", "--hidden", "4096", "--tokens", "8192",
        "--device", "H100", "--strategy", "heuristic_c", "--param", "c=16", "--json",
    )  # fmt: skip
    assert code == 0
    data = json.loads(out)
    # Liger c=16: inc = cdiv(128256, 16 * 4096) = 2; next_pow2(cdiv(8192, 2)) = 4096 rows, 2 chunks
    assert data["chunk_size"] == 4096
    assert data["num_chunks"] == 2
    assert data["slab_bytes"] == 4096 * 128256 * 2
    assert data["params"] == {"c": 16}
    assert data["rule"] == "default"


def test_explain_slab_budget_param_stays_a_string(capsys):
    code, out, _ = run(
        capsys, "explain", "--model", "gemma-4-31b", "--device", "H200",
        "--strategy", "slab_budget", "--param", "max_slab=512MiB", "--json",
    )  # fmt: skip
    assert code == 0
    data = json.loads(out)
    assert data["params"] == {"max_slab": "512MiB"}
    assert data["chunk_size"] == 1024  # 512 MiB / (262144 * 2 B) rows


def test_explain_json_packaged_h200(capsys):
    code, out, _ = run(capsys, "explain", "--model", "gemma-4-31b", "--device", "h200", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["device"]["family"] == "H200"
    assert data["chunk_size"] * 262144 * 2 == data["slab_bytes"]
    assert data["num_chunks"] == 8192 // data["chunk_size"]


def test_explicit_flags_override_the_model_preset(capsys):
    code, out, _ = run(
        capsys, "explain", "--model", "llama-3-8b", "--vocab", "32000", "--tokens", "1000", "--dtype", "fp32",
        "--device", "H100", "--json",
    )  # fmt: skip
    assert code == 0
    assert json.loads(out)["problem"] == {"tokens": 1000, "hidden": 4096, "vocab": 32000, "dtype": "float32"}


def test_default_token_count_is_8192(capsys):
    code, out, _ = run(capsys, "explain", "--model", "qwen-2.5-7b", "--device", "A100", "--json")
    assert code == 0
    assert json.loads(out)["problem"] == {"tokens": 8192, "hidden": 3584, "vocab": 152064, "dtype": "bfloat16"}


def test_explain_without_gpu_gives_the_known_gpu_table(capsys, no_gpu):
    code, out, _ = run(capsys, "explain", "--model", "gemma-4-31b")
    assert code == 0
    assert "no GPU" in out
    for family in TABLE_FAMILIES:
        assert family in out, family


def test_explain_without_gpu_json_lists_decisions(capsys, no_gpu):
    code, out, _ = run(capsys, "explain", "--model", "gemma-4-31b", "--json")
    assert code == 0
    data = json.loads(out)
    by_family = {d["device"]["family"]: d for d in data["decisions"]}
    assert set(TABLE_FAMILIES) <= set(by_family)
    assert by_family["H100"]["slab_bytes"] <= by_family["H200"]["slab_bytes"] <= by_family["B300"]["slab_bytes"]


def test_explain_with_config_file(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(
        "version: 1\ndevices:\n  - match: 'NVIDIA H100*'\n    strategy: fixed_chunk_size\n    chunk_size: 100\n"
    )
    code, out, _ = run(capsys, "explain", "--model", "llama-3-8b", "--device", "H100", "--config", str(path), "--json")
    assert code == 0
    data = json.loads(out)
    assert (data["chunk_size"], data["rule"]) == (64, "devices[0] (match NVIDIA H100*)")  # 100 floors to 64


def test_env_var_policy_is_used(tmp_path, capsys, monkeypatch):
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\ndefault:\n  strategy: fixed_chunk_size\n  chunk_size: 8\n")
    monkeypatch.setenv("FLCE_POLICY_CONFIG", str(path))
    code, out, _ = run(capsys, "explain", "--model", "llama-3-8b", "--device", "H100", "--json")
    assert code == 0 and json.loads(out)["chunk_size"] == 8


# --- validate --------------------------------------------------------------------------------------


def test_validate_good_file_shows_the_table(capsys):
    code, out, _ = run(capsys, "validate", packaged_yaml())
    assert code == 0
    assert "OK" in out
    for family in TABLE_FAMILIES:
        assert family in out, family


def test_validate_json(capsys):
    code, out, _ = run(capsys, "validate", packaged_yaml(), "--model", "llama-3-8b", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["valid"] is True
    assert data["problem"]["vocab"] == 128256
    assert {d["device"]["family"] for d in data["decisions"]} >= set(TABLE_FAMILIES)


def test_validate_shows_per_family_where_a_file_departs_from_the_packaged_policy(tmp_path, capsys):
    from flce_policy.policy import FLCEPolicy
    from flce_policy.problem import Problem

    path = tmp_path / "h200_only.yaml"  # what tune wrote before it kept the packaged rules
    path.write_text("version: 1\ndevices:\n  - match: H200\n    strategy: slab_budget\n    max_slab: 1GiB\n")
    code, out, _ = run(capsys, "validate", str(path), "--json")
    assert code == 0
    data = json.loads(out)
    packaged, problem = FLCEPolicy.packaged(), Problem(tokens=8192, hidden=5376, vocab=262144)
    for row in data["decisions"]:
        device = DeviceInfo.synthetic(row["device"]["family"])
        assert row["packaged"]["chunk_size"] == packaged.resolve(problem, device).chunk_size
    # every known family has a packaged slab_budget rule, none of them this file's
    assert data["differs_from_packaged"] == [d["device"]["family"] for d in data["decisions"]]
    code, out, _ = run(capsys, "validate", str(path))
    (h100,) = [line for line in out.splitlines() if "│ H100 " in line]
    assert "heuristic_c c=1" in h100 and "slab_budget max_slab=256MiB: 512 rows" in h100
    assert f"note: {path} differs from the packaged policy on 21 of 21 known GPU families: GB300, B300" in out


def test_validate_the_packaged_file_is_the_same_everywhere(capsys):
    code, out, _ = run(capsys, "validate", packaged_yaml(), "--json")
    assert json.loads(out)["differs_from_packaged"] == []
    code, out, _ = run(capsys, "validate", packaged_yaml())
    (h100,) = [line for line in out.splitlines() if "│ H100 " in line]
    assert h100.rstrip("│ ").endswith("same")
    assert "picks as the packaged policy does on all 21 known GPU families" in out


def test_validate_bad_file(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("version: 1\ndevices:\n  - match: H100\n    strategy: nope\n  - strategy: heuristic_c\n")
    code, out, err = run(capsys, "validate", str(path))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 2
    assert f"{path}: devices[0].strategy: unknown strategy 'nope'" in lines[0]
    assert f"{path}: devices[1].match: required key is missing" in lines[1]


def test_validate_bad_file_json(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("version: 7\n")
    code, out, err = run(capsys, "validate", str(path), "--json")
    assert code == 2
    data = json.loads(out)
    assert data["valid"] is False
    assert data["errors"] == [f"{path}: version: unsupported version 7; this flce-policy reads version 1"]
    assert "unsupported version 7" in err


def test_validate_notes_a_match_that_names_no_known_gpu(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    path.write_text("version: 1\ndevices:\n  - match: H1OO\n    strategy: heuristic_c\n")
    code, out, _ = run(capsys, "validate", str(path))
    assert code == 0
    assert "devices[0] (match H1OO) matches no known GPU" in out


# --- probe -----------------------------------------------------------------------------------------


def test_probe_on_this_machine(capsys):
    code, out, _ = run(capsys, "probe", "--json")
    assert code == 0
    data = json.loads(out)
    assert {"device", "notes", "policy", "rule", "strategy", "params"} <= set(data)
    if data["device"]["family"] == "cpu":  # this machine: no GPU, so the packaged default's fallback
        assert (data["rule"], data["strategy"], data["params"]) == ("default", "heuristic_c", {"c": 1})


def test_probe_without_gpu_readable(capsys, no_gpu):
    code, out, _ = run(capsys, "probe")
    assert code == 0
    for fragment in ("cpu", "no GPU (test)", "default", "heuristic_c c=1", "packaged"):
        assert fragment in out, fragment


# --- user errors: exit 2, one clear line, no traceback -----------------------------------------------


@pytest.mark.parametrize(
    "argv, fragment",
    [
        ([], "required"),
        (["explain", "--vocab", "lots", "--hidden", "8"], "--vocab: expected a positive integer, got 'lots'"),
        (["explain", "--vocab", "0", "--hidden", "8"], "expected a positive integer, got 0"),
        (["explain", "--hidden", "8"], "give --model, or both --vocab and --hidden"),
        (["explain", "--model", "gpt-9"], "invalid choice: 'gpt-9'"),
        (["explain", "--model", "llama-3-8b", "--device", "Z100"], "unknown GPU family 'Z100'"),
        (["explain", "--model", "llama-3-8b", "--device", "H100", "--strategy", "nope"], "unknown strategy 'nope'"),
        (["explain", "--model", "llama-3-8b", "--device", "H100", "--param", "c=2"], "--param needs --strategy"),
        (
            ["explain", "--model", "llama-3-8b", "--device", "H100", "--strategy", "heuristic_c", "--param", "c"],
            "--param expects KEY=VALUE",
        ),
        (
            [
                "explain",
                "--model",
                "llama-3-8b",
                "--device",
                "H100",
                "--strategy",
                "slab_budget",
                "--param",
                "max_slab=lots",
            ],
            "cannot parse 'lots' as a byte size",
        ),
        (
            ["explain", "--model", "llama-3-8b", "--device", "H100", "--strategy", "heuristic_c", "--param", "k=1"],
            "unknown parameter(s) k",
        ),
        (["explain", "--model", "llama-3-8b", "--device", "H100", "--dtype", "int8"], "dtype"),
        (["explain", "--model", "llama-3-8b", "--config", "x.yaml", "--strategy", "heuristic_c"], "not allowed with"),
        (["validate", "/nonexistent/policy.yaml"], "/nonexistent/policy.yaml: no such file"),
    ],
)
def test_user_errors_exit_2_with_a_clear_message(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert fragment in err
    assert out == ""


def test_budget_smaller_than_one_row_is_a_user_error(capsys):
    code, _, err = run(
        capsys,
        "explain",
        "--model",
        "gemma-4-31b",
        "--device",
        "H100",
        "--strategy",
        "slab_budget",
        "--param",
        "max_slab=1KiB",
    )
    assert code == 2
    assert "smaller than one row" in err


def test_bad_config_file_names_file_and_key(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("version: 1\ndevices:\n  - match: H100\n    strategy: slab_budget\n    max_slab: lots\n")
    code, _, err = run(capsys, "explain", "--model", "llama-3-8b", "--device", "H100", "--config", str(path))
    assert code == 2
    assert f"{path}: devices[0].max_slab: cannot parse 'lots'" in err


def test_env_var_pointing_nowhere_is_a_user_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLCE_POLICY_CONFIG", str(tmp_path / "gone.yaml"))
    code, _, err = run(capsys, "explain", "--model", "llama-3-8b", "--device", "H100")
    assert code == 2
    assert "FLCE_POLICY_CONFIG" in err and "gone.yaml" in err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "explain" in capsys.readouterr().out
