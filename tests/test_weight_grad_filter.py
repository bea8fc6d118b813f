"""grad_weight_filter against plain torch: the skipped tiles leave grad_weight and grad_bias, nothing else moves.

The reference is fp64 torch on the same logits (the tensors' own GEMM, as the kernel's): dL/dlogits by
autograd, the per-token ``|softmax - onehot|`` of the softcapped logits, and the skip rule applied to
it independently of the kernels (tiles of FILTER_ROWS rows of a chunk x FILTER_COLS classes of a vocab
tile; a tile is kept when some entry is >= eps or holds a target). The loss, the extras and grad_input
must be bit for bit the unfiltered call's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_loss_kernel import DEVICE, NEEDS_KERNEL_DEVICE, rel_err

from flce_policy import fused_linear_cross_entropy
from flce_policy.kernels import driver
from flce_policy.kernels.weight_grad_filter import observe_tiles
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.plan.weight_filter import ALL_KEPT_COST, FILTER_COLS, FILTER_ROWS

pytestmark = NEEDS_KERNEL_DEVICE

BT, H, V = 100, 61, 509  # 2 row chunks of 64 (the last 36 rows), 4 flag columns (the last 125 wide)
#: tiles per row chunk of the default geometry (64 and 36 rows, 4 column blocks): 8 and 8 at 32-row tiles
CHUNK_TILES = [-(-rows // FILTER_ROWS) * -(-V // FILTER_COLS) for rows in (64, BT - 64)]
EPS = 2.0**-8
#: nothing skippable on the flat inputs
FLAT_EPS = 2.0**-12
#: fp32 kernel against the fp64 reference (errors seen ~1e-7)
FP32_TOL = 1e-5
#: bf16 gradients against the fp64 reference: a few bf16 roundings of the largest element
BF16_TOL = 2e-2


def peaked_inputs(seed: int = 0, *, bias: bool = True, n_ignored: int = 5, hidden: int = H) -> dict[str, torch.Tensor]:
    """A "trained" head: class frequencies falling along the vocabulary (a bias from 3 to -9), targets drawn
    from the model's own softmax, so the rare classes' columns carry almost nothing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BT, hidden, generator=g)
    w = torch.randn(V, hidden, generator=g) * (1.5 / hidden**0.5)
    b = torch.linspace(3.0, -9.0, V) + 0.1 * torch.randn(V, generator=g)
    p = (x.double() @ w.double().T + b.double()).softmax(-1)
    y = torch.multinomial(p.float(), 1, generator=g).squeeze(1)
    y[torch.randperm(BT, generator=g)[:n_ignored]] = -100
    out = {"x": x, "w": w, "y": y, "cw": torch.rand(V, generator=g) + 0.5}
    if bias:
        out["b"] = b
    return {k: t.to(DEVICE) for k, t in out.items()}


