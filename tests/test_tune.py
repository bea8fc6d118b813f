"""``flce-policy tune``: choosing from measured records, the file it writes, and the command around them.

Records are synthetic, with times picked so every ratio is one division (in the comments), and
slabs are bf16: a row is 512 KiB at V=262144 and 64 KiB at V=32768.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from flce_policy.benchmarks.methods import fixed_chunk_methods
from flce_policy.benchmarks.suite import Record, with_floor_ratios
from flce_policy.cli import main, tune
from flce_policy.engine.policy import FLCEPolicy
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.problem import Problem
from flce_policy.plan.units import exact_size, parse_bytes
from flce_policy.strategies import Measured, SlabBudget

GIB, MIB = 2**30, 2**20
GEMMA = (8192, 5376, 262144)
LONG = (32768, 5376, 262144)
SMALL = (4096, 1024, 32768)
H200 = DeviceInfo.synthetic("H200")


@pytest.fixture(autouse=True)
def packaged_policy(monkeypatch):
    monkeypatch.delenv("FLCE_POLICY_CONFIG", raising=False)


def ours(shape, chunk, ms, peak_gib, status="ok"):
    name = "ours_one_chunk_bf16" if chunk == shape[0] else f"ours_chunk{chunk}_bf16"
    return Record(
        shape, name, "ours fixed", "bf16", chunk_size=chunk, median_ms=ms if status == "ok" else None,
        peak_bytes=int(peak_gib * GIB) if status == "ok" else None, status=status,
    )  # fmt: skip


def floor(shape, ms):
    return Record(shape, "gemm_floor", "floor", "bf16", median_ms=ms, peak_bytes=0)


def as_method(record, method, slowdown=1.0):
    """``record`` as ``method``'s row (its name and family: a fixed-chunk row on either slab form), its time
    times ``slowdown``."""
    ms = None if record.median_ms is None else record.median_ms * slowdown
    return dataclasses.replace(record, method=method.name, family=method.family, median_ms=ms)


def stub_suite(rows, scaled_exp_slowdown, rows_slowdown=None, ws_slowdown=None):
    """A run_suite that answers each method with ``rows``' row at its chunk (the floor at None), the scaled-exp
    rows ``scaled_exp_slowdown`` times slower (its row-scaled form's ``rows_slowdown``, by default the same, and the
    warp-specialised one's ``ws_slowdown``, by default the row-scaled form's); the method names it was asked for in
    ``.calls``."""

    def fake_run_suite(
        shapes, methods, *, logit_std, warmup, repeats, sustained_s, predict_peak, on_start, on_record
    ):  # fmt: skip
        fake_run_suite.calls.append(([m.name for m in methods], logit_std, warmup, repeats))
        fake_run_suite.sustained.append(sustained_s)
        by_chunk = {r.chunk_size: r for r in rows}
        records = []
        for method in methods:
            on_start(shapes[0], method)
            chunk = None if method.name == "gemm_floor" else predict_peak(method, shapes[0])[0]
            slowdown = 1.0
            row_scaled = scaled_exp_slowdown if rows_slowdown is None else rows_slowdown
            if method.family.endswith("scaled-exp ws"):
                slowdown = row_scaled if ws_slowdown is None else ws_slowdown
            elif method.family.endswith("scaled-exp rows"):
                slowdown = row_scaled
            elif "scaled-exp" in method.family:
                slowdown = scaled_exp_slowdown
            record = by_chunk[chunk] if chunk is None else as_method(by_chunk[chunk], method, slowdown)
            records.append(record)
            on_record(record)
        return with_floor_ratios(records)

    fake_run_suite.calls = []
    fake_run_suite.sustained = []
    return fake_run_suite


def gemma_rows(shape=GEMMA, ms_2048=108.5):
    """Chunks 256 .. one chunk; 2048 rows (1 GiB slab) within 2% of the fastest fitting under 5 GiB."""
    rows = [
        floor(shape, 100.0),
        ours(shape, 256, 145.0, 3.20),
        ours(shape, 512, 125.0, 3.30),
        ours(shape, 1024, 115.0, 3.45),
        ours(shape, 2048, ms_2048, 3.70),
        ours(shape, 4096, 106.5, 4.70),
        ours(shape, 8192, 106.3, 6.70),  # one chunk
    ]
    return with_floor_ratios(rows)


def small_rows():
    """V=32768: slabs of 16 MiB (256 rows) .. 256 MiB (one chunk of 4096); one chunk is fastest."""
    return with_floor_ratios(
        [
            floor(SMALL, 5.0),
            ours(SMALL, 256, 10.0, 0.40),
            ours(SMALL, 512, 8.0, 0.42),
            ours(SMALL, 1024, 7.0, 0.45),
            ours(SMALL, 2048, 6.5, 0.52),
            ours(SMALL, 4096, 6.45, 0.65),
        ]
    )


def test_tune_writes_what_measured_would_pick(tmp_path, capsys, monkeypatch):
    """--strategy measured: a measured rule whose pick at the shape is the core's (the smallest slab within 1% of
    the fastest over the forms measured would measure, here the scaled-exp slab 3% faster: 4096 rows, as 2048 rows
    take 105.2 ms against 4096 rows' 103.3, 1.8% more; the warp-specialised form, which tune times, is not among
    them: measured runs it up to H=3072 on the H200), its limit the largest slab that fit (4096 rows, 2 GiB)."""
    from flce_policy.benchmarks import suite
    from flce_policy.engine import probe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe, "probe_device", lambda index=None: H200)
    monkeypatch.setattr(suite, "run_suite", stub_suite(gemma_rows(), scaled_exp_slowdown=0.97))
    out = tmp_path / "h200.yaml"
    argv = ["tune", "--shapes", "8192x5376x262144", "--max-peak", "5GiB", "--strategy", "measured", "--out", str(out)]
    code = main(argv)
    assert code == 0, capsys.readouterr().err
    rule = FLCEPolicy.from_yaml(out).rules[0]
    pick = {"tokens": 8192, "hidden": 5376, "vocab": 262144, "chunk_size": 4096, "slab_form": "scaled_exp_rows"}
    assert rule.strategy == Measured(max_slab="2GiB", picks=[pick]) and rule.slab_form is None
    seeded = rule.strategy.seeded_pick(Problem(8192, 5376, 262144))
    assert (seeded.rows, seeded.slab_form) == (4096, "scaled_exp_rows")


def test_chunk_sizes_are_powers_of_two_from_256_below_the_tokens():
    assert tune.chunk_sizes_for(8192) == (256, 512, 1024, 2048, 4096)
    assert tune.chunk_sizes_for(300) == (256,)
    assert tune.chunk_sizes_for(256) == ()
    assert tune.chunk_sizes_for(100) == ()


@pytest.mark.parametrize(
    ("limits", "slab", "chunk"),
    [
        # under 5 GiB the fastest fitting is 4096 rows (106.5 ms); 2048 rows take 108.5 / 106.5 = 1.0188x: kept
        (tune.Limits(max_peak=5 * GIB), 1 * GIB, 2048),
        # under 4 GiB the fastest fitting is 2048; 1024 rows take 115 / 108.5 = 1.06x
        (tune.Limits(max_peak=4 * GIB), 1 * GIB, 2048),
        # a slab limit alone: 1024 rows (512 MiB) and below fit
        (tune.Limits(max_slab=512 * MIB), 512 * MIB, 1024),
        # no peak limit and a generous slab one: one chunk (106.3 ms) is fastest, 2048 rows 1.0207x, 4096 1.0019x
        (tune.Limits(max_slab=64 * GIB), 2 * GIB, 4096),
        # both limits: the tighter decides
        (tune.Limits(max_peak=5 * GIB, max_slab=600 * MIB), 512 * MIB, 1024),
    ],
)
def test_one_shape_gets_the_smallest_slab_within_2_percent_of_its_fastest(limits, slab, chunk):
    choice = tune.choose(gemma_rows(), limits, device=H200)
    assert choice.max_slab == slab
    assert choice.picks[GEMMA].chunk_size == chunk
    assert choice.within_tolerance


def test_several_shapes_share_the_smallest_slab_good_for_all():
    records = gemma_rows() + small_rows()
    choice = tune.choose(records, tune.Limits(max_peak=5 * GIB), device=H200)
    # 1 GiB: 2048 rows at GEMMA (1.0188x); at SMALL 16384 rows fit, clamped to one chunk of 4096 (1.000x).
    # 512 MiB would run GEMMA at 1024 rows, 1.08x.
    assert choice.max_slab == GIB
    assert (choice.picks[GEMMA].chunk_size, choice.picks[SMALL].chunk_size) == (2048, 4096)
    assert (choice.fastest[GEMMA].chunk_size, choice.fastest[SMALL].chunk_size) == (4096, 4096)
    assert choice.ratio(GEMMA) == pytest.approx(108.5 / 106.5)


def test_when_no_slab_is_within_2_percent_everywhere_the_closest_is_taken():
    # GEMMA is fastest at 4096 rows (106.5 ms) but LONG's 4096-row peak is over the limit, and at 2048
    # rows GEMMA takes 110 / 106.5 = 1.033x. 1 GiB (worst 1.033x) beats 512 MiB (115 / 106.5 = 1.08x).
    long_rows = [floor(LONG, 400.0), ours(LONG, 1024, 440.0, 3.9), ours(LONG, 2048, 420.0, 4.2)]
    long_rows.append(ours(LONG, 4096, 415.0, 5.4))
    records = gemma_rows(ms_2048=110.0) + with_floor_ratios(long_rows)
    choice = tune.choose(records, tune.Limits(max_peak=5 * GIB), device=H200)
    assert choice.max_slab == GIB and not choice.within_tolerance
    assert choice.picks[LONG].chunk_size == 2048
    assert choice.ratio(GEMMA) == pytest.approx(110.0 / 106.5)


def test_rows_that_did_not_run_never_fit():
    rows = gemma_rows()
    rows[5] = ours(GEMMA, 4096, None, None, status="out of memory")  # the 4096-row row
    choice = tune.choose(rows, tune.Limits(max_peak=8 * GIB), device=H200)
    # fastest fitting: one chunk (106.3); 2048 rows are 1.0207x, over 2%; one chunk's own 4 GiB is chosen
    assert (choice.max_slab, choice.picks[GEMMA].chunk_size) == (4 * GIB, 8192)


def test_nothing_fits_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"at 8192x5376x262144 no chunk size fits .*smallest measured peak is 3.20 GiB"
    ):
        tune.choose(gemma_rows(), tune.Limits(max_peak=GIB), device=H200)
    with pytest.raises(ValueError, match="no FixedChunkSize rows"):
        tune.choose([floor(GEMMA, 1.0)], tune.Limits(max_peak=GIB), device=H200)


def test_exact_size_reads_back_exactly():
    for size in (2 * GIB, 1002 * MIB, 4096 * 128256 * 2, 37 * 1024, 8200 * 262144 * 2, 12345):
        assert parse_bytes(exact_size(size)) == size
    assert (exact_size(2 * GIB), exact_size(1002 * MIB), exact_size(12345)) == ("2GiB", "1002MiB", 12345)


# --- the file ------------------------------------------------------------------------------------


def written(tmp_path, records, limits, device=H200, **options):
    choice = tune.choose(records, limits, device=device)
    text = tune.render(choice, records, limits, device=device, about=["measured on a test bench"], **options)
    path = tmp_path / "tuned.yaml"
    path.write_text(text)
    return path, text


def packaged_picks(policy, problem, device):
    """What ``policy`` runs on ``device``: the geometry less the rule's position in the file."""
    geometry = policy.resolve(problem, device)
    return (geometry.chunk_size, geometry.vocab_chunk, geometry.strategy)


