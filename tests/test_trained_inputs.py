"""Trained bench inputs (issue 26, part 1) on a tiny build: corpus split, determinism, cache, report, CLI.

The build is the GPU one shrunk (V=320, H=64, 2 layers, 2 steps, a few stdlib packages as the
corpus); it trains through apply_flce, so the kernels run under the interpreter here. The
distribution report is checked against a plain fp64 torch computation over the whole [T, V] matrix
and an explicit loop over the tiles.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from flce_policy.benchmarks.logit_stats import logit_distribution  # noqa: E402
from flce_policy.benchmarks.trained_config import TrainedConfig, cache_key  # noqa: E402
from flce_policy.benchmarks.trained_corpus import is_held_out, python_sources, split_corpus  # noqa: E402
from flce_policy.benchmarks.trained_inputs import (  # noqa: E402
    cache_path,
    distribution_report,
    load_or_build,
    write_reports,
)
from flce_policy.benchmarks.trained_model import build_model, held_out_loss  # noqa: E402
from flce_policy.benchmarks.trained_tokenizer import VocabTooLarge, train_tokenizer  # noqa: E402
from flce_policy.cli import main  # noqa: E402
from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED  # noqa: E402
from flce_policy.plan.weight_filter import FILTER_COLS, FILTER_ROWS  # noqa: E402

pytestmark = pytest.mark.skipif(
    not KERNELS_INTERPRETED, reason="the tiny build trains on the CPU, under the interpreter"
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
PACKAGES = ("json", "email", "xml", "unittest", "concurrent")
TINY = TrainedConfig(
    train_bytes=150_000,
    held_out_bytes=30_000,
    held_out_share=0.2,
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    seq_len=16,
    batch_size=2,
    steps=2,
    warmup_steps=1,
    held_out_tokens=64,
)
CPU = torch.device("cpu")


def tiny_sources():
    return python_sources({name: STDLIB / name for name in PACKAGES})


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Two builds of TINY into two empty cache folders, counting how often the corpus is listed."""
    calls = []

    def sources():
        calls.append(1)
        return tiny_sources()

    dirs = [tmp_path_factory.mktemp("cache_a"), tmp_path_factory.mktemp("cache_b")]
    data = [load_or_build(TINY, d, device=CPU, sources=sources, log=lambda _m: None) for d in dirs]
    return {"dirs": dirs, "data": data, "calls": calls}


def test_two_builds_from_one_seed_are_identical(builds):
    a, b = builds["data"]
    assert a["tokenizer"] == b["tokenizer"]
    for name in ("x", "weight", "target", "token_counts"):
        assert torch.equal(a[name], b[name]), name
    assert a["losses"] == b["losses"]
    assert a["x"].shape == (TINY.held_out_tokens, TINY.hidden_size) and a["x"].dtype == torch.bfloat16
    assert a["weight"].shape == (TINY.vocab_size, TINY.hidden_size) and a["weight"].dtype == torch.bfloat16
    assert a["target"].shape == (TINY.held_out_tokens,) and 0 <= a["target"].min() <= a["target"].max() < 320
    assert len(a["losses"]) == TINY.steps


def test_cache_is_built_when_missing_and_reused_when_present(builds):
    assert len(builds["calls"]) == 2  # one build per empty folder
    for folder in builds["dirs"]:
        assert cache_path(TINY, folder).is_file()
        assert [p.name for p in folder.iterdir()] == [cache_path(TINY, folder).name]  # no partial file left

    def no_build():
        raise AssertionError("the cache file was there; nothing should be rebuilt")

    logged = []
    again = load_or_build(TINY, builds["dirs"][0], device=CPU, sources=no_build, log=logged.append)
    assert torch.equal(again["x"], builds["data"][0]["x"])
    assert logged and logged[0].startswith("loading ")