def flat_inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    """Random logits of std 1 over uniform classes: every tile holds entries above eps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BT, H, generator=g)
    w = torch.randn(V, H, generator=g) / H**0.5
    y = torch.randint(0, V, (BT,), generator=g)
    return {k: t.to(DEVICE) for k, t in {"x": x, "w": w, "y": y}.items()}


def geometry(dtype: torch.dtype, chunk: int = 64, vocab_chunk: int | None = None, hidden: int = H) -> Geometry:
    problem = Problem(tokens=BT, hidden=hidden, vocab=V, dtype=str(dtype).removeprefix("torch."))
    return Geometry.for_problem(problem, chunk, vocab_chunk=vocab_chunk)


def leaves(t: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype).requires_grad_() if k in ("x", "w", "b") else v for k, v in t.items()}


def run(t: dict[str, torch.Tensor], grad_output: torch.Tensor | None = None, *, class_weight: bool = False, **options):
    """The loss call, its backward and every tensor it returned (extras detached, gradients)."""
    for k in ("x", "w", "b"):
        if k in t:
            t[k].grad = None
    out = fused_linear_cross_entropy(
        t["x"], t["w"], t["y"], t.get("b"), class_weight=t["cw"] if class_weight else None, **options
    )
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward(grad_output)
    extras = () if isinstance(out, torch.Tensor) else tuple(e for e in out[1:] if e is not None)
    grads = {k: t[k].grad.clone() for k in ("x", "w", "b") if k in t}
    return loss.detach().clone(), extras, grads


def reference(
    t: dict[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    eps: float,
    chunk: int,
    vocab_chunk: int | None = None,
    grad_output: torch.Tensor | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    class_weight: bool = False,
    token_scaling: bool = False,
) -> dict[str, torch.Tensor]:
    """fp64 torch: the dense and the filtered grad_weight and grad_bias, the kept-tile mask and its share."""
    x, w = t["x"].detach().to(dtype), t["w"].detach().to(dtype)
    b = t["b"].detach().to(dtype) if "b" in t else None
    logits = F.linear(x, w, b).double().requires_grad_()  # the kernel's GEMM, in the tensors' dtype
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    y = t["y"]
    valid = y != -100
    cw = t["cw"].double() if class_weight else None
    rows = F.cross_entropy(z, y, weight=cw, reduction="none", label_smoothing=label_smoothing)
    lse = torch.logsumexp(z, dim=-1)
    rows = rows + torch.where(valid, z_loss_scale * lse**2, 0.0)
    p = z.detach().softmax(-1)
    onehot = F.one_hot(y.clamp_min(0), V).double() * valid[:, None]
    if token_scaling:
        rows = rows * (p * onehot).sum(-1)
    if reduction == "none":
        loss = (rows * grad_output.double()).sum()
    elif reduction == "sum":
        loss = rows.sum()
    else:
        assert not class_weight and not z_loss_scale
        loss = rows.sum() / valid.sum()
    (grad,) = torch.autograd.grad(loss, logits)
    deviation = (p - onehot).abs()

    def keep_at(threshold: float) -> torch.Tensor:
        keep = ((deviation >= threshold) | (onehot > 0)) & valid[:, None]
        return keep if vocab_chunk else unflagged_after_a_dense_chunk(keep, chunk)

    mask = _tile_mask(keep_at(eps), chunk, vocab_chunk or V)
    for nearby in (eps * (1 - 1e-3), eps * (1 + 1e-3)):  # the kernel's fp32 p could fall either side of eps
        assert torch.equal(_tile_mask(keep_at(nearby), chunk, vocab_chunk or V), mask), (
            "a tile's decision hangs on an entry within 0.1% of eps"
        )
    xd = x.double()
    return {
        "grad": grad,
        "keep": keep_at(eps),
        "deviation": deviation * valid[:, None],  # per-token |p - onehot|, 0 on ignored rows
        "dense_w": grad.T @ xd,
        "filtered_w": (grad * mask).T @ xd,
        "dense_b": grad.sum(0),
        "filtered_b": (grad * mask).sum(0),
        "kept_share": mask.double().mean(),
        "kept_tiles": int(_tiles_kept(keep_at(eps), chunk, vocab_chunk or V)[0].sum()),
    }


def unflagged_after_a_dense_chunk(
    keep: torch.Tensor, chunk: int, all_kept_cost: float = ALL_KEPT_COST["pointer"]
) -> torch.Tensor:
    """``keep [rows, classes]`` as the driver (one vocab tile) applies it: once a chunk keeps so many tiles that its
    grad_weight runs the dense GEMM (kept share x ``all_kept_cost`` >= 1; the pointer launch's: these tests' rows
    are not 16-byte aligned for TMA), the later chunks are not flagged and go dense, as if each entry were kept."""
    tiles, row_tile, _ = _tiles_kept(keep, chunk, keep.shape[1])
    out = keep.clone()
    for start in range(0, keep.shape[0], chunk):
        if float(tiles[row_tile[start : start + chunk].unique()].double().mean()) * all_kept_cost >= 1.0:
            out[start + chunk :] = True
            break
    return out


def _tile_mask(keep: torch.Tensor, chunk: int, vocab_chunk: int) -> torch.Tensor:
    """``keep`` spread over its tiles: FILTER_ROWS rows counted from each chunk's start x FILTER_COLS classes
    counted from each vocab tile's start."""
    tiles, row_tile, col_tile = _tiles_kept(keep, chunk, vocab_chunk)
    return tiles[row_tile][:, col_tile].to(keep.device)


