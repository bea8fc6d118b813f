"""The Gluon row-scaled exp GEMM (:mod:`flce_policy.kernels.gluon_exp_gemm`): its import guard and input checks on
CPU, and on a Hopper GPU its slab, tile sums, maxima and redo flag against fp64 torch.

Gluon kernels do not run under Triton's interpreter: the GPU test needs sm_90 and Gluon's Hopper API.
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from flce_policy.kernels import gluon_exp_gemm
from flce_policy.kernels.gluon_exp_gemm import gluon_available, row_scaled_exp_gemm
from flce_policy.plan.scaled_exp import WS_TILE

#: the slab is bf16 of an fp32 exp2: rounding 2^-8 relative, plus ~1e-5 of fp32 error in z and exp2
SLAB_TOL = 4e-3
#: the tile sums are fp32 (from the fp32 exponentials): far below this (the maxima are of the stored bf16 values)
PARTIAL_TOL = 1e-3
#: results below fp32's normal range may be flushed to 0
FLUSHED = 2e-38


def _cpu_inputs(n=16, hidden=64, n_cols=256, **dtypes):
    x = torch.zeros(n, hidden, dtype=dtypes.get("x", torch.bfloat16))
    w = torch.zeros(n_cols, hidden, dtype=dtypes.get("w", torch.bfloat16))
    slab = torch.zeros(n, n_cols, dtype=torch.bfloat16)
    tiles_n = math.ceil(n_cols / WS_TILE)
    return {
        "x_chunk": x,
        "weight": w,
        "slab": slab,
        "row_shift": torch.zeros(n),
        "sums": torch.zeros(tiles_n * n, dtype=dtypes.get("sums", torch.float32)),
        "slot_stride": n,
        "redo": torch.zeros(1, dtype=torch.int32),
    }


def test_imports_and_says_whether_gluon_is_there():
    assert isinstance(gluon_available(), bool)
    assert WS_TILE == 128


def test_imports_without_gluon(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)  # its import now fails
    spec = importlib.util.spec_from_file_location("gluon_exp_gemm_without", gluon_exp_gemm.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.gluon_available() is False
    assert not hasattr(module, "_row_scaled_exp_kernel")


@pytest.mark.parametrize(
    "change, words",
    [
        ({"x": torch.float32}, "x_chunk must be torch.bfloat16"),
        ({"w": torch.float16}, "weight must be torch.bfloat16"),
        ({"sums": torch.float16}, "sums must be torch.float32"),
        ({"hidden": 12}, "multiples of 8"),
        ({"n_cols": 260}, "multiples of 8"),
    ],
)
def test_bad_inputs_are_value_errors_before_any_device_access(change, words):
    dtypes = {k: v for k, v in change.items() if k in ("x", "w", "sums")}
    sizes = {k: v for k, v in change.items() if k in ("hidden", "n_cols")}
    with pytest.raises(ValueError, match=words):
        row_scaled_exp_gemm(**_cpu_inputs(**sizes, **dtypes))


def test_layout_errors():
    args = _cpu_inputs()
    with pytest.raises(ValueError, match="slot_stride"):
        row_scaled_exp_gemm(**{**args, "slot_stride": 15})
    with pytest.raises(ValueError, match="sums must be a flat contiguous tensor of at least 32"):
        row_scaled_exp_gemm(**{**args, "sums": torch.zeros(31)})
    with pytest.raises(ValueError, match="slab must be a contiguous"):
        row_scaled_exp_gemm(**{**args, "slab": torch.zeros(16, 264, dtype=torch.bfloat16)[:, :256]})
    odd = torch.zeros(16 * 64 + 1, dtype=torch.bfloat16)[1:].view(16, 64)  # 2 bytes past an aligned start
    with pytest.raises(ValueError, match="16-byte aligned"):
        row_scaled_exp_gemm(**{**args, "x_chunk": odd})


def test_cpu_tensors_are_refused():
    with pytest.raises(ValueError, match="CUDA"):
        row_scaled_exp_gemm(**_cpu_inputs())


def _reference(x, w, shift, n_cols, rows=512):
    """exp(z - shift) in fp64 from the bf16 inputs, its tile sums and maxima [tiles_n, n] (past V: 0)."""
    tiles_n = math.ceil(n_cols / WS_TILE)
    pad = tiles_n * WS_TILE - n_cols
    exps, sums, maxima = [], [], []
    for r0 in range(0, x.shape[0], rows):  # in row blocks: fp64 at 4096 x 131072 is 4 GiB a copy
        e = torch.exp(x[r0 : r0 + rows].double() @ w.double().T - shift[r0 : r0 + rows, None].double())
        tiles = torch.nn.functional.pad(e, (0, pad)).view(e.shape[0], tiles_n, WS_TILE)
        exps.append(e.float())
        sums.append(tiles.sum(2).T)
        maxima.append(tiles.amax(2).T)
    return torch.cat(exps), torch.cat(sums, 1), torch.cat(maxima, 1)


def _rel(got, want):
    return ((got.double() - want.double()).abs() / want.double().clamp_min(1e-30)).max().item()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or not gluon_available(),
    reason="needs a Hopper GPU and Triton's Gluon",
)
@pytest.mark.parametrize("n, hidden, n_cols", [(129, 128, 264), (1000, 896, 5000), (300, 2048, 1000),
                                               (4096, 1024, 131072)])  # fmt: skip
def test_against_fp64(n, hidden, n_cols):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n_cols, hidden, device="cuda", generator=g) * (4 / hidden**0.5)).bfloat16()  # logit std 4
    z_max = torch.cat([(x[r : r + 512].float() @ w.float().T).amax(1) for r in range(0, n, 512)])
    shift = torch.full((n + 5,), float("nan"), device="cuda")  # longer than n: the tail is never read
    shift[:n] = z_max - 2.0
    shift[0] = float("inf")  # an ignored row: zeros
    over = n - 1  # in the last (ragged) row tile
    tiles_n = math.ceil(n_cols / WS_TILE)
    stride = n + 11  # the buffer's rows; slots past n must stay untouched
    ref, ref_sums, ref_max = _reference(x, w, shift[:n], n_cols)

    # run 1: one row 200 nats under its logits (its exponentials overflow: redo), with maxima
    shift_over = shift.clone()
    shift_over[over] = z_max[over] - 200.0
    partials = torch.full((3, tiles_n, stride), float("nan"), device="cuda")
    slab = torch.full((n, n_cols), float("nan"), device="cuda", dtype=torch.bfloat16)
    redo = torch.zeros(1, dtype=torch.int32, device="cuda")
    row_scaled_exp_gemm(x, w, slab, shift_over, partials[1].view(-1), stride, redo, partials[2].view(-1))
    assert redo.item() == 1
    assert partials[0].isnan().all() and partials[1:, :, n:].isnan().all()
    sums, maxima = partials[1, :, :n], partials[2, :, :n]
    assert (sums[:, over] > 6.235149080811617e27).any()
    keep = torch.arange(n, device="cuda") != over
    got = slab.float()[keep]
    bad = (got - ref[keep]).abs() > SLAB_TOL * ref[keep] + FLUSHED
    assert not bad.any(), f"{bad.sum().item()} slab elements off; max rel err {_rel(got, ref[keep]):.2e}"
    assert (slab[0] == 0).all() and (sums[:, 0] == 0).all() and (maxima[:, 0] == 0).all()
    assert _rel(sums[:, keep], ref_sums[:, keep]) < PARTIAL_TOL
    # the maxima are the slab's stored (bf16) values' per tile, what the filter's flags compare
    stored = torch.nn.functional.pad(slab.float(), (0, tiles_n * WS_TILE - n_cols)).view(n, tiles_n, WS_TILE)
    assert torch.equal(maxima[:, keep], stored.amax(2).T[:, keep])
    assert _rel(maxima[:, keep], ref_max[:, keep]) < SLAB_TOL

    # run 2: no overflow, no maxima: the same slab and sums elsewhere, bit for bit; the flag left as it was
    slab2 = torch.full_like(slab, float("nan"))
    sums2 = torch.full((tiles_n, stride), float("nan"), device="cuda")
    redo2 = torch.full((1,), 7, dtype=torch.int32, device="cuda")
    row_scaled_exp_gemm(x, w, slab2, shift, sums2.view(-1), stride, redo2)
    assert redo2.item() == 7
    assert torch.equal(slab2[keep], slab[keep]) and torch.equal(sums2[:, :n][:, keep], sums[:, keep])
    assert sums2[:, n:].isnan().all()
    assert ((slab2[over].float() - ref[over]).abs() <= SLAB_TOL * ref[over] + FLUSHED).all()
    assert _rel(sums2[:, over], ref_sums[:, over]) < PARTIAL_TOL