def test_held_out_loss_is_the_models_own_cross_entropy():
    """HF's logits of the untrained model, fp32, against held_out_loss (bf16 hidden states and head)."""
    model = build_model(TINY)
    stream = torch.randint(0, TINY.vocab_size, (40 * TINY.seq_len,), generator=torch.Generator().manual_seed(1))
    got = held_out_loss(model, TINY, stream, device=CPU, chunk_rows=24)
    # the same positions: held_out_head_inputs spreads its sequences evenly over the stream
    seqs = stream.view(-1, TINY.seq_len)
    need = -(-TINY.held_out_tokens // (TINY.seq_len - 1))
    picked = seqs[torch.linspace(0, seqs.shape[0] - 1, need).round().long()]
    with torch.no_grad():
        logits = model(input_ids=picked).logits[:, :-1].reshape(-1, TINY.vocab_size)
    targets = picked[:, 1:].reshape(-1)
    want = torch.nn.functional.cross_entropy(logits[: TINY.held_out_tokens], targets[: TINY.held_out_tokens])
    assert got == pytest.approx(want.item(), rel=2e-3)  # bf16 rounding of the hidden states and the head


def test_held_out_files_are_kept_apart(builds):
    data = builds["data"][0]
    train, held = set(data["train_files"]), set(data["held_out_files"])
    assert train and held and not train & held
    assert all(is_held_out(name, TINY.held_out_share) for name in held)
    assert not any(is_held_out(name, TINY.held_out_share) for name in train)


def test_split_covers_every_file_once_and_respects_the_budget():
    files = tiny_sources()
    names = [f.name for f in files]
    assert names == sorted(names) and len(set(names)) == len(names)
    corpus = split_corpus(files, train_bytes=10**9, held_out_bytes=10**9, held_out_share=0.2)
    assert not set(corpus.train_names) & set(corpus.held_out_names)
    # every readable, non-empty file lands in exactly one split when the budgets are unlimited
    readable = {f.name for f in files if f.path.read_bytes()}
    assert set(corpus.train_names) | set(corpus.held_out_names) == readable
    small = split_corpus(files, train_bytes=20_000, held_out_bytes=5_000, held_out_share=0.2)
    largest = max(len(t.encode()) for t in corpus.train_texts)
    assert 20_000 <= small.train_bytes < 20_000 + largest
    assert set(small.train_names) <= set(corpus.train_names)


def test_a_root_inside_another_is_listed_once():
    nested = python_sources({"outer": STDLIB / "email", "inner": STDLIB / "email" / "mime"})
    mime = sorted(p.name for p in (STDLIB / "email" / "mime").glob("*.py"))
    assert sorted(f.name for f in nested if f.name.startswith("inner/")) == [f"inner/{m}" for m in mime]
    assert not [f for f in nested if f.name.startswith("outer/mime/")]
    assert len({f.path.resolve() for f in nested}) == len(nested)


def test_a_vocab_the_corpus_cannot_reach_is_a_clear_error():
    with pytest.raises(VocabTooLarge, match="reached .* tokens, not the 100000 asked for"):
        train_tokenizer(["def f(x):\n    return x\n"] * 3, 100_000)


def test_reports_are_written(builds, tmp_path):
    data = builds["data"][0]
    report = distribution_report(data, "cpu", chunk_rows=128)
    written = write_reports(data, report, tmp_path)
    assert {p.name for p in written} == {"trained_inputs.json", "loss_curve.json", "loss_curve.png"}
    summary = json.loads((tmp_path / "trained_inputs.json").read_text())
    assert summary["key"] == cache_key(TINY) and summary["config"] == TINY.model_dump()
    assert summary["final_loss"] == data["losses"][-1]
    assert {(r["order"], r["tile"]) for r in summary["distribution"]["tiles"]} == {
        (order, tile) for order in ("natural", "frequency") for tile in (64, 128, f"{FILTER_ROWS}x{FILTER_COLS}")
    }
    assert json.loads((tmp_path / "loss_curve.json").read_text()) == [[i + 1, v] for i, v in enumerate(data["losses"])]
    assert (tmp_path / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the distribution report against a direct computation -------------------------------------------


def _reference(x, weight, target, vocab_order, eps, tiles, ignore_index=-100):
    """The report's numbers from the whole fp64 [T, V] matrix, tile by tile in Python."""
    logits = x.double() @ weight.double().t()
    valid = target != ignore_index
    p = torch.softmax(logits, dim=1)
    grad = p.clone()
    grad[~valid] = 0
    rows = valid.nonzero().squeeze(1)
    grad[rows, target[rows]] -= 1
    lv = logits[valid]
    ref = {
        "ce": torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index).item(),
        "entropy": -(p[valid] * torch.log(p[valid])).sum(1).mean().item(),
        "logit_std": lv.std(unbiased=False).item(),
        "below": {e: (p[valid] < e).double().mean().item() for e in eps},
        "tiles": {},
    }
    gw, gi = grad.t() @ x.double(), grad @ weight.double()
    for order, perm in (("natural", torch.arange(weight.shape[0])), ("frequency", vocab_order)):
        g, w = grad[:, perm], weight.double()[perm]
        for t in tiles:
            tr, tc = (t, t) if isinstance(t, int) else t
            label = t if isinstance(t, int) else f"{tr}x{tc}"
            for e in eps:
                kept = torch.zeros_like(g)
                skipped = total = 0
                for r in range(0, g.shape[0], tr):
                    for c in range(0, g.shape[1], tc):
                        total += 1
                        if g[r : r + tr, c : c + tc].abs().max() < e:
                            skipped += 1
                            kept[r : r + tr, c : c + tc] = g[r : r + tr, c : c + tc]
                ref["tiles"][order, label, e] = (
                    skipped / total,
                    (kept.t() @ x.double()).norm().item() / gw.norm().item(),
                    (kept @ w).norm().item() / gi.norm().item(),
                )
    return ref


def test_distribution_report_matches_a_direct_computation():
    tokens, hidden, vocab = 100, 16, 203  # neither a multiple of the tiles
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    # a peaked head: a few columns carry most of the mass, so some tiles are skippable and some not
    scale = torch.linspace(3.0, 0.2, vocab)[:, None] / hidden**0.5
    weight = (torch.randn(vocab, hidden, generator=gen) * scale).to(torch.bfloat16)
    weight[:5] += 3 * x.float().mean(0).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    target[::17] = -100
    order = torch.randperm(vocab, generator=gen)
    eps, tiles = (2.0**-4, 2.0**-8, 2.0**-12), (8, 16, (8, 16))

    got = logit_distribution(x, weight, target, vocab_order=order, eps=eps, tiles=tiles, chunk_rows=32)
    ref = _reference(x.float(), weight.float(), target, order, eps, tiles)

    assert got["ce"] == pytest.approx(ref["ce"], rel=1e-5)
    assert got["entropy"] == pytest.approx(ref["entropy"], rel=1e-5)
    assert got["logit_std"] == pytest.approx(ref["logit_std"], rel=1e-5)
    assert got["scored_tokens"] == int((target != -100).sum())
    assert {row["eps"]: row["share"] for row in got["below_eps"]} == pytest.approx(ref["below"], abs=1e-6)
    rows = {(r["order"], r["tile"], r["eps"]): r for r in got["tiles"]}
    assert set(rows) == set(ref["tiles"])
    assert 0 < sum(r["skippable"] for r in rows.values()) < len(rows)  # the case is neither all nor nothing
    for key, (skip, gw_share, gi_share) in ref["tiles"].items():
        assert rows[key]["skippable"] == pytest.approx(skip, abs=1e-12), key
        assert rows[key]["grad_weight_share"] == pytest.approx(gw_share, rel=1e-4, abs=1e-9), key
        assert rows[key]["grad_input_share"] == pytest.approx(gi_share, rel=1e-4, abs=1e-9), key


def test_chunk_rows_must_hold_whole_tiles():
    x, w, t = torch.zeros(4, 2), torch.zeros(3, 2), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple of every tile's rows"):
        logit_distribution(x, w, t, tiles=(64, 128), chunk_rows=96)


# --- the bench command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--inputs", "trained", "--shapes", "4096x1024x32768"], "--shapes only apply to --inputs random"),
        (["--inputs", "trained", "--logit-std", "2"], "--logit-std only apply to --inputs random"),
        (["--inputs", "nonsense"], "--inputs is random, trained or a trained-inputs cache file"),
    ],
)
def test_bench_refuses_what_trained_inputs_fix(capsys, argv, fragment):
    code = main(["bench", *argv])
    _, err = capsys.readouterr()
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert fragment in err


