"""The scaled-exp slab (``Geometry.slab_form="scaled_exp"``) against fp64 torch, and where it is not used.

The kernels run under the interpreter on CPU. Logits of std 4 as in the benchmarks: there the logits
slab's bf16 rounding (``|z| 2^-9`` into every ``p``) dominates the dense path's gradient error, which the
scaled-exp slab avoids; the gradients it stores are still bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_loss_kernel import DEVICE, NEEDS_KERNEL_DEVICE

from flce_policy import FLCEPolicy, fused_linear_cross_entropy
from flce_policy.kernels.driver import inject_oom
from flce_policy.kernels.weight_grad_filter import observe_tiles
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.memory import predict_peak
from flce_policy.plan.oom import OOMFallbackWarning
from flce_policy.plan.problem import Problem
from flce_policy.strategies import HeuristicC, ScaledExp, StrategyError, strategy_from_config

pytestmark = NEEDS_KERNEL_DEVICE

BT, H, V, CHUNK = 150, 64, 600, 64  # 3 row chunks (the last 22 rows), 3 column tiles of 256 (the last 88)
#: bf16 gradients (relative L2) and loss (relative) against fp64
GRAD_TOL, LOSS_TOL = 1.2e-2, 2e-3


def inputs(seed: int = 0, *, bias: bool = False, n_ignored: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {
        "x": torch.randn(BT, H, generator=g),
        "w": torch.randn(V, H, generator=g) * (4.0 / H**0.5),  # logit std 4
        "y": torch.randint(0, V, (BT,), generator=g),
        "cw": torch.rand(V, generator=g) + 0.5,
    }
    t["y"][torch.randperm(BT, generator=g)[:n_ignored]] = -100
    if bias:
        t["b"] = torch.randn(V, generator=g)
    return {k: (v.to(torch.bfloat16) if k in ("x", "w", "b") else v).to(DEVICE) for k, v in t.items()}


def geometry(slab_form: str, chunk: int = CHUNK) -> Geometry:
    return Geometry.for_problem(Problem(BT, H, V, "bfloat16"), chunk, slab_form=slab_form)


def run(t, policy, grad_output=None, *, class_weight=False, **options):
    """The call's loss, extras and gradients (x, w, b)."""
    leaves = {k: t[k].clone().requires_grad_() for k in ("x", "w", "b") if k in t}
    out = fused_linear_cross_entropy(
        leaves["x"], leaves["w"], t["y"], leaves.get("b"), class_weight=t["cw"] if class_weight else None,
        policy=policy, **options,
    )  # fmt: skip
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward(grad_output)
    extras = () if isinstance(out, torch.Tensor) else tuple(e for e in out[1:] if e is not None)
    return loss.detach(), extras, {k: v.grad for k, v in leaves.items()}


def reference(t, grad_output=None, *, reduction="mean", label_smoothing=0.0, z_loss_scale=0.0, class_weight=False,
              token_scaling=False, softcap=None):  # fmt: skip
    """fp64 torch: the loss and the gradients of x, w (and b)."""
    leaves = {k: t[k].double().requires_grad_() for k in ("x", "w", "b") if k in t}
    z = F.linear(leaves["x"], leaves["w"], leaves.get("b"))
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    y, valid = t["y"], t["y"] != -100
    cw = t["cw"].double() if class_weight else None
    rows = F.cross_entropy(z, y, weight=cw, reduction="none", label_smoothing=label_smoothing)
    rows = rows + torch.where(valid, z_loss_scale * torch.logsumexp(z, -1) ** 2, 0.0)
    if token_scaling:
        rows = rows * z.detach().softmax(-1).gather(1, y.clamp_min(0)[:, None]).squeeze(1)
    if reduction == "none":
        loss = (rows * grad_output.double()).sum()
    elif reduction == "sum":
        loss = rows.sum()
    else:
        loss = rows.sum() / valid.sum()
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in leaves.items()}


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


CASES = {
    "mean, bias": (dict(bias=True), dict(), dict()),
    "sum, smoothing, class weights, z-loss": (
        dict(),
        dict(reduction="sum", label_smoothing=0.1, z_loss_scale=1e-3),
        dict(class_weight=True),
    ),
    "none, token scaling": (dict(), dict(reduction="none", use_token_scaling=True), dict()),
    "fp32 accumulation, bias": (dict(bias=True), dict(accum_dtype=torch.float32), dict()),
    "mean, class weights, z-loss (row-scaled)": (dict(), dict(z_loss_scale=1e-3), dict(class_weight=True)),
    "fp32 accumulation, sum, z-loss (row-scaled)": (
        dict(),
        dict(accum_dtype=torch.float32, reduction="sum", z_loss_scale=1e-3),
        dict(),
    ),
    "fp32 accumulation, sum, smoothing, class weights": (
        dict(),
        dict(accum_dtype=torch.float32, reduction="sum", label_smoothing=0.1),
        dict(class_weight=True),
    ),
}


#: The scaled-exp forms: per column tile, and per row where the call allows (no bias or label smoothing), that
#: last also with the warp-specialised GEMM (on a CPU its Triton stand-in: the same 128-column slots, slot-major).
FORMS = ("scaled_exp", "scaled_exp_rows", "scaled_exp_ws")
ROW_FORMS = ("scaled_exp_rows", "scaled_exp_ws")


def _runs_row_scaled(case: str) -> bool:
    input_kw, options, _ = CASES[case]
    return not input_kw.get("bias") and not options.get("label_smoothing")