def _tiles_kept(keep: torch.Tensor, chunk: int, vocab_chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tile whether it is kept ``[row tiles, column tiles]``, and each row's and column's tile."""
    keep = keep.cpu()
    r, c = torch.arange(keep.shape[0]), torch.arange(keep.shape[1])
    _, row_tile = torch.unique(torch.stack([r // chunk, r % chunk // FILTER_ROWS]), dim=1, return_inverse=True)
    _, col_tile = torch.unique(
        torch.stack([c // vocab_chunk, c % vocab_chunk // FILTER_COLS]), dim=1, return_inverse=True
    )
    counts = torch.zeros(int(row_tile.max()) + 1, int(col_tile.max()) + 1, dtype=torch.float64)
    counts.index_put_(
        (row_tile[:, None].expand_as(keep), col_tile[None, :].expand_as(keep)), keep.double(), accumulate=True
    )
    return counts > 0, row_tile, col_tile


def assert_same(filtered, dense) -> None:
    """The loss, every extra and grad_input bit for bit the unfiltered call's."""
    assert torch.equal(filtered[0], dense[0]), "loss"
    assert len(filtered[1]) == len(dense[1])
    for got, want in zip(filtered[1], dense[1], strict=True):
        assert torch.equal(got, want), "extra"
    assert torch.equal(filtered[2]["x"], dense[2]["x"]), "grad_input"


def test_peaked_fp32_skips_tiles_and_matches_the_masked_reference():
    t = leaves(peaked_inputs(), torch.float32)
    policy = geometry(torch.float32)
    dense = run(t, policy=policy)
    with observe_tiles() as tiles:
        filtered = run(t, policy=policy, grad_weight_filter=EPS)
    ref = reference(t, torch.float32, eps=EPS, chunk=64)
    assert 0.2 < ref["kept_share"] < 0.9  # something to skip, something kept
    # the kernel's own count of kept tiles (2 row chunks x 4 column blocks of 128)
    assert sum(int(c.kept) for c in tiles) == ref["kept_tiles"] and sum(c.total for c in tiles) == sum(CHUNK_TILES)
    assert_same(filtered, dense)
    assert rel_err(filtered[2]["w"], ref["filtered_w"]) < FP32_TOL
    assert rel_err(filtered[2]["b"], ref["filtered_b"]) < FP32_TOL
    # the filter moved grad_weight (slightly): the dense reference is further off than the kernel's rounding
    assert 1e-4 < rel_err(filtered[2]["w"], ref["dense_w"]) < 0.05
    assert rel_err(dense[2]["w"], ref["dense_w"]) < FP32_TOL


def test_peaked_bf16_extras_and_grad_input_bit_for_bit():
    t = leaves(peaked_inputs(seed=2), torch.bfloat16)
    extras = dict(return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True, return_entropy=True)
    dense = run(t, policy=geometry(torch.bfloat16, chunk=BT), z_loss_scale=1e-3, reduction="sum", **extras)
    filtered = run(
        t, policy=geometry(torch.bfloat16, chunk=BT), z_loss_scale=1e-3, reduction="sum", grad_weight_filter=EPS,
        **extras,
    )  # fmt: skip
    ref = reference(t, torch.bfloat16, eps=EPS, chunk=BT, reduction="sum", z_loss_scale=1e-3)
    assert ref["kept_share"] < 0.9
    assert_same(filtered, dense)
    assert rel_err(filtered[2]["w"], ref["filtered_w"]) < BF16_TOL
    assert rel_err(filtered[2]["b"], ref["filtered_b"]) < BF16_TOL


def test_flat_logits_nothing_skipped_same_results():
    # eps far below the typical p (1/V = 2^-9): no tile is near it (at EPS, with CUDA's fp32 logits, one tile
    # of the reference fell below it: H200)
    t = leaves(flat_inputs(), torch.float32)
    dense = run(t, policy=geometry(torch.float32))
    filtered = run(t, policy=geometry(torch.float32), grad_weight_filter=FLAT_EPS)
    ref = reference(t, torch.float32, eps=FLAT_EPS, chunk=64)
    # every tile of the 2 row chunks x 4 column blocks kept (counted: CUDA's mean of 50900 ones is not exactly 1)
    assert ref["kept_tiles"] == sum(CHUNK_TILES)
    assert_same(filtered, dense)
    # nothing to skip: the dense fallback runs the dense call's GEMM, so grad_weight and grad_bias are its own
    assert torch.equal(filtered[2]["w"], dense[2]["w"])
    assert rel_err(filtered[2]["w"], ref["dense_w"]) < FP32_TOL


@pytest.mark.parametrize(
    ("ignored_chunk", "flagged", "kept"), [(1, [True, False], CHUNK_TILES), (0, [True, True], [0, CHUNK_TILES[1]])]
)
def test_after_a_chunk_gone_dense_the_later_chunks_are_not_flagged(monkeypatch, ignored_chunk, flagged, kept):
    """A chunk whose kept tiles make the dense GEMM the faster (flat logits) leaves the call's later chunks
    unflagged (no flag cost) and dense; a chunk whose tiles were skipped (every row ignored) leaves the next one
    flagged. Results: the dense call's."""
    seen = []
    ce_rows = driver.ce_rows

    def spy(*args, **kwargs):
        seen.append(kwargs["filter_flags"] is not None)
        return ce_rows(*args, **kwargs)

    monkeypatch.setattr(driver, "ce_rows", spy)
    t = leaves(flat_inputs(), torch.float32)
    t["y"][64 * ignored_chunk : 64 * (ignored_chunk + 1)] = -100  # 2 chunks: rows 0-63 and 64-99
    dense = run(t, policy=geometry(torch.float32))
    seen.clear()
    with observe_tiles() as tiles:
        filtered = run(t, policy=geometry(torch.float32), grad_weight_filter=FLAT_EPS)
    assert seen == flagged
    assert [int(c.kept) for c in tiles] == kept and [c.total for c in tiles] == CHUNK_TILES
    assert_same(filtered, dense)
    assert torch.equal(filtered[2]["w"], dense[2]["w"])


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_softcap_smoothing_class_weights_z_loss_token_scaling(reduction):
    """The flags are per token: every option composes; the threshold ignores the smoothing, and a skipped tile
    drops all of its gradient (the smoothing's uniform term too)."""
    t = leaves(peaked_inputs(seed=3), torch.float32)
    options = dict(reduction=reduction, label_smoothing=0.05, softcap=6.0, z_loss_scale=1e-3, use_token_scaling=True)
    grad_output = (
        torch.randn(BT, generator=torch.Generator().manual_seed(4)).to(DEVICE) if reduction == "none" else None
    )
    policy = geometry(torch.float32)
    dense = run(t, grad_output, class_weight=True, policy=policy, **options)
    filtered = run(t, grad_output, class_weight=True, policy=policy, grad_weight_filter=EPS, **options)
    ref = reference(
        t, torch.float32, eps=EPS, chunk=64, grad_output=grad_output, class_weight=True, token_scaling=True,
        reduction=reduction, label_smoothing=0.05, softcap=6.0, z_loss_scale=1e-3,
    )  # fmt: skip
    assert ref["kept_share"] < 0.9
    assert_same(filtered, dense)
    assert rel_err(filtered[2]["w"], ref["filtered_w"]) < FP32_TOL
    assert rel_err(filtered[2]["b"], ref["filtered_b"]) < FP32_TOL
    assert rel_err(filtered[2]["w"], ref["dense_w"]) > 1e-4


def test_fp32_accumulation_over_bf16_chunks():
    t = leaves(peaked_inputs(seed=5), torch.bfloat16)
    dense = run(t, policy=geometry(torch.bfloat16), accum_dtype=torch.float32)
    filtered = run(t, policy=geometry(torch.bfloat16), accum_dtype=torch.float32, grad_weight_filter=EPS)
    ref = reference(t, torch.bfloat16, eps=EPS, chunk=64)
    assert ref["kept_share"] < 0.9
    assert_same(filtered, dense)
    assert filtered[2]["w"].dtype == torch.bfloat16
    assert rel_err(filtered[2]["w"], ref["filtered_w"]) < BF16_TOL


def test_zero_eps_is_the_dense_path():
    t = leaves(peaked_inputs(seed=7), torch.float32)
    dense = run(t, policy=geometry(torch.float32))
    zero = run(t, policy=geometry(torch.float32), grad_weight_filter=0.0)
    assert_same(zero, dense)
    assert torch.equal(zero[2]["w"], dense[2]["w"]) and torch.equal(zero[2]["b"], dense[2]["b"])