def test_bench_runs_every_method_on_a_cache_file(builds, tmp_path, capsys, monkeypatch):
    """--inputs FILE: one shape, the file's; run_suite gets those inputs for it; metadata says which."""
    from flce_policy.benchmarks import suite, trained_inputs
    from flce_policy.benchmarks.methods import Inputs
    from flce_policy.benchmarks.suite import Record, with_floor_ratios
    from flce_policy.engine import probe
    from flce_policy.plan.device import DeviceInfo

    seen = {}

    def fake_run_suite(shapes, methods, *, inputs_for, on_record, **_options):
        shapes = list(shapes)
        seen.update(shapes=shapes, inputs=inputs_for(shapes[0]))
        records = [Record(shapes[0], m.name, m.family, m.accum, median_ms=1.0) for m in methods]
        for record in records:
            on_record(record)
        return with_floor_ratios(records)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(probe, "probe_device", lambda index=None: DeviceInfo.synthetic("H200"))
    monkeypatch.setattr(suite, "run_suite", fake_run_suite)
    # the tensors stay on the CPU here (bench moves them to the GPU)
    monkeypatch.setattr(
        trained_inputs, "trained_inputs", lambda data, device: Inputs(data["x"], data["weight"], data["target"])
    )
    path = cache_path(TINY, builds["dirs"][0])
    out = tmp_path / "out"
    code = main(["bench", "--inputs", str(path), "--methods", "ours_default_bf16", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    data = builds["data"][0]
    assert seen["shapes"] == [(TINY.held_out_tokens, TINY.hidden_size, TINY.vocab_size)]
    assert torch.equal(seen["inputs"].x, data["x"]) and torch.equal(seen["inputs"].target, data["target"])
    meta = json.loads((out / "bench.json").read_text())["metadata"]
    assert meta["inputs"] == f"trained {cache_key(TINY)}" and meta["logit_std"] is None
    assert meta["shapes"] == [f"{TINY.held_out_tokens}x{TINY.hidden_size}x{TINY.vocab_size}"]