@pytest.mark.parametrize(
    ("case", "form"),
    [(case, "scaled_exp") for case in CASES]
    + [(case, form) for form in ROW_FORMS for case in CASES if _runs_row_scaled(case)],
)
def test_options_against_fp64(case, form):
    input_kw, options, call_kw = CASES[case]
    t = inputs(seed=1, **input_kw)
    grad_output = torch.rand(BT, generator=torch.Generator().manual_seed(2)).to(DEVICE) if "none" in case else None
    got_loss, _, got = run(t, geometry(form), grad_output, **options, **call_kw)
    ref_options = {k: v for k, v in options.items() if k not in ("accum_dtype", "use_token_scaling")}
    want_loss, want = reference(
        t, grad_output, token_scaling=options.get("use_token_scaling", False), **ref_options, **call_kw
    )
    if "none" in case:
        got_loss = (got_loss.double() * grad_output.double()).sum()
    assert abs(got_loss.double().item() - want_loss.item()) <= LOSS_TOL * abs(want_loss.item())
    for name, grad in got.items():
        assert rel_l2(grad, want[name]) < GRAD_TOL, name


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("accum_dtype", [None, torch.float32])
def test_more_accurate_than_the_logits_slab(accum_dtype, form):
    """The point of the path: at logit std 4 its gradients are clearly closer to fp64 than the logits slab's
    (no rounding of the logits, the target's term outside the bf16 gradient)."""
    t = inputs(seed=3)
    _, want = reference(t)
    scaled = run(t, geometry(form), accum_dtype=accum_dtype)[2]
    logits = run(t, geometry("logits"), accum_dtype=accum_dtype)[2]
    for name in ("x", "w"):
        assert rel_l2(scaled[name], want[name]) < 0.7 * rel_l2(logits[name], want[name]), name


@pytest.mark.parametrize("form", FORMS)
def test_extras_against_torch(form):
    """Accuracy and predicted tokens as eager's argmax over the bf16 logits; entropy against fp64."""
    t = inputs(seed=4)
    _, extras, _ = run(t, geometry(form), return_token_accuracy=True, return_predicted_tokens=True, return_entropy=True)
    accuracy, predicted, entropy = extras[-3:]
    valid = t["y"] != -100
    eager_argmax = F.linear(t["x"].float(), t["w"].float()).to(torch.bfloat16).argmax(-1)
    assert torch.equal(predicted[valid], eager_argmax[valid]) and torch.all(predicted[~valid] == -1)
    assert accuracy.item() == pytest.approx((eager_argmax == t["y"])[valid].double().mean().item())
    z = F.linear(t["x"].double(), t["w"].double())
    want_entropy = torch.where(valid, -(z.softmax(-1) * z.log_softmax(-1)).sum(-1), 0.0)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("accum_dtype", [None, torch.float32])  # the target terms in the slab, and beside it
def test_grad_weight_filter_leaves_grad_input_alone(accum_dtype, form):
    t = inputs(seed=5)
    t["y"] = torch.where(t["y"] == -100, -100, t["y"] % 100)  # targets in the first column block: others skippable
    dense = run(t, geometry(form), accum_dtype=accum_dtype)
    with observe_tiles() as counts:
        # (at 0.5 the first chunk keeps every tile, which leaves the later chunks unflagged)
        filtered = run(t, geometry(form), grad_weight_filter=0.9, accum_dtype=accum_dtype)
    assert sum(int(c.kept) for c in counts) < sum(c.total for c in counts)  # some tiles were skipped
    assert torch.equal(filtered[0], dense[0]) and torch.equal(filtered[2]["x"], dense[2]["x"])
    assert not torch.equal(filtered[2]["w"], dense[2]["w"])


@pytest.mark.parametrize("form", FORMS)
def test_grad_weight_filter_flags_against_fp64(form):
    """The flags of either form (the row-scaled one's from its GEMM's per-half-tile row maxima) keep the tiles the
    fp64 rule keeps, counted exactly, and grad_weight is fp64's over them. Classes made rare by a constant feature
    (the rows form takes no bias), targets in the first 100 classes: some tiles are kept for their maxima alone."""
    from test_weight_grad_filter import _tile_mask, _tiles_kept

    eps = 2.0**-8
    t = inputs(seed=5)
    t["x"][:, 0] = 1.0
    t["w"][:, 0] = torch.linspace(4.0, -12.0, V).to(torch.bfloat16)
    t["y"] = torch.where(t["y"] == -100, -100, t["y"] % 100)
    with observe_tiles() as counts:
        filtered = run(t, geometry(form), grad_weight_filter=eps)
    z = F.linear(t["x"].double(), t["w"].double()).requires_grad_()
    (grad,) = torch.autograd.grad(F.cross_entropy(z, t["y"]), z)
    valid = t["y"] != -100
    deviation = (z.detach().softmax(-1) - F.one_hot(t["y"].clamp_min(0), V).double() * valid[:, None]).abs()
    keep = ((deviation >= eps) | (grad < 0)) & valid[:, None]  # (grad < 0: the target)
    kept_tiles = _tiles_kept(keep, CHUNK, V)[0]
    assert 3 < int(kept_tiles[:, 1:].sum()) < kept_tiles[:, 1:].numel()  # kept for their maxima, and skipped
    assert sum(int(c.kept) for c in counts) == int(kept_tiles.sum())
    want = (grad * _tile_mask(keep, CHUNK, V)).T @ t["x"].double()
    assert rel_l2(filtered[2]["w"], want) < GRAD_TOL


def _record_forms(monkeypatch) -> list[str]:
    """The scaled-exp GEMMs the driver launches from now on: "rows" (and the redo flag it left), "redo", "tile"."""
    import flce_policy.kernels.driver as driver

    forms: list[str] = []
    real = driver.scaled_exp_logits

    def recording(*args, row_scaled=False, redo=False, **kw):
        real(*args, row_scaled=row_scaled, redo=redo, **kw)
        forms.append("redo" if redo else f"rows {int(args[5].redo.item())}" if row_scaled else "tile")

    monkeypatch.setattr(driver, "scaled_exp_logits", recording)
    return forms