def test_the_file_is_a_policy_for_this_family_with_the_packaged_default(tmp_path):
    path, text = written(tmp_path, gemma_rows() + small_rows(), tune.Limits(max_peak=5 * GIB))
    policy = FLCEPolicy.from_yaml(path)
    packaged = FLCEPolicy.packaged()
    assert policy.default_strategy == packaged.default_strategy
    assert (policy.oom_fallback, policy.min_chunk_size) == (packaged.oom_fallback, packaged.min_chunk_size)
    rule = policy.rules[0]
    assert (rule.match, rule.strategy) == ("H200", SlabBudget("1GiB"))
    assert policy.resolve(Problem(*GEMMA), H200).chunk_size == 2048
    assert policy.resolve(Problem(*SMALL), H200).chunk_size == 4096
    assert yaml.safe_load(text)["devices"][0] == {
        "match": "H200",
        "slab_form": "logits",
        "strategy": "slab_budget",
        "max_slab": "1GiB",
    }


@pytest.mark.parametrize("problem", [Problem(*GEMMA), Problem(*SMALL)], ids=["gemma", "small"])
def test_every_other_gpu_keeps_what_the_packaged_policy_picks(tmp_path, problem):
    path, text = written(tmp_path, gemma_rows(), tune.Limits(max_peak=5 * GIB))
    policy, packaged = FLCEPolicy.from_yaml(path), FLCEPolicy.packaged()
    others = [d for d in DeviceInfo.known() if d.family != "H200"]
    assert len(others) == 20
    for device in others:
        assert packaged_picks(policy, problem, device) == packaged_picks(packaged, problem, device), device.family
    gh200_144 = DeviceInfo.synthetic("GH200").model_copy(update={"total_memory_bytes": 144 * 10**9})
    a100_40 = DeviceInfo.synthetic("A100").model_copy(update={"total_memory_bytes": 40 * 2**30})
    for device in (gh200_144, a100_40, DeviceInfo.cpu()):  # memory-bounded rules, and the default
        assert packaged_picks(policy, problem, device) == packaged_picks(packaged, problem, device), device
    # The packaged H200 rule is left out (the tuned one, first, would hide it), and the file says so.
    assert [r.match for r in policy.rules].count("H200") == 1
    assert len(policy.rules) == len(packaged.rules)
    assert (
        "# the tuned rule replaces the packaged rule match H200 -> "
        "ScaledExp(inner={'strategy': 'slab_budget', 'max_slab': '2.5GiB'}, rows=True, warp_specialised=True, "
        "ws_max_hidden=3072, ws_inner={'strategy': 'slab_budget', 'max_slab': '5GiB'})" in text
    )


