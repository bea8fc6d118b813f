"""The flce-policy command line, called through main([...])."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest

from flce_policy.cli import main
from flce_policy.engine import probe
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.units import format_bytes

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


@pytest.mark.parametrize(
    "extra, slab_form, reason, softcap",
    [
        # Gemma-4's preset carries its softcap 30: fp32 caps on the row-scaled slab the H100 plans
        ((), "scaled_exp_rows", "fastest", 30.0),
        (("--softcap-rounding", "eager"), "logits", "eager", 30.0),  # apply_flce's rounding for Gemma
        (("--softcap", "50"), "logits", "over 32", 50.0),
        (("--softcap", "0"), "scaled_exp_rows", "fastest", None),
    ],
)
def test_explain_shows_the_slab_a_softcapped_call_runs(capsys, extra, slab_form, reason, softcap):
    code, out, _ = run(capsys, "explain", "--model", "gemma-4-31b", "--device", "H100", "--json", *extra)
    assert code == 0
    data = json.loads(out)
    assert (data["slab_form"], data["softcap"]) == (slab_form, softcap)
    assert reason in data["slab_form_reason"]
    code, out, _ = run(capsys, "explain", "--model", "gemma-4-31b", "--device", "H100", *extra)
    assert f"Form:        {slab_form}:" in out
    assert ("softcap" in out.splitlines()[1]) == (softcap is not None)  # the Problem line


@pytest.mark.parametrize(
    "softcap, slab_form, reason",
    [("30", "scaled_exp_rows", "warp-specialised GEMM does not compute"), ("0", "scaled_exp_ws", "strategy's")],
)
def test_explain_moves_a_softcapped_h200_small_head_off_the_warp_specialised_gemm(capsys, softcap, slab_form, reason):
    # a Gemma-2 2B head (H=2304) plans the Gluon GEMM on the H200, which has no softcap
    args = ("--hidden", "2304", "--vocab", "256000", "--tokens", "16384", "--device", "H200", "--softcap", softcap)
    code, out, _ = run(capsys, "explain", *args, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["slab_form"] == slab_form
    assert reason in data["slab_form_reason"]


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
    from flce_policy.engine.policy import FLCEPolicy
    from flce_policy.plan.problem import Problem

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
    assert "heuristic_c " in h100 and "by_hidden" in h100  # the packaged H100 rule, wrapped over lines (c=1: default)
    # the note wraps at the console's 160 columns where a long tmp path (pytest-xdist's) pushes it past them
    one_line = " ".join(out.split())
    assert f"note: {path} differs from the packaged policy on 21 of 21 known GPU families: GB300, B300" in one_line


def test_the_table_leaves_out_parameters_at_their_defaults(capsys):
    """The packaged L4 rule, measured within a 128 MiB slab: the cell names the cap, not measured's defaults."""
    code, out, _ = run(capsys, "explain", "--all-gpus", "--tokens", "8192", "--hidden", "4096", "--vocab", "128256")
    assert code == 0
    (l4,) = [line for line in out.splitlines() if "│ L4 " in line]
    assert "measured cap=" in l4 and "warmup_calls" not in out and "picks" not in out


def test_the_table_names_a_nested_strategy_and_json_keeps_its_parameters(capsys):
    """A rule's nested strategy (measured's cap, by_hidden's small and large) by its name: its mapping would wrap
    the cell over lines; --json keeps every parameter."""
    code, out, _ = run(capsys, "explain", "--model", "gemma-4-31b", "--tokens", "8192")
    assert code == 0 and "{'strategy'" not in out
    lines = out.splitlines()
    (row,) = [i for i, line in enumerate(lines) if "│ B200 " in line]
    assert "measured cap=by_hidden " in lines[row]
    form = " ".join(line.split("│")[-3].strip() for line in lines[row : row + 3])  # the form's cell, wrapped
    assert form.endswith(": the limit's, until the first calls measure"), form  # the form the model prices fastest
    (h100,) = [line for line in out.splitlines() if "│ H100 " in line]
    assert "scaled_exp_rows: fastest" in h100  # a rule that does not measure: the engine's form choice
    code, out, _ = run(capsys, "explain", "--model", "gemma-4-31b", "--tokens", "8192", "--json")
    (b200,) = [d for d in json.loads(out)["decisions"] if d["device"]["family"] == "B200"]
    assert b200["params"]["cap"]["large"] == {"strategy": "slab_budget", "max_slab": "2GiB"}


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
    if data["device"]["family"] == "cpu":  # this machine: no GPU, so the packaged rule for the CPU
        assert (data["rule"], data["strategy"], data["params"]) == ("devices[0] (match cpu)", "heuristic_c", {"c": 1})


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
        (["explain", "--model", "gemma-4-31b", "--softcap", "-1"], "--softcap: expected a positive finite softcap"),
        (["explain", "--model", "gemma-4-31b", "--softcap", "nan"], "--softcap: expected a positive finite softcap"),
        (["explain", "--model", "gemma-4-31b", "--softcap", "x"], "--softcap: expected a number, got 'x'"),
        (["explain", "--model", "gemma-4-31b", "--softcap-rounding", "bf16"], "invalid choice: 'bf16'"),
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