SOFTCAP_CASES = {
    "mean, cap 10": (10.0, dict(), dict()),
    "sum, class weights, z-loss, cap 30": (30.0, dict(reduction="sum", z_loss_scale=1e-3), dict(class_weight=True)),
    "mean, token scaling, fp32 accumulation, cap 5": (5.0, dict(use_token_scaling=True, accum_dtype=torch.float32), {}),
}


# exp(2 |z| / c) overflows to inf where |z| >> c (its reciprocal, 0, is what the kernel uses); numpy says so
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("form", ROW_FORMS)
@pytest.mark.parametrize("case", SOFTCAP_CASES)
def test_softcap_on_the_row_scaled_form_against_fp64(case, form, monkeypatch):
    """A softcap (fp32) runs the row-scaled GEMM with capped logits, never flagging a redo, on rows whose logits lie
    far past the cap (std ~160 on three rows: dz'/dz down to ~1e-8) as on the others."""
    softcap, options, call_kw = SOFTCAP_CASES[case]
    t = inputs(seed=8)
    t["x"][[3, 70, 140]] *= 40
    forms = _record_forms(monkeypatch)
    got_loss, _, got = run(t, geometry(form), softcap=softcap, **options, **call_kw)
    assert forms == ["rows 0", "redo"] * 3
    ref_options = {k: v for k, v in options.items() if k not in ("accum_dtype", "use_token_scaling")}
    want_loss, want = reference(
        t, softcap=softcap, token_scaling=options.get("use_token_scaling", False), **ref_options, **call_kw
    )
    assert abs(got_loss.double().item() - want_loss.item()) <= LOSS_TOL * abs(want_loss.item())
    for name, grad in got.items():
        assert rel_l2(grad, want[name]) < GRAD_TOL, name


@pytest.mark.parametrize(
    ("why", "input_kw", "options"),
    [
        ("eager rounding", dict(), dict(softcap=10.0, softcap_rounding="eager")),
        ("over the limit", dict(), dict(softcap=40.0)),
        ("a bias", dict(bias=True), dict(softcap=10.0)),
        ("label smoothing", dict(), dict(softcap=10.0, label_smoothing=0.1)),
        ("the accuracy", dict(), dict(softcap=10.0, return_token_accuracy=True)),
        ("the entropy", dict(), dict(softcap=10.0, return_entropy=True)),
        ("no gradient in the forward", dict(), dict(softcap=10.0, reduction="none")),
    ],
)
def test_a_softcap_the_capped_gemm_cannot_run_takes_the_logits_slab(why, input_kw, options, monkeypatch):
    t = inputs(seed=6, **input_kw)
    grad_output = (
        torch.rand(BT, generator=torch.Generator().manual_seed(2)).to(DEVICE) if "reduction" in options else None
    )
    forms = _record_forms(monkeypatch)
    asked = run(t, geometry("scaled_exp_rows"), grad_output, **options)
    assert forms == []
    logits = run(t, geometry("logits"), grad_output, **options)
    assert torch.equal(asked[0], logits[0])
    for name in ("x", "w"):
        assert torch.equal(asked[2][name], logits[2][name])


@pytest.mark.parametrize(
    ("options", "tile"),
    [
        (dict(), 128),
        (dict(softcap=10.0), 256),
        (dict(return_token_accuracy=True, return_predicted_tokens=True), 256),
        (dict(return_entropy=True), 256),
    ],
)
def test_a_ws_call_the_gluon_gemm_cannot_run_takes_the_row_scaled_form(options, tile, monkeypatch):
    """The warp-specialised GEMM (128-column slots) computes no softcap, argmax or entropy: such calls run the
    row-scaled form's Triton GEMM in its own 256-column slots, as a call asking for that form does."""
    import flce_policy.kernels.driver as driver

    tiles: list[int] = []
    real = driver.scaled_exp_logits

    def recording(*args, **kw):
        tiles.append(args[5].scaled_exp_tile)
        real(*args, **kw)

    monkeypatch.setattr(driver, "scaled_exp_logits", recording)
    t = inputs(seed=9)
    asked = run(t, geometry("scaled_exp_ws"), **options)
    assert set(tiles) == {tile}
    if tile == 128:
        return
    rows = run(t, geometry("scaled_exp_rows"), **options)
    assert torch.equal(asked[0], rows[0])
    for got, want in zip(asked[1], rows[1], strict=True):
        assert torch.equal(got, want)
    for name in ("x", "w"):
        assert torch.equal(asked[2][name], rows[2][name])


def test_oom_fallback_keeps_the_slab_form():
    t = inputs(seed=7)
    with inject_oom(above_rows=64), pytest.warns(OOMFallbackWarning):
        retried = run(t, geometry("scaled_exp", chunk=128))
    direct = run(t, geometry("scaled_exp", chunk=64))
    assert torch.equal(retried[0], direct[0])
    for name in ("x", "w"):
        assert torch.equal(retried[2][name], direct[2][name])


@pytest.mark.parametrize(
    ("problem", "vocab_chunk", "why"),
    [
        (Problem(BT, H, V, "float32"), None, "float32 logits"),
        (Problem(BT, 60, V, "bfloat16"), None, "H=60"),
        (Problem(BT, H, V, "bfloat16"), 256, "vocab tiles of 256"),
        (Problem(BT, H, V, "bfloat16", tp_size=2), None, "vocab-parallel shard"),
    ],
)
def test_geometry_refuses_what_the_slab_cannot_run(problem, vocab_chunk, why):
    with pytest.raises(ValueError, match=f"slab_form='scaled_exp' cannot run .*{why}"):
        Geometry.for_problem(problem, 64, vocab_chunk=vocab_chunk, slab_form="scaled_exp")
    with pytest.raises(ValueError, match="slab_form"):
        Geometry.for_problem(Problem(BT, H, V), 64, slab_form="exp")