def test_without_the_packaged_rules_the_file_says_other_gpus_get_the_default(tmp_path):
    path, text = written(tmp_path, gemma_rows(), tune.Limits(max_peak=5 * GIB), packaged_rules=False)
    policy = FLCEPolicy.from_yaml(path)
    assert [(r.match, r.strategy) for r in policy.rules] == [("H200", SlabBudget("1GiB"))]
    assert "# devices: only the tuned rule (--no-packaged-rules); every other GPU gets the default" in text
    assert policy.resolve_rule(DeviceInfo.synthetic("H100")) == ("default", FLCEPolicy.packaged().default_strategy)


def test_the_file_carries_the_measurements_as_comments(tmp_path):
    _, text = written(tmp_path, gemma_rows(), tune.Limits(max_peak=4 * GIB))
    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert comments[0] == f"# flce-policy tune on {H200.describe()}"
    assert "# measured on a test bench" in comments
    assert "# limits: measured peak <= 4.00 GiB" in comments
    rows = {line.split()[1]: line for line in comments if line.startswith("#   ") and line.split()[1].isdigit()}
    assert set(rows) == {"256", "512", "1024", "2048", "4096", "8192"}
    # chunk, ms, x floor (floor 100 ms), peak, slab, notes
    assert rows["2048"].split()[1:8] == ["2048", "108.500", "1.085x", "3.70", "GiB", "1.00", "GiB"]
    assert rows["2048"].endswith("fastest that fits, chosen")
    assert rows["4096"].endswith("peak over the limit")
    assert "# chosen: max_slab 1GiB, the smallest slab within 2% of every shape's fastest time" in comments


def test_the_file_passes_validate(tmp_path, capsys):
    path, _ = written(tmp_path, gemma_rows(), tune.Limits(max_peak=5 * GIB))
    assert main(["validate", str(path)]) == 0
    out, _ = capsys.readouterr()
    rules = len(FLCEPolicy.packaged().rules)  # the tuned one, and the packaged ones less H200's
    assert f"OK: {path} (version 1, {rules} device rules)" in out
    assert "matches no known GPU" not in out  # the rules name known families
    assert "differs from the packaged policy on 1 of 21 known GPU families: H200" in out