# --- issue 28: every user error is one line and exit 2; the known-GPU table and free_memory -------


def user_error(capsys, *argv: str) -> str:
    """The one ``error:`` line a user error prints (exit 2, nothing on stdout, no traceback)."""
    code, out, err = run(capsys, *argv)
    assert code == 2, (code, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


FASTEST_FILE = (
    "version: 1\ndefault:\n  strategy: fastest\n  rates: {{matmul_flops: {flops}, hbm_bytes_per_s: 4.0e+12}}\n"
)


@pytest.mark.parametrize(
    ("flops", "fragment"),
    [
        ("-1.0e+14", "default.rates.matmul_flops: must be finite and positive, got -100000000000000.0"),
        ("0", "default.rates.matmul_flops: must be finite and positive, got 0"),
        ("fast", "default.rates.matmul_flops: must be a number, got 'fast'"),
    ],
)
def test_fastest_rates_in_a_file_are_checked(tmp_path, capsys, flops, fragment):
    path = tmp_path / "rates.yaml"
    path.write_text(FASTEST_FILE.format(flops=flops))
    for argv in (["validate", str(path)], ["explain", "--model", "llama-3-8b", "--config", str(path)]):
        assert user_error(capsys, *argv) == f"error: {path}: {fragment}"


def test_fastest_rates_given_with_param_are_checked(capsys):
    explain = ["explain", "--model", "llama-3-8b", "--device", "H100", "--strategy", "fastest", "--json"]
    line = user_error(capsys, *explain, "--param", "rates={matmul_flops: -7.0e+14, hbm_bytes_per_s: 4.0e+12}")
    assert (
        line == "error: --param rates: fastest: rates.matmul_flops: must be finite and positive, got -700000000000000.0"
    )
    line = user_error(capsys, *explain, "--param", "rates={matmul_flops: 1e-300, hbm_bytes_per_s: 1e-300}")
    assert "fastest: rates: the predicted time of BT=8192 H=4096 V=128256 bfloat16 overflows" in line


def test_json_is_valid_json_at_extreme_but_finite_rates(capsys):
    rates = "rates={matmul_flops: 1.0e+20, hbm_bytes_per_s: 1.0e-290}"
    code, out, _ = run(
        capsys, "explain", "--model", "llama-3-8b", "--device", "H100", "--strategy", "fastest", "--param", rates,
        "--json",
    )  # fmt: skip
    assert code == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    data = json.loads(out, parse_constant=refuse)
    assert data["predicted_ms"] > 1e40


def test_master_dtype_changes_the_known_gpu_table(capsys, no_gpu):
    from flce_policy.engine.policy import FLCEPolicy
    from flce_policy.plan.memory import predict_peak
    from flce_policy.plan.problem import Problem

    peaks = {}
    for master in (None, "float32"):
        code, out, _ = run(
            capsys, "explain", "--model", "llama-3-8b", "--json", *(["--master-dtype", master] if master else [])
        )
        assert code == 0
        rows = {row["device"]["family"]: row for row in json.loads(out)["decisions"]}
        peaks[master] = rows["H100"]["predicted_peak_bytes"]
    geometry = FLCEPolicy.packaged().resolve(Problem(8192, 4096, 128256), DeviceInfo.synthetic("H100"))
    assert peaks[None] == predict_peak(geometry).total_bytes
    assert peaks["float32"] == predict_peak(geometry, master_dtype="float32").total_bytes
    assert peaks["float32"] > peaks[None]
    code, out, _ = run(capsys, "explain", "--model", "llama-3-8b", "--master-dtype", "float32")
    assert code == 0 and "peak over a float32 master weight" in out
    (h100,) = [line for line in out.splitlines() if "│ H100 " in line]
    assert format_bytes(peaks["float32"]) in h100


@pytest.mark.parametrize("dtype", ["bogus", "float64", "torch.float32"])
def test_master_dtype_outside_the_table_is_refused(capsys, dtype, no_gpu):
    for device in ([], ["--device", "H100"]):
        line = user_error(capsys, "explain", "--model", "llama-3-8b", *device, "--master-dtype", dtype)
        assert "argument --master-dtype: a dtype must be one of bfloat16, float16, float32 " in line
        assert line.endswith(f"got '{dtype}' (see flce-policy explain --help)")


@pytest.mark.parametrize("digits", [400, 5000])
def test_a_huge_integer_is_refused_in_a_short_line(capsys, digits):
    line = user_error(capsys, "explain", "--model", "llama-3-8b", "--tokens", "1" + "0" * digits)
    assert "argument --tokens: expected " in line and f"({digits + 1} characters)" in line
    assert len(line) < 200


def test_tp_size_beyond_the_vocabulary_is_refused_before_splitting_it(capsys):
    line = user_error(
        capsys, "explain", "--vocab", "5", "--hidden", "8", "--tp-size", str(2**63 - 1), "--device", "H100"
    )
    assert line == f"error: --tp-size {2**63 - 1} is more ranks than V=5 has classes; each rank needs a shard"


def test_free_memory_on_a_planned_gpu_is_decided_at_call_time(tmp_path, capsys):
    path = tmp_path / "free.yaml"
    path.write_text("version: 1\ndefault:\n  strategy: free_memory\n  fraction: 0.25\n")
    code, out, _ = run(capsys, "validate", str(path))
    assert code == 0
    (h100,) = [line for line in out.splitlines() if "│ H100 " in line]
    assert "at call time" in h100 and "from free memory" in h100
    code, out, _ = run(capsys, "explain", "--model", "gemma-4-31b", "--config", str(path), "--device", "H100")
    assert code == 0
    assert "Strategy:    free_memory fraction=0.25" in out
    assert "Chunk size:  sized at every call from the memory free on the GPU" in out
    code, out, _ = run(capsys, "explain", "--model", "gemma-4-31b", "--config", str(path), "--device", "H100", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["at_call_time"] == "sized at every call from the memory free on the GPU"
    assert data["strategy"] == "free_memory" and data["params"]["fraction"] == 0.25 and data["rule"] == "default"


USER_MODULES = {
    "cli_syntax_err": "class Mine(:\n    pass\n",
    "cli_raises": "import os\n\nraise OSError('no licence server')\n",
}


@pytest.mark.parametrize(
    ("strategy", "fragment"),
    [
        (":Foo", "strategy ':Foo': an import path is 'package.module:Class'"),
        ("..foo:Bar", "strategy '..foo:Bar': an import path is 'package.module:Class'"),
        ("cli_syntax_err:Mine", "module 'cli_syntax_err' has a syntax error ({tmp}/cli_syntax_err.py, line 1)"),
        ("cli_raises:Mine", "raised OSError: no licence server ({tmp}/cli_raises.py, line 3)"),
    ],
)
def test_a_bad_strategy_import_is_one_line_in_every_command(tmp_path, capsys, monkeypatch, strategy, fragment):
    for name, source in USER_MODULES.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "user.yaml"
    path.write_text(f"version: 1\ndefault:\n  strategy: '{strategy}'\n")
    fragment = fragment.format(tmp=tmp_path)
    assert user_error(capsys, "validate", str(path)).startswith(f"error: {path}: default.strategy: ")
    assert fragment in user_error(capsys, "validate", str(path))
    assert fragment in user_error(capsys, "probe", "--config", str(path))
    line = user_error(capsys, "explain", "--model", "llama-3-8b", "--device", "H100", "--strategy", strategy)
    assert line.startswith("error: --strategy: ") and fragment in line


def test_yaml_nested_thousands_deep_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text("version: 1\ndefault: {strategy: heuristic_c, c: " + "[" * 5000 + "]" * 5000 + "}\n")
    line = user_error(capsys, "validate", str(path))
    assert line == f"error: {path}: nested too deeply to read (a policy needs at most 32 levels)"


def test_an_internal_error_keeps_its_traceback(monkeypatch):
    # A bug of ours is not a user error: main lets it through (the interpreter prints its traceback).
    from flce_policy.engine.policy import FLCEPolicy

    def broken(*args, **kwargs):
        raise ValueError("a bug of ours")

    monkeypatch.setattr(FLCEPolicy, "explain_dict", broken)
    with pytest.raises(ValueError, match="a bug of ours"):
        main(["explain", "--model", "llama-3-8b", "--device", "H100", "--json"])


def test_a_user_strategy_that_breaks_the_contract_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "cli_contract_rules.py").write_text(
        "from flce_policy.strategies import ChunkStrategy\n\n\n"
        "class Renamed(ChunkStrategy):\n"
        "    def __init__(self, rows: int = 64) -> None:\n"
        "        self._rows = rows\n\n"
        "    def pick_chunk_size(self, problem, device):\n"
        "        return self._rows\n\n\n"
        "class AnswersWithRows(ChunkStrategy):\n"
        "    def pick_chunk_size(self, problem, device):\n"
        "        return 64\n\n"
        "    def geometry(self, problem, device, *, rule=None):\n"
        "        return 64\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    explain = ["explain", "--model", "llama-3-8b", "--device", "H100", "--strategy"]
    line = user_error(capsys, *explain, "cli_contract_rules:Renamed")
    assert line.startswith(
        "error: --strategy: strategy 'cli_contract_rules:Renamed': Renamed.__init__ takes a parameter"
    )
    line = user_error(capsys, *explain, "cli_contract_rules:AnswersWithRows")
    assert line.startswith("error: AnswersWithRows.geometry() returned int 64, not a flce_policy.Geometry")