def test_strategy_picks_the_slab_where_it_runs():
    strategy = strategy_from_config({"strategy": "scaled_exp", "inner": {"strategy": "heuristic_c", "c": 16}})
    assert strategy == ScaledExp(HeuristicC(16)) and strategy.to_config()["inner"] == {
        "strategy": "heuristic_c",
        "c": 16,
    }
    bf16 = Problem(16384, 1024, 131072, "bfloat16")
    inner = HeuristicC(16).geometry(bf16, DeviceInfo.synthetic("H200"))
    on_h200 = strategy.geometry(bf16, DeviceInfo.synthetic("H200"))
    assert on_h200.slab_form == "scaled_exp" and on_h200.chunk_size == inner.chunk_size
    assert strategy.geometry(bf16, DeviceInfo.synthetic("A100")).slab_form == "logits"  # no TMA before Hopper
    fp32 = Problem(16384, 1024, 131072, "float32")
    assert strategy.geometry(fp32, DeviceInfo.synthetic("H200")).slab_form == "logits"


def test_strategy_errors_name_the_inner_parameter():
    with pytest.raises(StrategyError, match="inner.c"):
        strategy_from_config(
            {"strategy": "scaled_exp", "inner": {"strategy": "heuristic_c", "c": -1}}
        ).validate_params()
    with pytest.raises(StrategyError, match="inner must decide"):
        ScaledExp({"strategy": "free_memory"}).validate_params()


def test_policy_explains_the_slab():
    policy = FLCEPolicy(default=ScaledExp({"strategy": "fixed_chunk_size", "chunk_size": 4096}))
    text = policy.explain(Problem(16384, 1024, 131072, "bfloat16"), DeviceInfo.synthetic("H200"))
    assert "exp(z - m) per 256 columns" in text and "softcap" in text


def test_memory_model_counts_the_partials():
    """A slot per row and 256 columns (512 at V = 131072), padded to a power of two: six fp32 planes and an int32;
    three fp32 per row and the redo flag; and the row-scaled form's x_c times its rows' scales (bf16), where
    grad_weight is asked and there is no bias."""
    problem = Problem(16384, 1024, 131072, "bfloat16")
    scratch = 8192 * 512 * (6 * 4 + 4) + 8192 * 3 * 4 + 4
    # the warp-specialised form's row-scaled chunks: a slot per 128 columns (1024 at V = 131072)
    ws_scratch = 8192 * 1024 * (6 * 4 + 4) + 8192 * 3 * 4 + 4
    cases = [("scaled_exp", {}, scratch, 0), ("scaled_exp_rows", {}, scratch, 8192 * 1024 * 2)]
    cases += [
        ("scaled_exp_rows", dict(bias=True), scratch, 0),
        ("scaled_exp_rows", dict(weight_grad=False), scratch, 0),
    ]
    cases += [("scaled_exp_ws", {}, ws_scratch, 8192 * 1024 * 2), ("scaled_exp_ws", dict(bias=True), scratch, 0)]
    cases += [("scaled_exp_ws", dict(weight_grad=False), ws_scratch, 0)]
    cases += [("scaled_exp_ws", dict(weight_grad=False, input_grad=False), scratch, 0)]
    for form, kw, partials, scaled_input in cases:
        logits = predict_peak(Geometry.for_problem(problem, 8192), **kw).total_bytes
        scaled = predict_peak(Geometry.for_problem(problem, 8192, slab_form=form), **kw).total_bytes
        assert scaled - logits == partials + scaled_input, (form, kw)


def test_bench_policy_wraps_every_rule():
    """The bench row's policy: the packaged policy's chunks on every GPU, on the scaled-exp slab where it runs; the
    heads the H200 rule puts on its Gluon GEMM (``ws_inner``) take the rule's ``inner`` chunks, as at every size."""
    from flce_policy.benchmarks.methods import scaled_exp_policy

    packaged = FLCEPolicy.packaged()
    wrapped = scaled_exp_policy(packaged)
    problem = Problem(16384, 4096, 131072, "bfloat16")  # over the H200 rule's ws_max_hidden
    for family, form in (("H200", "scaled_exp"), ("H100", "scaled_exp"), ("A100", "logits")):
        device = DeviceInfo.synthetic(family)
        want = packaged.resolve(problem, device)
        got = wrapped.resolve(problem, device)
        assert (got.chunk_size, got.vocab_chunk, got.slab_form) == (want.chunk_size, want.vocab_chunk, form), family
    small, h200 = Problem(16384, 1024, 131072, "bfloat16"), DeviceInfo.synthetic("H200")
    assert packaged.resolve(small, h200).chunk_size == 16384  # ws_inner's 5 GiB
    assert wrapped.resolve(small, h200).chunk_size == 8192  # inner's 2.5 GiB


def test_bias_gradient_alone():
    """A frozen head with a trained bias: the target's term goes into grad_bias beside the slab's sum."""
    t = inputs(seed=8, bias=True)
    b = t["b"].clone().requires_grad_()
    loss = fused_linear_cross_entropy(t["x"], t["w"], t["y"], b, policy=geometry("scaled_exp"))
    (grad_b,) = torch.autograd.grad(loss, b)
    _, want = reference(t)
    assert rel_l2(grad_b, want["b"]) < GRAD_TOL