def test_an_unknown_family_is_matched_by_its_exact_name(tmp_path):
    mystery = DeviceInfo(name="Mystery Accel 96GB", family="unknown", total_memory_bytes=96 * GIB, source="nvml")
    path, _ = written(tmp_path, gemma_rows(), tune.Limits(max_peak=5 * GIB), device=mystery)
    policy = FLCEPolicy.from_yaml(path)
    assert policy.rules[0].match == "Mystery Accel 96GB"
    assert policy.resolve_rule(mystery)[0].startswith("devices[0]")
    assert policy.resolve_rule(H200)[1] == FLCEPolicy.packaged().resolve_rule(H200)[1]  # not replaced


# --- the command ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--out", "{tmp}/p.yaml"], "give --max-peak and/or --max-slab"),
        (["--max-peak", "lots", "--out", "{tmp}/p.yaml"], "--max-peak: cannot parse 'lots'"),
        (["--max-slab", "0", "--out", "{tmp}/p.yaml"], "a memory limit must be positive"),
        (["--max-slab", "1GiB"], "the following arguments are required: --out"),
        (["--max-slab", "1GiB", "--out", "{tmp}"], "is a folder"),
        (["--max-slab", "1GiB", "--shapes", "8x8", "--out", "{tmp}/p.yaml"], "three positive integers"),
        (["--max-slab", "1GiB", "--grad-weight-filter", "-1", "--out", "{tmp}/p.yaml"], "--grad-weight-filter must"),
        (["--max-slab", "1GiB", "--grad-weight-filter", "2**4", "--out", "{tmp}/p.yaml"], "--grad-weight-filter must"),
        (["--max-slab", "1GiB", "--grad-weight-filter-rescue", "3", "--out", "{tmp}/p.yaml"], "power of two"),
        (["--max-slab", "1GiB", "--grad-weight-filter-rescue", "16", "--out", "{tmp}/p.yaml"], "needs --grad-weight-"),
    ],
)
def test_user_errors_exit_2_on_one_line(tmp_path, capsys, argv, fragment):
    code = main(["tune", *(a.format(tmp=tmp_path) for a in argv)])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert fragment in err


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_help_states_the_repeats_minimum_that_is_enforced(capsys, command):
    from flce_policy.benchmarks.cli import MIN_REPEATS

    assert main([command, "--help"]) == 0
    out, _ = capsys.readouterr()
    assert f"at least {MIN_REPEATS}" in " ".join(out.split())  # argparse wraps the help text
    required = ["--max-slab", "1GiB", "--out", "p.yaml"] if command == "tune" else []
    assert main([command, "--repeats", str(MIN_REPEATS - 1), *required]) == 2
    _, err = capsys.readouterr()
    assert f"expected an integer >= {MIN_REPEATS}, got {MIN_REPEATS - 1}" in err


def test_without_cuda_it_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["tune", "--max-peak", "40GiB", "--out", str(tmp_path / "p.yaml")])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("error: tune needs a CUDA GPU")
    assert not (tmp_path / "p.yaml").exists()