# the row-scaled pass leaves inf in those rows for the redo to replace; numpy under the interpreter says so
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("form", ROW_FORMS)
def test_rows_far_above_their_target_redo_the_chunk_per_tile(monkeypatch, form):
    """The row-scaled form holds exp(z - z_y): rows whose logits lie more than 64 nats above their target's would
    overflow. Their chunk is redone per tile on the device (no host read), and the result is still fp64's."""
    import flce_policy.kernels.driver as driver

    t = inputs(seed=5)
    t["x"][[3, 70, 140]] *= 40  # logit std ~160 on three rows, one in each chunk
    flags = []
    real = driver.scaled_exp_logits

    def recording(*args, row_scaled=False, redo=False, **kw):
        real(*args, row_scaled=row_scaled, redo=redo, **kw)
        if row_scaled:
            flags.append(int(args[5].redo.item()))

    monkeypatch.setattr(driver, "scaled_exp_logits", recording)
    got_loss, _, got = run(t, geometry(form))
    want_loss, want = reference(t)
    assert flags == [1, 1, 1]  # every chunk was row-scaled, and each one flagged
    assert abs(got_loss.double().item() - want_loss.item()) <= LOSS_TOL * abs(want_loss.item())
    for name, grad in got.items():
        assert torch.isfinite(grad).all() and rel_l2(grad, want[name]) < GRAD_TOL, name
    flags.clear()
    run(inputs(seed=5), geometry(form))
    assert flags == [0, 0, 0]  # the same inputs without those rows: no chunk redone


def test_a_bias_label_smoothing_or_fp16_take_the_per_tile_form(monkeypatch):
    import flce_policy.kernels.driver as driver

    forms = []
    real = driver.scaled_exp_logits

    def recording(*args, row_scaled=False, redo=False, **kw):
        real(*args, row_scaled=row_scaled, redo=redo, **kw)
        forms.append("redo" if redo else "rows" if row_scaled else "tile")

    monkeypatch.setattr(driver, "scaled_exp_logits", recording)
    half = {k: v.half() if v.dtype == torch.bfloat16 else v for k, v in inputs(seed=6).items()}
    half_rows = Geometry.for_problem(Problem(BT, H, V, "float16"), CHUNK, slab_form="scaled_exp_rows")
    for t, policy, options, want in (
        (inputs(seed=6), geometry("scaled_exp_rows"), {}, ["rows", "redo"] * 3),
        (inputs(seed=6, bias=True), geometry("scaled_exp_rows"), {}, ["tile"] * 3),
        (inputs(seed=6), geometry("scaled_exp_rows"), dict(label_smoothing=0.1), ["tile"] * 3),
        (half, half_rows, {}, ["tile"] * 3),  # exp(z - z_y) needs bf16's exponent range
    ):
        forms.clear()
        run(t, policy, **options)
        assert forms == want, options


def test_the_rows_form_is_a_strategy_parameter():
    strategy = ScaledExp({"strategy": "heuristic_c", "c": 16}, rows=True)
    config = {"strategy": "scaled_exp", "inner": {"strategy": "heuristic_c", "c": 16}, "rows": True}
    assert strategy.to_config() == {**config, "warp_specialised": False} and strategy_from_config(config) == strategy
    geometry = strategy.geometry(Problem(BT, H, V, "bfloat16"), DeviceInfo.synthetic("H200"))
    assert geometry.slab_form == "scaled_exp_rows"
    with pytest.raises(StrategyError, match="rows must be true or false"):
        ScaledExp({"strategy": "heuristic_c", "c": 16}, rows="yes").geometry(
            Problem(BT, H, V, "bfloat16"), DeviceInfo.synthetic("H200")
        )


@pytest.mark.parametrize(
    ("form", "kw", "want"),
    [
        ("scaled_exp_rows", dict(bias=False, label_smoothing=0.0), True),
        ("scaled_exp_rows", dict(bias=True, label_smoothing=0.0), False),
        ("scaled_exp_rows", dict(bias=False, label_smoothing=0.1), False),
        ("scaled_exp_rows", dict(bias=False, label_smoothing=0.0, dtype="float16"), False),
        ("scaled_exp_ws", dict(bias=False, label_smoothing=0.0), True),
        ("scaled_exp_ws", dict(bias=True, label_smoothing=0.0), False),
        ("scaled_exp_ws", dict(bias=False, label_smoothing=0.1), False),
        ("scaled_exp", dict(bias=False, label_smoothing=0.0), False),
        ("logits", dict(bias=False, label_smoothing=0.0), False),
    ],
)
def test_which_calls_run_the_row_scaled_form(form, kw, want):
    from flce_policy.plan.scaled_exp import row_scaled

    assert row_scaled(form, **kw) is want


@pytest.mark.parametrize("form", ["logits", *FORMS])
def test_the_target_check_is_queued_after_the_first_logits_gemm(monkeypatch, form):
    """The check's kernel waits for the first chunk's logits GEMM on the host (flce_policy/call/targets.py), and
    comes before every kernel that reads the safe targets (the CE finish)."""
    import flce_policy.call.targets as targets_module
    import flce_policy.kernels.driver as driver

    order = []

    def spy(module, name, label):
        real = getattr(module, name)

        def wrapped(*args, **kwargs):
            order.append(label)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    spy(targets_module, "prepare_targets_", "check")
    spy(driver, "scaled_exp_logits", "gemm")
    spy(driver, "ce_rows", "finish")
    if form == "logits":
        monkeypatch.setattr(driver, "torch", _MmSpy(order))
    t = inputs(seed=8)
    got_loss, _, got = run(t, geometry(form))
    assert order[:3] == ["gemm", "check", "finish"] and order.count("check") == 1, order
    want_loss, want = reference(t)
    assert torch.allclose(got_loss.double(), want_loss, rtol=LOSS_TOL)
    assert rel_l2(got["w"], want["w"]) < GRAD_TOL and rel_l2(got["x"], want["x"]) < GRAD_TOL


class _MmSpy:
    """``torch`` for the driver's module, recording each logits GEMM."""

    def __init__(self, order: list[str]) -> None:
        self._order = order

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def mm(self, *args, **kwargs):
        if kwargs.get("out") is not None and kwargs["out"].shape[1] == V:
            self._order.append("gemm")
        return torch.mm(*args, **kwargs)


@pytest.mark.parametrize("form", FORMS)
def test_a_target_outside_the_vocabulary_still_raises_with_the_check_deferred(form):
    """The first chunk's target-logit kernel runs on the caller's unchecked targets: a bad index there must still
    be the check's ValueError, not a read outside W."""
    t = inputs(seed=9)
    t["y"][3] = V + 5
    with pytest.raises(ValueError, match=rf"target holds index {V + 5}, outside \[0, V={V}\)"):
        run(t, geometry(form))


def _peaked(seed: int) -> dict[str, torch.Tensor]:
    """A "trained" head without a bias: frequent classes in columns 128-255 and 512-599 only (a last hidden column
    of ones meets a per-class offset in W: 3 there, -9 elsewhere; the kept tiles are not the same set with the two
    halves of a 256-column slot swapped), targets drawn from the model's own softmax."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BT, H, generator=g)
    x[:, -1] = 1.0
    w = torch.randn(V, H, generator=g) * (1.5 / H**0.5)
    w[:, -1] = -9.0
    w[128:256, -1] = w[512:, -1] = 3.0
    y = torch.multinomial((x.double() @ w.double().T).softmax(-1).float(), 1, generator=g).squeeze(1)
    y[torch.randperm(BT, generator=g)[:5]] = -100
    return {"x": x.to(torch.bfloat16).to(DEVICE), "w": w.to(torch.bfloat16).to(DEVICE), "y": y.to(DEVICE)}


@pytest.mark.parametrize("form", FORMS)
def test_filter_keeps_the_tiles_fp64_keeps(form):
    """The flags (on the row-scaled form from the GEMM epilogue's row maxima, per tile from the finish pass over the
    slab) keep exactly the FILTER_ROWS x FILTER_COLS tiles where fp64's |p - onehot| reaches eps or the target lies."""
    from test_weight_grad_filter import _tiles_kept

    eps = 2.0**-8
    t = _peaked(seed=11)
    z = t["x"].double() @ t["w"].double().T
    valid = t["y"] != -100
    deviation = (z.softmax(-1) - F.one_hot(t["y"].clamp_min(0), V).double() * valid[:, None]).abs()

    def kept(threshold: float) -> int:
        keep = ((deviation >= threshold) | (F.one_hot(t["y"].clamp_min(0), V) > 0)) & valid[:, None]
        return int(_tiles_kept(keep, CHUNK, V)[0].sum())

    want = kept(eps)
    assert kept(eps * (1 - 1e-3)) == want == kept(eps * (1 + 1e-3)), "a tile hangs on an entry within 0.1% of eps"
    dense = run(t, geometry(form))
    with observe_tiles() as counts:
        filtered = run(t, geometry(form), grad_weight_filter=eps)
    total = sum(c.total for c in counts)
    assert sum(int(c.kept) for c in counts) == want and 0 < want < total
    assert torch.equal(filtered[0], dense[0]) and torch.equal(filtered[2]["x"], dense[2]["x"])
    # grad_weight: fp64's over the kept tiles only (mean: dL/dz = (p - onehot) / kept rows); the skipped tiles of
    # these logits carry too little to tell apart from the dense gradient at bf16's error: the count above does
    onehot = F.one_hot(t["y"].clamp_min(0), V).double() * valid[:, None]
    grad = (z.softmax(-1) - onehot) * valid[:, None] / valid.sum()
    keep = ((deviation >= eps) | (onehot > 0)) & valid[:, None]
    tiles, row_tile, col_tile = _tiles_kept(keep, CHUNK, V)
    mask = tiles[row_tile][:, col_tile].to(grad.device)
    assert rel_l2(filtered[2]["w"], (grad * mask).T @ t["x"].double()) < GRAD_TOL