def test_gpu_run_glue_with_a_stubbed_suite(tmp_path, capsys, monkeypatch):
    """Per shape: the floor and our fixed rows from 256 rows to one chunk, on both slab forms on an H200; the
    scaled-exp slab 5% slower than the logits slab is not written; the file written loads."""
    from flce_policy.benchmarks import suite
    from flce_policy.engine import probe

    fake_run_suite = stub_suite(gemma_rows(), scaled_exp_slowdown=1.05)
    calls = fake_run_suite.calls

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe, "probe_device", lambda index=None: H200)
    monkeypatch.setattr(suite, "run_suite", fake_run_suite)
    out = tmp_path / "h200.yaml"
    code = main(["tune", "--shapes", "8192x5376x262144", "--max-peak", "5GiB", "--repeats", "6", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    expected_rows = [
        "gemm_floor",
        *(f"ours_chunk{n}_bf16" for n in (256, 512, 1024, 2048, 4096)),
        "ours_one_chunk_bf16",
        *(f"ours_scaled_exp_rows_chunk{n}_bf16" for n in (256, 512, 1024, 2048, 4096)),
        "ours_scaled_exp_rows_one_chunk_bf16",
        *(f"ours_scaled_exp_ws_chunk{n}_bf16" for n in (256, 512, 1024, 2048, 4096)),
        "ours_scaled_exp_ws_one_chunk_bf16",
        *(f"ours_scaled_exp_chunk{n}_bf16" for n in (256, 512, 1024, 2048, 4096)),
        "ours_scaled_exp_one_chunk_bf16",
    ]
    assert calls == [(expected_rows, 4.0, 2, 6)]
    assert fake_run_suite.sustained == [None]
    assert "# median of 6 calls after 2 warm-up;" in out.read_text()
    policy = FLCEPolicy.from_yaml(out)
    assert policy.rules[0].strategy == SlabBudget("1GiB")
    assert "8192x5376x262144 ours_chunk2048_bf16: 108.50 ms, peak 3.70 GiB, ok" in err  # the progress lines
    assert f"wrote {out}: match H200 -> slab_budget max_slab 1GiB" in err
    assert "of the known GPU families, it gives another strategy than the packaged policy only on H200" in err
    assert "WARNING" not in err

    argv = ["tune", "--shapes", "8192x5376x262144", "--max-peak", "5GiB", "--out", str(out)]
    code = main([*argv, "--no-packaged-rules"])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert len(FLCEPolicy.from_yaml(out).rules) == 1
    warning = next(line for line in err.splitlines() if line.startswith("WARNING"))
    assert "moves 20 other known GPU families from their packaged rules to the default Measured(" in warning
    assert "cap={'strategy': 'memory_rule', " in warning  # the default measures within the memory rule
    assert "H100" in warning and "B200" in warning and "A100" in warning


# --- calibrating the cost model -------------------------------------------------------------------


def modelled_rows(shape, rates, chunks=(256, 512, 1024, 2048, 4096)):
    """Rows timed by the cost model itself at ``rates`` (and the floor at the GEMM rate)."""
    from flce_policy.plan.cost_model import predict_seconds

    tokens, hidden, vocab = shape
    rows = [floor(shape, 6.0 * tokens * hidden * vocab / rates.matmul_flops * 1e3)]
    for chunk in chunks:
        geometry = tune.Geometry.for_problem(Problem(*shape), chunk)
        rows.append(ours(shape, chunk, predict_seconds(geometry, rates).seconds * 1e3, 3.0))
    return with_floor_ratios(rows)


def test_calibration_recovers_the_rates_that_made_the_times():
    from flce_policy.plan.cost_model import DeviceRates

    made = DeviceRates(4.1e14, 2.7e12)
    rates, worst = tune.calibrate(modelled_rows(GEMMA, made) + modelled_rows(LONG, made), H200)
    assert rates.matmul_flops == pytest.approx(4.1e14, rel=1e-9)
    assert rates.hbm_bytes_per_s == pytest.approx(2.7e12, rel=1e-9)
    assert worst < 1e-9


def test_calibration_on_the_committed_h200_run_stays_near_the_table():
    import json
    from pathlib import Path

    from flce_policy.plan.cost_model import RATES

    path = Path(__file__).resolve().parents[1] / "results/2026-11-29-h200-large-heads/bench.json"
    records = [Record.from_dict(r) for r in json.loads(path.read_text())["records"]]
    rates, worst = tune.calibrate(records, H200)
    assert rates.matmul_flops / RATES["H200"].matmul_flops == pytest.approx(1.0, abs=0.05)
    assert rates.hbm_bytes_per_s / RATES["H200"].hbm_bytes_per_s == pytest.approx(1.0, abs=0.10)
    assert worst < 0.10


def modelled_form_rows(shape, rates, form, chunks=(512, 1024, 2048, 4096)):
    """Fixed-chunk rows on ``form``'s slab timed by the cost model at ``rates``."""
    from flce_policy.benchmarks.methods import FIXED_FAMILIES
    from flce_policy.plan.cost_model import predict_seconds

    rows = []
    for chunk in chunks:
        geometry = tune.Geometry.for_problem(Problem(*shape), chunk, slab_form=form)
        row = ours(shape, chunk, predict_seconds(geometry, rates).seconds * 1e3, 3.0)
        rows.append(dataclasses.replace(row, method=f"ours_{form}_chunk{chunk}_bf16", family=FIXED_FAMILIES[form]))
    return rows


def test_calibration_fits_the_slab_form_terms_where_both_slabs_ran():
    # rows made by the model at terms other than the H100's (on the fit's grid): the two rates and the three
    # scaled-exp terms come back exactly
    from flce_policy.plan.cost_model import RATES

    h100 = DeviceInfo.synthetic("H100")
    made = RATES["H100"]._replace(
        matmul_flops=5.5e14,
        hbm_bytes_per_s=2.9e12,
        scaled_exp_gemm_efficiency=0.92,
        scaled_exp_epilogue_flops=400.0,
        scaled_exp_chunk_overhead=5e-14,
    )
    records = modelled_rows(GEMMA, made) + modelled_rows(LONG, made)
    records += modelled_form_rows(GEMMA, made, "scaled_exp_rows") + modelled_form_rows(LONG, made, "scaled_exp_rows")
    assert len(tune.form_pairs(records)) == 8
    rates, worst = tune.calibrate(records, h100)
    assert rates.matmul_flops == pytest.approx(5.5e14, rel=1e-9)
    assert rates.hbm_bytes_per_s == pytest.approx(2.9e12, rel=1e-9)
    assert rates._replace(matmul_flops=made.matmul_flops, hbm_bytes_per_s=made.hbm_bytes_per_s) == made
    assert worst < 1e-9


def test_calibration_keeps_the_familys_slab_form_terms_with_the_logits_slab_alone():
    # nothing to fit them to: the H100's measured terms stay, and the two rates are fitted around them
    from flce_policy.plan.cost_model import RATES

    made = RATES["H100"]._replace(matmul_flops=5.5e14, hbm_bytes_per_s=2.9e12)
    records = modelled_rows(GEMMA, made) + modelled_rows(LONG, made)
    assert tune.form_pairs(records) == []
    rates, worst = tune.calibrate(records, DeviceInfo.synthetic("H100"))
    assert rates._replace(matmul_flops=made.matmul_flops, hbm_bytes_per_s=made.hbm_bytes_per_s) == made
    assert rates.matmul_flops == pytest.approx(5.5e14, rel=1e-9) and worst < 1e-9


def test_calibration_on_the_committed_h100_sweep_tells_the_slabs_apart():
    # the H100's sweep of both slabs at the nine shapes, calibrated as on a GPU of unknown terms (B200's table: the
    # defaults): the fitted terms predict the slabs' time ratio within 2.5% on average, and pick the faster slab
    import json
    from pathlib import Path

    from flce_policy.plan.cost_model import form_ratio_error, predict_seconds

    path = Path(__file__).resolve().parents[1] / "results/2026-12-05-h100/bench.json"
    documents = json.loads(path.read_text())["slab_forms_2026_12_06"].values()
    records = [Record.from_dict(r) for document in documents for r in document["records"]]
    pairs = tune.form_pairs(records)
    assert len(pairs) == 54
    rates, _ = tune.calibrate(records, DeviceInfo.synthetic("B200"))
    assert form_ratio_error(pairs, rates) <= 0.025
    right = sum(
        (predict_seconds(p.scaled_exp, rates).seconds < predict_seconds(p.logits, rates).seconds)
        == (p.scaled_exp_seconds < p.logits_seconds)
        for p in pairs
    )
    assert right >= 52, right


@pytest.mark.parametrize(
    "samples, fragment",
    [
        ([(1e15, 0.0, 1.5)], r"1 measurement\(s\) do not separate"),
        ([(1e15, 0.0, 1.5), (2e15, 0.0, 3.0)], "do not separate"),  # GEMM-only: no bandwidth in them
        ([(1e15, 1e12, 1.0), (1e15, 2e12, 0.5)], "non-positive rate"),  # more traffic, less time
        ([(1e15, 1e12, 0.0), (1e15, 2e12, 0.5)], "must be positive"),
    ],
)
def test_calibration_refuses_what_it_cannot_fit(samples, fragment):
    from flce_policy.plan.cost_model import RATES, fit_rates

    with pytest.raises(ValueError, match=fragment):
        fit_rates(samples, RATES["H200"])


@pytest.mark.parametrize(
    ("family", "family_terms"),
    [
        ("H200", {}),
        # the H100's measured slab-form terms go with the calibrated rates (a rates mapping starts from the defaults)
        (
            "H100",
            {
                "scaled_exp_gemm_efficiency": 1.0,
                "scaled_exp_epilogue_flops": 600.0,
                "scaled_exp_chunk_overhead": 1e-13,
                "ws_gemm_efficiency": 0.8,
            },
        ),
    ],
)
def test_tune_writes_fastest_with_the_calibrated_rates(tmp_path, capsys, monkeypatch, family, family_terms):
    from flce_policy.benchmarks import suite
    from flce_policy.engine import probe
    from flce_policy.plan.cost_model import RATES, DeviceRates
    from flce_policy.strategies import Fastest

    device = DeviceInfo.synthetic(family)
    assert {k: v for k, v in RATES[family]._asdict().items() if k in family_terms} == family_terms

    made = DeviceRates(5.0e14, 3.5e12)

    def fake_run_suite(shapes, methods, *, logit_std, warmup, repeats, sustained_s, predict_peak, on_start, on_record):
        (shape,) = shapes
        by_chunk = {r.chunk_size: r for r in modelled_rows(shape, made, chunks=(256, 512, 1024, 2048, 4096, 8192))}
        records = []
        for method in methods:
            chunk, _ = predict_peak(method, shape)
            records.append(floor(shape, by_chunk[None].median_ms) if method.name == "gemm_floor" else by_chunk[chunk])
        return with_floor_ratios(records)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe, "probe_device", lambda index=None: device)
    monkeypatch.setattr(suite, "run_suite", fake_run_suite)
    out = tmp_path / "tuned.yaml"
    argv = ["tune", "--shapes", "8192x5376x262144", "--max-slab", "512MiB", "--accum", "bf16"]
    code = main([*argv, "--strategy", "fastest", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    strategy = FLCEPolicy.from_yaml(out).rules[0].strategy
    assert isinstance(strategy, Fastest) and strategy.max_slab == "512MiB" and strategy.accum == "bf16"
    assert strategy.rates == {"matmul_flops": 5e14, "hbm_bytes_per_s": 3.5e12, **family_terms}
    assert "cost model calibrated here: GEMM 500 TFLOP/s, HBM 3.50 TB/s" in out.read_text()


# --- issue 28: --json, and help that says what is required ---------------------------------------


def test_help_gives_no_default_for_the_limits_it_requires(capsys):
    assert main(["tune", "--help"]) == 0
    out, _ = capsys.readouterr()
    text = "".join(out.split())  # argparse wraps the help text, even at a hyphen
    assert "(40GiB)" not in text and "(2GiB)" not in text
    assert "e.g.40GiB(givethis,--max-slab,orboth)" in text
    assert "e.g.2GiB(givethis,--max-peak,orboth)" in text
    assert "thereisnodefault" in text
    assert main(["tune", "--out", "p.yaml"]) == 2
    _, err = capsys.readouterr()
    assert "give --max-peak and/or --max-slab" in err


def test_json_reports_what_was_written_and_measured(tmp_path, capsys, monkeypatch):
    import json

    from flce_policy.benchmarks import suite
    from flce_policy.engine import probe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe, "probe_device", lambda index=None: H200)
    monkeypatch.setattr(suite, "run_suite", stub_suite(gemma_rows(), scaled_exp_slowdown=1.05))
    out = tmp_path / "h200.yaml"
    argv = ["tune", "--shapes", "8192x5376x262144", "--max-peak", "5GiB", "--out", str(out), "--json"]
    assert main(argv) == 0
    stdout, err = capsys.readouterr()
    data = json.loads(stdout)
    written = FLCEPolicy.from_yaml(out)
    assert data["out"] == str(out)
    assert (
        data["rule"]
        == written.rules[0].to_config()
        == {"match": "H200", "slab_form": "logits", "strategy": "slab_budget", "max_slab": "1GiB"}
    )
    assert data["limits"] == {"max_peak": 5 * GIB, "max_slab": None}
    assert data["chosen_max_slab"] == GIB and data["within_tolerance"] is True
    assert data["changed_families"] == ["H200"]
    assert data["chosen_slab_form"] == "logits"
    chunks = [256, 512, 1024, 2048, 4096, 8192]
    assert [r["chunk_size"] for r in data["records"]] == [None, *chunks, *chunks, *chunks, *chunks]  # four slab forms
    # both Triton scaled-exp slabs ran at every chunk size: their terms were fitted, and how well they predict the
    # stub's 5% over the logits slab is reported
    calibrated = data["calibrated_rates"]
    assert set(calibrated) == {
        "matmul_flops", "hbm_bytes_per_s", "scaled_exp_gemm_efficiency", "scaled_exp_epilogue_flops",
        "scaled_exp_chunk_overhead", "scaled_exp_ratio_error",
    }  # fmt: skip
    assert 0 <= calibrated["scaled_exp_ratio_error"] < 0.05
    assert "scaled-exp slab fitted here: main loop" in out.read_text()
    assert f"wrote {out}" in err  # the messages stay on stderr


def test_nothing_fitting_the_limits_is_a_user_error(tmp_path, capsys, monkeypatch):
    from flce_policy.benchmarks import suite
    from flce_policy.engine import probe

    def fake_run_suite(shapes, methods, *, logit_std, warmup, repeats, sustained_s, predict_peak, on_start, on_record):
        by_chunk = {r.chunk_size: r for r in gemma_rows()}
        return [by_chunk[predict_peak(m, shapes[0])[0] if m.name != "gemm_floor" else None] for m in methods]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe, "probe_device", lambda index=None: H200)
    monkeypatch.setattr(suite, "run_suite", fake_run_suite)
    out = tmp_path / "p.yaml"
    assert main(["tune", "--shapes", "8192x5376x262144", "--max-peak", "1GiB", "--out", str(out)]) == 2
    _, err = capsys.readouterr()
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith("error: at 8192x5376x262144 no chunk size fits the limits (measured peak <= 1.00 GiB)")
    assert "Traceback" not in err and not out.exists()


def test_bench_user_errors_are_one_line(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bench.json"
    bad.write_text("{not json")
    assert main(["bench", "--from-json", str(bad)]) == 2
    _, err = capsys.readouterr()
    assert err.startswith(f"error: --from-json {bad}: not JSON") and len(err.splitlines()) == 1
    bad.write_bytes(b"\xff\xfe")
    assert main(["bench", "--from-json", str(bad)]) == 2
    _, err = capsys.readouterr()
    assert err.startswith(f"error: --from-json {bad}: 'utf-8' codec can't decode") and len(err.splitlines()) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["bench", "--methods", "ligr_c1"]) == 2
    _, err = capsys.readouterr()
    assert err.startswith("error: --methods ligr_c1 matches no method") and len(err.splitlines()) == 1


def test_a_grad_weight_filter_is_written_into_the_tuned_rule(tmp_path):
    path, text = written(tmp_path, gemma_rows(), tune.Limits(max_peak=5 * GIB), grad_weight_filter=2.0**-12)
    policy = FLCEPolicy.from_yaml(path)
    assert policy.rules[0].grad_weight_filter == 2.0**-12
    assert policy.resolve(Problem(*GEMMA), H200).grad_weight_filter == 2.0**-12
    assert "tune does not measure the filter" in text
    path, text = written(
        tmp_path, gemma_rows(), tune.Limits(max_peak=5 * GIB), grad_weight_filter=2.0**-12, grad_weight_filter_rescue=16
    )
    assert FLCEPolicy.from_yaml(path).resolve(Problem(*GEMMA), H200).grad_weight_filter_rescue == 16


# --- the slab form ------------------------------------------------------------------------------------


def _tune_h200(tmp_path, capsys, monkeypatch, device, slowdown, *extra, rows_slowdown=None, ws_slowdown=None):
    from flce_policy.benchmarks import suite
    from flce_policy.engine import probe

    fake_run_suite = stub_suite(
        gemma_rows(), scaled_exp_slowdown=slowdown, rows_slowdown=rows_slowdown, ws_slowdown=ws_slowdown
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe, "probe_device", lambda index=None: device)
    monkeypatch.setattr(suite, "run_suite", fake_run_suite)
    out = tmp_path / "tuned.yaml"
    code = main(["tune", "--shapes", "8192x5376x262144", "--max-peak", "5GiB", "--out", str(out), *extra])
    _, err = capsys.readouterr()
    assert code == 0, err
    return out, err, fake_run_suite.calls


def test_the_scaled_exp_slab_is_written_when_its_pick_runs_within_2_percent(tmp_path, capsys, monkeypatch):
    """Both forms within 2%: the faster; on a tie the row-scaled one."""
    out, err, _ = _tune_h200(tmp_path, capsys, monkeypatch, H200, 1.01)
    text = out.read_text()
    assert FLCEPolicy.from_yaml(out).rules[0].to_config() == {
        "match": "H200",
        "strategy": "scaled_exp",
        "inner": {"strategy": "slab_budget", "max_slab": "1GiB"},
        "rows": True,
        "warp_specialised": False,
    }
    assert f"wrote {out}: match H200 -> scaled_exp (rows) around slab_budget max_slab 1GiB" in err
    for form in ("logits", "scaled_exp_rows", "scaled_exp"):
        assert f"# on the {form} slab:" in text
    chosen = (
        "chosen: max_slab 1GiB, the smallest slab within 2% of every shape's fastest time, on the scaled_exp_rows slab"
    )
    assert chosen in text
    for form in ("scaled_exp_rows", "scaled_exp"):
        assert f"8192x5376x262144: {form} pick (max_slab 1GiB) 1.010x the logits pick's time (max_slab 1GiB)" in text
    out, err, _ = _tune_h200(tmp_path, capsys, monkeypatch, H200, 1.005, rows_slowdown=1.015)
    assert FLCEPolicy.from_yaml(out).rules[0].to_config()["rows"] is False  # the per-tile form, the faster


def test_the_warp_specialised_form_is_measured_on_hopper_and_written_when_faster(tmp_path, capsys, monkeypatch):
    out, err, calls = _tune_h200(tmp_path, capsys, monkeypatch, H200, 1.01, ws_slowdown=0.99)
    assert FLCEPolicy.from_yaml(out).rules[0].to_config() == {
        "match": "H200",
        "strategy": "scaled_exp",
        "inner": {"strategy": "slab_budget", "max_slab": "1GiB"},
        "rows": True,
        "warp_specialised": True,
    }
    assert "-> scaled_exp (rows, warp-specialised) around slab_budget max_slab 1GiB" in err
    assert "# on the scaled_exp_ws slab:" in out.read_text()
    assert any(name.startswith("ours_scaled_exp_ws_chunk") for name in calls[0][0])
    # a later GPU than Hopper runs no Gluon GEMM: not measured there
    assert tune.slab_forms_for(GEMMA, DeviceInfo.synthetic("B200")) == ("logits", "scaled_exp_rows", "scaled_exp")
    assert tune.slab_forms_for(GEMMA, H200) == ("logits", "scaled_exp_rows", "scaled_exp_ws", "scaled_exp")


def test_a_scaled_exp_slab_over_2_percent_slower_is_not_written_and_fastest_follows(tmp_path, capsys, monkeypatch):
    out, err, _ = _tune_h200(tmp_path, capsys, monkeypatch, H200, 1.03, "--strategy", "fastest")
    rule = FLCEPolicy.from_yaml(out).rules[0].to_config()
    assert rule["strategy"] == "fastest"
    assert "1.030x the logits pick's time" in out.read_text()
    out, err, _ = _tune_h200(tmp_path, capsys, monkeypatch, H200, 0.99, "--strategy", "fastest")
    rule = FLCEPolicy.from_yaml(out).rules[0].to_config()
    assert rule["strategy"] == "scaled_exp" and rule["inner"]["strategy"] == "fastest"


def test_before_hopper_only_the_logits_slab_is_measured(tmp_path, capsys, monkeypatch):
    out, err, calls = _tune_h200(tmp_path, capsys, monkeypatch, DeviceInfo.synthetic("A100"), 1.0)
    assert not any("scaled_exp" in name for names, *_ in calls for name in names)
    assert FLCEPolicy.from_yaml(out).rules[0].to_config()["strategy"] == "slab_budget"
    assert "scaled_exp slab" not in out.read_text()


def test_the_slab_form_is_chosen_over_every_shape():
    """Within 2% at one shape and not at the other: the logits slab, whose choice holds for both."""
    methods = {m.chunk_size: m for m in fixed_chunk_methods((256, 512, 1024, 2048, 4096), "bf16", "scaled_exp")}
    small_methods = {m.chunk_size: m for m in fixed_chunk_methods((256, 512, 1024, 2048), "bf16", "scaled_exp")}

    def scaled(rows, by_chunk, slowdown):
        return [as_method(r, by_chunk[None if r.chunk_size == r.shape[0] else r.chunk_size], slowdown)
                for r in rows if r.family == "ours fixed"]  # fmt: skip

    records = [*gemma_rows(), *small_rows()]
    limits = tune.Limits(max_peak=5 * GIB)
    logits = tune.choose(records, limits, device=H200)
    near = [*scaled(gemma_rows(), methods, 1.01), *scaled(small_rows(), small_methods, 1.01)]
    far = [*scaled(gemma_rows(), methods, 1.01), *scaled(small_rows(), small_methods, 1.05)]
    for extra, form in ((near, "scaled_exp"), (far, "logits")):
        scaled_choice = tune.choose([*records, *extra], limits, device=H200, slab_form="scaled_exp")
        assert scaled_choice.slab_form == "scaled_exp"
        assert tune.choose_slab_form(logits, scaled_choice).slab_form == form
    assert tune.choose_slab_form(logits, None) is logits


def test_sustained_samples_reach_the_suite_and_the_file_says_how_it_measured(tmp_path, capsys, monkeypatch):
    from flce_policy.benchmarks import suite
    from flce_policy.engine import probe

    fake_run_suite = stub_suite(gemma_rows(), scaled_exp_slowdown=1.05)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe, "probe_device", lambda index=None: H200)
    monkeypatch.setattr(suite, "run_suite", fake_run_suite)
    out = tmp_path / "h200.yaml"
    argv = ["tune", "--shapes", "8192x5376x262144", "--max-peak", "5GiB", "--sustained", "1.5", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    assert fake_run_suite.sustained == [1.5]
    text = " ".join(line.lstrip("# ") for line in out.read_text().splitlines())
    assert "median of 5 samples after 2 warm-up calls, each the mean call over 1.5 s of calls back to back" in text
    assert FLCEPolicy.from_yaml(out).rules[0].strategy == SlabBudget("1GiB")


def test_sustained_needs_a_positive_window(tmp_path, capsys):
    assert main(["tune", "--max-slab", "1GiB", "--sustained", "0", "--out", str(tmp_path / "p.yaml")]) == 2
    assert "--sustained: expected a positive number, got '0'" in capsys.readouterr().err