@pytest.mark.parametrize("form", FORMS)
def test_the_flags_carry_each_group_s_level_below_eps(form, monkeypatch):
    """Beside keep-or-not, each row's flag per 128 classes carries the level of its largest |p - onehot| below eps
    (KEPT_FLAG - ceil(log2(eps / it)), at least 1; the rescue's input): on the row-scaled form from the GEMM's row
    maxima, per tile from the finish's pass. The last chunk's flags (rows 128-149) against fp64's, octave ties within
    1e-4 left out."""
    from flce_policy.kernels import driver
    from flce_policy.plan.weight_filter import FILTER_COLS, KEPT_FLAG

    scratches = []

    def keep_scratch(call, rows, cols):
        scratches.append(driver_scratch(call, rows, cols))
        return scratches[-1]

    driver_scratch = driver.filter_scratch_for
    monkeypatch.setattr(driver, "filter_scratch_for", keep_scratch)
    eps, first, groups = 2.0**-8, 2 * CHUNK, -(-V // FILTER_COLS)
    t = _peaked(seed=11)
    run(t, geometry(form), grad_weight_filter=eps)
    got = scratches[-1].flags[: BT - first, :groups].cpu()
    z = (t["x"].double() @ t["w"].double().T)[first:].cpu()
    y = t["y"][first:].cpu()
    valid = y != -100
    onehot = F.one_hot(y.clamp_min(0), V).double() * valid[:, None]
    deviation = (z.softmax(-1) - onehot).abs() * valid[:, None]
    top = F.pad(deviation, (0, groups * FILTER_COLS - V)).view(len(y), groups, FILTER_COLS).amax(-1)
    has_target = (F.pad(onehot, (0, groups * FILTER_COLS - V)).view(len(y), groups, FILTER_COLS) > 0).any(-1)
    gap = torch.log2(eps / top)
    kept = (top >= eps) | has_target
    want = torch.where(kept, KEPT_FLAG, KEPT_FLAG - gap.ceil().clamp(1, KEPT_FLAG - 1)).to(torch.uint8)
    clear = kept | ((gap - gap.round()).abs() > 1e-4) | (gap > KEPT_FLAG)
    assert clear.float().mean() > 0.95
    assert torch.equal(got[clear], want[clear])
    assert len(torch.unique(want[~kept])) >= 4  # the case is one: several levels, the ignored rows' among them


def test_a_fitted_chunk_on_the_row_scaled_slab_against_fp64():
    """``Fastest(slab_form=..., chunk_multiple=...)`` under a peak that no power of two fills: the loss runs its
    pick (a row count that is neither a power of two nor a multiple of the GEMM's 128-row tile) as fp64 says."""
    from flce_policy.plan.memory import predict_peak
    from flce_policy.strategies import Fastest

    problem = Problem(BT, H, V, "bfloat16")
    limit = predict_peak(Geometry.for_problem(problem, 100, slab_form="scaled_exp_rows")).total_bytes
    strategy = Fastest(max_slab="1GiB", max_peak=limit, slab_form="scaled_exp_rows", chunk_multiple=20)
    picked = strategy.geometry(problem, DeviceInfo.synthetic("H200"))
    assert (picked.chunk_size, picked.slab_form) == (100, "scaled_exp_rows")
    t = inputs(seed=12)
    got_loss, _, got = run(t, picked)
    want_loss, want = reference(t)
    assert torch.allclose(got_loss.double(), want_loss, rtol=LOSS_TOL)
    assert rel_l2(got["x"], want["x"]) < GRAD_TOL and rel_l2(got["w"], want["w"]) < GRAD_TOL


def test_the_warp_specialised_form_is_a_strategy_parameter():
    """``warp_specialised: true`` (with ``rows``) asks for ``"scaled_exp_ws"``: kept on Hopper and on a GPU of
    unknown capability, the plain row-scaled form on a later GPU, the logits slab before Hopper."""
    config = {
        "strategy": "scaled_exp",
        "inner": {"strategy": "heuristic_c", "c": 16},
        "rows": True,
        "warp_specialised": True,
    }
    strategy = strategy_from_config(config)
    assert strategy.to_config() == config
    problem = Problem(16384, 1024, 131072, "bfloat16")
    forms = {
        family: strategy.geometry(problem, DeviceInfo.synthetic(family)).slab_form
        for family in ("H200", "H100", "B200", "A100")
    }
    assert forms == {"H200": "scaled_exp_ws", "H100": "scaled_exp_ws", "B200": "scaled_exp_rows", "A100": "logits"}
    assert strategy.geometry(problem, DeviceInfo.cpu()).slab_form == "scaled_exp_ws"
    with pytest.raises(StrategyError, match="warp_specialised: true needs rows: true"):
        ScaledExp({"strategy": "heuristic_c", "c": 16}, warp_specialised=True).validate_params()
    with pytest.raises(StrategyError, match="warp_specialised must be true or false"):
        ScaledExp({"strategy": "heuristic_c", "c": 16}, rows=True, warp_specialised="yes").validate_params()


def test_ws_max_hidden_keeps_larger_heads_on_the_triton_row_scaled_gemm():
    """``ws_max_hidden``: the Gluon GEMM up to that hidden size, the row-scaled form's Triton GEMM above it (on
    Hopper; a later GPU runs the row-scaled form at any size); it round-trips, and a bad value is named."""
    config = {
        "strategy": "scaled_exp",
        "inner": {"strategy": "heuristic_c", "c": 16},
        "rows": True,
        "warp_specialised": True,
        "ws_max_hidden": 3072,
    }
    strategy = strategy_from_config(config)
    assert strategy.to_config() == config
    h200, b200 = DeviceInfo.synthetic("H200"), DeviceInfo.synthetic("B200")
    forms = {h: strategy.geometry(Problem(16384, h, 131072, "bfloat16"), h200).slab_form for h in (2048, 3072, 3080)}
    assert forms == {2048: "scaled_exp_ws", 3072: "scaled_exp_ws", 3080: "scaled_exp_rows"}
    assert strategy.geometry(Problem(16384, 1024, 131072, "bfloat16"), b200).slab_form == "scaled_exp_rows"
    assert "ws_max_hidden" not in ScaledExp(config["inner"], rows=True, warp_specialised=True).to_config()
    for bad in (0, -1, 2.5, "4k", True):
        with pytest.raises(StrategyError, match="ws_max_hidden must be a positive integer"):
            ScaledExp(config["inner"], rows=True, warp_specialised=True, ws_max_hidden=bad).validate_params()
    with pytest.raises(StrategyError, match="ws_max_hidden limits the warp-specialised GEMM"):
        ScaledExp(config["inner"], rows=True, ws_max_hidden=3072).validate_params()


def test_ws_inner_chunks_the_heads_that_ask_for_the_gluon_gemm():
    """``ws_inner``: the chunks of the heads up to ``ws_max_hidden`` (asking for the Gluon GEMM), on any GPU;
    ``inner``'s above it; it round-trips (omitted when unset) and is validated, errors named under its key."""
    config = {
        "strategy": "scaled_exp",
        "inner": {"strategy": "slab_budget", "max_slab": "2GiB"},
        "rows": True,
        "warp_specialised": True,
        "ws_max_hidden": 3072,
        "ws_inner": {"strategy": "fixed_chunk_size", "chunk_size": 8192},
    }
    strategy = strategy_from_config(config)
    assert strategy.to_config() == config
    h200, b200 = DeviceInfo.synthetic("H200"), DeviceInfo.synthetic("B200")
    chunks = {h: strategy.geometry(Problem(16384, h, 262144, "bfloat16"), h200).chunk_size for h in (1152, 3072, 3080)}
    assert chunks == {1152: 8192, 3072: 8192, 3080: 4096}  # 4 GiB / (262144 x 2 bytes) = 8192 rows: 4096 above
    assert strategy.pick_chunk_size(Problem(16384, 1152, 262144, "bfloat16"), h200) == 8192
    # a GPU that runs the row-scaled form instead: the same chunks (the head asked for the Gluon GEMM)
    geometry = strategy.geometry(Problem(16384, 1152, 262144, "bfloat16"), b200)
    assert (geometry.chunk_size, geometry.slab_form) == (8192, "scaled_exp_rows")
    unset = dict(config, ws_inner=None)
    assert "ws_inner" not in strategy_from_config(unset).to_config()
    assert strategy_from_config(unset).geometry(Problem(16384, 1152, 262144, "bfloat16"), h200).chunk_size == 4096
    with pytest.raises(StrategyError, match="ws_inner chunks the heads on the warp-specialised GEMM"):
        ScaledExp(config["inner"], rows=True, ws_inner=config["ws_inner"]).validate_params()
    with pytest.raises(StrategyError, match=r"ws_inner\.chunk_size"):
        ScaledExp(
            config["inner"],
            rows=True,
            warp_specialised=True,
            ws_inner={"strategy": "fixed_chunk_size", "chunk_size": 0},
        ).validate_params()
    with pytest.raises(StrategyError, match="ws_inner must decide from the problem and the device alone"):
        ScaledExp(
            config["inner"], rows=True, warp_specialised=True, ws_inner={"strategy": "free_memory"}
        ).validate_params()


def test_the_warp_specialised_form_writes_128_column_slots_slot_major(monkeypatch):
    """Its row-scaled chunks' workspace has a slot per 128 columns and the GEMM writes each slot's row sums
    slot-major (slot s of row r at s * rows + r), as the Gluon GEMM does; fp64's per-tile sums of exp(z - z_y)."""
    import flce_policy.kernels.driver as driver

    t = inputs(seed=3)
    seen = []
    real = driver.scaled_exp_logits

    def recording(x_chunk, weight, bias, slab, target, ws, *, row_scaled=False, redo=False, **kw):
        real(x_chunk, weight, bias, slab, target, ws, row_scaled=row_scaled, redo=redo, **kw)
        if row_scaled:
            rows = ws.partials.shape[1]
            sums = ws.partials[1].reshape(-1)[: ws.slots * rows].view(ws.slots, rows)
            seen.append((ws.scaled_exp_tile, x_chunk.double(), target.clone(), sums[:, : x_chunk.shape[0]].clone()))

    monkeypatch.setattr(driver, "scaled_exp_logits", recording)
    run(t, geometry("scaled_exp_ws"))
    assert len(seen) == 3
    w = t["w"].double()
    for tile, x, y, sums in seen:
        assert tile == 128
        z = x @ w.T
        valid = y != -100
        shift = z.gather(1, y.clamp_min(0)[:, None])
        e = torch.nn.functional.pad(torch.exp(z - shift), (0, 640 - V)).view(-1, 5, 128).sum(2)  # 5 tiles of 128
        got = sums[:5].T.double()
        assert torch.allclose(got[valid], e[valid], rtol=1e-4), (got[valid] - e[valid]).abs().max()
        assert (got[~valid] == 0).all()  # ignored rows: shift +inf, exp 0


def test_the_cost_model_prices_each_form_s_logits_gemm():
    """The logits GEMM's term over cuBLAS's is the Triton GEMM's main loop and its epilogue per logit for the two
    Triton forms, and the Gluon GEMM's rate (its epilogue overlapped) for "scaled_exp_ws"; otherwise the row-scaled
    forms cost the same."""
    from flce_policy.plan.cost_model import predict_seconds, rates_for

    problem = Problem(16384, 1024, 131072, "bfloat16")
    rates = rates_for(DeviceInfo.synthetic("H200"))._replace(scaled_exp_gemm_efficiency=0.8, ws_gemm_efficiency=0.95)
    terms = {
        form: predict_seconds(Geometry.for_problem(problem, 8192, slab_form=form), rates).terms
        for form in ("scaled_exp_rows", "scaled_exp_ws")
    }
    one_gemm = 2 * 16384 * 1024 * 131072 / rates.matmul_flops
    per_logit = rates.scaled_exp_epilogue_flops * 16384 * 131072 / rates.matmul_flops  # the Triton GEMM's epilogue
    assert per_logit > 0
    assert terms["scaled_exp_rows"]["scaled_exp_epilogue"] == pytest.approx(one_gemm * (1 / 0.8 - 1) + per_logit)
    assert terms["scaled_exp_ws"]["scaled_exp_epilogue"] == pytest.approx(one_gemm * (1 / 0.95 - 1))
    for name, value in terms["scaled_exp_rows"].items():
        if name != "scaled_exp_epilogue":
            assert terms["scaled_exp_ws"][name] == value, name


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("accum_dtype", [None, torch.float32])
def test_hidden_over_several_column_blocks_of_the_target_kernels(form, accum_dtype):
    """H = 600 and 40 rows in chunks of 24: the target kernels' programs split the hidden size into blocks (the last
    partial) and the rows into blocks (the last partial); the gradients still match fp64."""
    g = torch.Generator().manual_seed(11)
    bt, hidden, vocab = 40, 600, 600
    t = {
        "x": torch.randn(bt, hidden, generator=g).to(torch.bfloat16),
        "w": (torch.randn(vocab, hidden, generator=g) * (4.0 / hidden**0.5)).to(torch.bfloat16),
        "y": torch.randint(0, vocab, (bt,), generator=g),
    }
    t["y"][[3, 29]] = -100
    t = {k: v.to(DEVICE) for k, v in t.items()}
    policy = Geometry.for_problem(Problem(bt, hidden, vocab, "bfloat16"), 24, slab_form=form)
    got_loss, _, got = run(t, policy, accum_dtype=accum_dtype)
    want_loss, want = reference(t)
    assert abs(got_loss.double().item() - want_loss.item()) <= LOSS_TOL * abs(want_loss.item())
    for name, grad in got.items():
        assert rel_l2(grad, want[name]) < GRAD_TOL, name
