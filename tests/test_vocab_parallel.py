"""Vocab-parallel FLCE over a gloo process group on CPU (Triton interpreter), against the unsharded fp64 reference.

One group of processes per world size (2 and 3 ranks, uneven shards) runs every check in turn and
reports each one's outcome; a test per (world size, check) reads it. The reference materialises
the whole ``[BT, V]`` logits in float64 on each rank from the same full head, and each rank
compares the whole loss, the whole input gradient and its own shard's weight and bias gradients.
"""

from __future__ import annotations

import json
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import _warm_start
import pytest
import torch
import torch.distributed as dist
from test_loss_kernel import FP32_TOL, assert_close, make_inputs, reference
from test_token_scaling_autocast import scaled_reference

from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED
from flce_policy.kernels.driver import observe_chunks
from flce_policy.loss import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.strategies import FixedChunkSize, SlabBudget

pytestmark = pytest.mark.skipif(not KERNELS_INTERPRETED, reason="CPU gloo tests run the kernels under the interpreter")

BT, H, V = 13, 16, 97  # 13 rows in chunks of 8 leave a 5-row tail
#: Uneven shards of V per world size, in group-rank order.
SHARDS = {2: [40, 57], 3: [30, 41, 26]}
WORLD_TIMEOUT_S = 600  # generous: a loaded 2-core machine runs the three ranks several times slower
CHUNKS = FixedChunkSize(8)


# --------------------------------------------------------------------------- the checks (run on every rank)


def _shard_range(rank: int, world: int) -> tuple[int, int]:
    sizes = SHARDS[world]
    return sum(sizes[:rank]), sum(sizes[: rank + 1])


def _compare(rank, world, input_kw, options, *, group=None, policy=CHUNKS, token_scaling=False, grad_output=None):
    """One call on this rank's shard vs the fp64 reference: loss, whole grad_input, the shard's grad_weight/bias."""
    inputs = make_inputs(BT, H, V, **input_kw)
    start, stop = _shard_range(rank, world)
    x = inputs["x"].clone().requires_grad_()
    w = inputs["w"][start:stop].clone().requires_grad_()
    b = inputs["b"][start:stop].clone().requires_grad_() if "b" in inputs else None
    cw = inputs["cw"][start:stop] if "cw" in inputs else None
    loss = fused_linear_cross_entropy(
        x, w, inputs["y"], b, class_weight=cw, policy=policy, tp_group=group or dist.group.WORLD,
        use_token_scaling=token_scaling, **options,
    )  # fmt: skip
    xr, wr = inputs["x"].double().requires_grad_(), inputs["w"].double().requires_grad_()
    br = inputs["b"].double().requires_grad_() if "b" in inputs else None
    if token_scaling:
        ref = scaled_reference(xr, wr, inputs["y"], br, cw=inputs.get("cw"), **options)
    else:
        ref = reference(xr, wr, inputs["y"], br, class_weight=inputs.get("cw"), **options)[0]
    assert_close(loss, ref, FP32_TOL, "loss")
    if grad_output is None and options.get("reduction") == "none":
        grad_output = torch.randn(loss.shape, generator=torch.Generator().manual_seed(3))
    leaves, ref_leaves = [x, w] + ([b] if b is not None else []), [xr, wr] + ([br] if br is not None else [])
    got = torch.autograd.grad(loss, leaves, grad_outputs=grad_output)
    want = torch.autograd.grad(ref, ref_leaves, grad_outputs=None if grad_output is None else grad_output.double())
    assert_close(got[0], want[0], FP32_TOL, "grad_input (whole)")
    assert_close(got[1], want[1][start:stop], FP32_TOL, "grad_weight (shard)")
    if b is not None:
        assert_close(got[2], want[2][start:stop], FP32_TOL, "grad_bias (shard)")


# (make_inputs kwargs, loss options): every option, alone and together
OPTION_CASES = {
    "plain": ({}, {}),
    "bias": ({"bias": True}, {}),
    "ignore_default": ({"n_ignored": 4}, {}),
    "ignore_valid_class_7": ({"n_ignored": 4, "ignore_index": 7}, {"ignore_index": 7}),
    "label_smoothing": ({}, {"label_smoothing": 0.1}),
    "class_weight": ({"class_weight": True, "n_ignored": 3}, {}),
    "smoothing_class_weight": ({"class_weight": True, "n_ignored": 3}, {"label_smoothing": 0.2}),
    "softcap": ({}, {"softcap": 4.0}),
    "z_loss": ({}, {"z_loss_scale": 0.01}),
    "everything": (
        {"bias": True, "class_weight": True, "n_ignored": 3, "ignore_index": -1},
        {"ignore_index": -1, "label_smoothing": 0.2, "softcap": 6.0, "z_loss_scale": 0.01},
    ),
}


def _option_check(input_kw, options, reduction):
    return lambda rank, world: _compare(rank, world, input_kw, {**options, "reduction": reduction})


def _token_scaling(reduction):
    options = {"reduction": reduction, "softcap": 5.0, "label_smoothing": 0.1, "z_loss_scale": 1e-3}
    return lambda rank, world: _compare(rank, world, {"bias": True, "n_ignored": 3}, options, token_scaling=True)


def _extras_and_ties(rank, world):
    """z-loss, token accuracy and predicted tokens are global; an argmax tie across shards goes to the lowest id."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-3, 4, (BT, H), generator=g).float()  # small integers: exact fp32 logits, exact ties
    w = torch.randint(-3, 4, (V, H), generator=g).float()
    w[-1] = w[2] = 4.0 * x[0]  # class 2 (rank 0) and class V-1 (last rank) tie at the top of row 0
    y = (x.double() @ w.double().T).argmax(-1)
    y[1::3] = torch.randint(0, V, (len(y[1::3]),), generator=g)
    y[4] = -100
    start, stop = _shard_range(rank, world)
    out = fused_linear_cross_entropy(
        x, w[start:stop], y, policy=CHUNKS, tp_group=dist.group.WORLD, z_loss_scale=1e-4,
        return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True,
    )  # fmt: skip
    logits = x.double() @ w.double().T
    valid = y != -100
    predicted = torch.where(valid, logits.argmax(-1), -1)
    assert predicted[0] == 2
    assert torch.equal(out.predicted_tokens, predicted), (out.predicted_tokens, predicted)
    accuracy = ((predicted == y) & valid).sum() / valid.sum()
    assert 0 < accuracy < 1 and abs(out.token_accuracy.item() - accuracy.item()) < 1e-6
    z_loss = (1e-4 * torch.logsumexp(logits, -1)[valid] ** 2).mean()
    assert_close(out.z_loss, z_loss, FP32_TOL, "z_loss")


def _vocab_tiled(rank, world):
    """Vocab tiles inside each shard (a geometry per rank), through the same merge."""
    start, stop = _shard_range(rank, world)
    problem = Problem(BT, H, stop - start, "float32", tp_size=world)
    geometry = Geometry.for_problem(problem, 8, vocab_chunk=16)
    everything = OPTION_CASES["everything"]
    for reduction in ("mean", "none"):
        _compare(rank, world, everything[0], {**everything[1], "reduction": reduction}, policy=geometry)


def _chunk_sizes_agree(rank, world):
    """A slab budget gives the narrower shards more rows; every rank runs the group's smallest chunk."""
    budget = SlabBudget(640)  # fp32 rows of 40 / 57 columns: 4 / 2 rows (2 ranks); 30 / 41 / 26: 4 / 2 / 4 (3 ranks)
    with observe_chunks() as events:
        _compare(rank, world, {"bias": True}, {}, policy=budget)
    gathered = [None] * world
    dist.all_gather_object(gathered, [e.rows for e in events])
    assert all(rows == gathered[0] for rows in gathered), gathered
    assert len(gathered[0]) > 1  # several chunks, so the agreement mattered


def _partial_grad_input(rank, world):
    """tp_grad_input='partial': each rank's share; their sum is the whole input gradient."""
    inputs = make_inputs(BT, H, V, n_ignored=2)
    start, stop = _shard_range(rank, world)
    x = inputs["x"].clone().requires_grad_()
    loss = fused_linear_cross_entropy(
        x, inputs["w"][start:stop], inputs["y"], policy=CHUNKS, tp_group=dist.group.WORLD, tp_grad_input="partial"
    )
    (share,) = torch.autograd.grad(loss, x)
    xr = inputs["x"].double().requires_grad_()
    (whole,) = torch.autograd.grad(reference(xr, inputs["w"].double(), inputs["y"])[0], xr)
    assert rel_l2(share, whole) > 0.05  # a share, not the whole
    summed = share.clone()
    dist.all_reduce(summed)
    assert_close(summed, whole, FP32_TOL, "sum of the shares")


def _autocast(rank, world):
    """bf16 autocast over an fp32 master shard: what the unsharded autocast call gives, in the caller's dtypes."""
    inputs = make_inputs(BT, H, V, bias=True, n_ignored=2)
    start, stop = _shard_range(rank, world)
    results = []
    for w_part, b_part, tp in ((start, stop, dist.group.WORLD), (0, V, None)):
        x = inputs["x"].clone().requires_grad_()
        w = inputs["w"][w_part:b_part].clone().requires_grad_()
        b = inputs["b"][w_part:b_part].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fused_linear_cross_entropy(x, w, inputs["y"], b, policy=CHUNKS, tp_group=tp, z_loss_scale=1e-3)
        results.append((loss, *torch.autograd.grad(loss, (x, w, b))))
    (loss, gx, gw, gb), (ref, rx, rw, rb) = results
    assert gw.dtype == torch.float32 and gx.dtype == torch.float32
    assert_close(loss, ref, 1e-5, "loss")
    assert_close(gx, rx, 1e-2, "grad_input")  # bf16 logits rounded alike; grad_input summed in another order
    assert_close(gw, rw[start:stop], 1e-5, "grad_weight (shard)")
    assert_close(gb, rb[start:stop], 1e-5, "grad_bias (shard)")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _dtensor_colwise(rank, world):
    """A head made tensor-parallel by parallelize_module(ColwiseParallel): Shard(0) DTensor weight and bias."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    inputs = make_inputs(BT, H, V, bias=True, n_ignored=3)
    mesh = init_device_mesh("cpu", (world,))
    head = torch.nn.Linear(H, V)
    with torch.no_grad():
        head.weight.copy_(inputs["w"])
        head.bias.copy_(inputs["b"])
    parallelize_module(head, mesh, ColwiseParallel())
    assert isinstance(head.weight, DTensor) and head.weight.placements == (Shard(0),)
    x = inputs["x"].clone().requires_grad_()
    # replicated, as ColwiseParallel hands its input to the head (a plain input would be refused as an FSDP2 shard)
    x_replicated = DTensor.from_local(x, mesh, [Replicate()])
    loss = fused_linear_cross_entropy(
        x_replicated, head.weight, inputs["y"], head.bias, policy=CHUNKS, label_smoothing=0.1
    )
    loss.backward()
    xr, wr, br = (inputs[k].double().requires_grad_() for k in ("x", "w", "b"))
    ref = reference(xr, wr, inputs["y"], br, label_smoothing=0.1)[0]
    ref.backward()
    assert_close(loss, ref, FP32_TOL, "loss")
    assert_close(x.grad, xr.grad, FP32_TOL, "grad_input (whole)")
    for name, param, want in (("weight", head.weight, wr.grad), ("bias", head.bias, br.grad)):
        grad = param.grad
        assert isinstance(grad, DTensor) and grad.placements == (Shard(0),), (name, type(grad))
        assert_close(grad.full_tensor(), want, FP32_TOL, f"grad_{name} (DTensor)")


def _group_of_one(rank, world):
    """Singleton groups: the whole head on one rank is the unsharded loss; a shard alone is an error."""
    singletons = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    inputs = make_inputs(BT, H, V, bias=True, n_ignored=2)
    x, w, b = (inputs[k].clone().requires_grad_() for k in ("x", "w", "b"))
    loss = fused_linear_cross_entropy(x, w, inputs["y"], b, policy=CHUNKS, tp_group=singletons[rank])
    xr, wr, br = (inputs[k].double().requires_grad_() for k in ("x", "w", "b"))
    ref = reference(xr, wr, inputs["y"], br)[0]
    assert_close(loss, ref, FP32_TOL, "loss")
    for got, want in zip(torch.autograd.grad(loss, (x, w, b)), torch.autograd.grad(ref, (xr, wr, br)), strict=True):
        assert_close(got, want, FP32_TOL, "grad")
    start, stop = _shard_range(rank, world)
    y = inputs["y"].clone()
    y[0] = stop  # outside this rank's shard, and its group holds no other
    _expect_error(ValueError, "1 shard", fused_linear_cross_entropy, x, w[start:stop], y, tp_group=singletons[rank])


def _expect_error(kind, text, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except kind as err:
        assert text in str(err), f"{kind.__name__} without {text!r}: {err}"
        return
    raise AssertionError(f"no {kind.__name__} ({text!r})")


def _bad_input(rank, world):
    """Clear errors, raised on every rank alike (no rank is left waiting in a collective)."""
    inputs = make_inputs(BT, H, V)
    start, stop = _shard_range(rank, world)
    x, y, w = inputs["x"], inputs["y"], inputs["w"][start:stop]

    def flce(x, w, y, **kw):
        return fused_linear_cross_entropy(x, w, y, **{"tp_group": dist.group.WORLD, **kw})

    # shards that do not cover the targets: the last rank holds one class fewer than the target range
    y_top = y.clone()
    y_top[0] = V - 1
    _expect_error(ValueError, "shard(s) hold", flce, x, w[: -1 if rank == world - 1 else None], y_top)
    # ranks that disagree: options, targets, rows
    _expect_error(ValueError, "disagree on label_smoothing", flce, x, w, y, label_smoothing=0.1 * (rank == 1))
    y_other = y.clone()
    y_other[3] += rank == 1
    _expect_error(ValueError, "disagree on targets", flce, x, w, y_other)
    rows = 5 if rank == 0 else BT
    _expect_error(ValueError, "disagree on tokens", flce, x[:rows], w, y[:rows])
    # an empty shard, a bad tp_grad_input, a group that is not a group
    _expect_error(ValueError, "empty vocab shard", flce, x, w[:0], y)
    _expect_error(ValueError, "tp_grad_input", flce, x, w, y, tp_grad_input="sum")
    _expect_error(TypeError, "ProcessGroup", flce, x, w, y, tp_group="tp")
    # empty input still agrees, and is 0
    assert flce(x[:0], w, y[:0]).item() == 0.0
    # a DTensor weight: replicated instead of sharded, or a group other than its mesh's
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    replicated = distribute_tensor(inputs["w"], mesh, [Replicate()])
    # with a plain input a DTensor weight is refused as a shard (FSDP2's, say), naming its placement
    _expect_error(TypeError, "placements (Replicate(),)", fused_linear_cross_entropy, x, replicated, y)
    # with a replicated DTensor input it is taken as tensor parallel, and must be sharded on dim 0
    x_replicated = distribute_tensor(x.detach(), mesh, [Replicate()])
    _expect_error(ValueError, "sharded on dim 0", fused_linear_cross_entropy, x_replicated, replicated, y)
    singleton = [dist.new_group([r]) for r in range(world)][rank]
    sharded = distribute_tensor(inputs["w"], mesh, [Shard(0)])
    _expect_error(ValueError, "mesh", flce, x, sharded, y, tp_group=singleton)


def _hf_colwise_head(rank, world):
    """apply_flce on a tiny HF Llama whose lm_head is ColwiseParallel: HF's loss and gradients (head shard)."""
    import copy

    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from flce_policy.integrations.transformers import apply_flce

    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).train()
    model = copy.deepcopy(ref)
    parallelize_module(model, init_device_mesh("cpu", (world,)), {"lm_head": ColwiseParallel()})
    apply_flce(model, policy=CHUNKS)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 7), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    got, expected = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert got.logits is None
    assert_close(got.loss, expected.loss, FP32_TOL, "loss")
    got.loss.backward()
    expected.loss.backward()
    named = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        grad = named[name].grad
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        assert_close(grad, p.grad, FP32_TOL, f"grad {name}")


def _grad_weight_filter(rank, world):
    """The filter on a shard: tiles of the shard's own columns; loss and grad_input bit for bit the unfiltered
    call's, the shard's grad_weight/bias the fp64 reference's over the kept tiles (the shards past the targets'
    classes skip all or part of theirs); with a rescue, the rescued tiles (the hash over the shard's own column
    blocks) counted N times."""
    from test_weight_grad_filter import _tile_mask, unflagged_after_a_dense_chunk
    from test_weight_grad_filter_rescue import rescue_scale

    eps = 0.01
    inputs = make_inputs(BT, H, V)
    x_full, w_full = inputs["x"], 0.3 * inputs["w"]
    b_full = torch.linspace(3.0, -9.0, V)
    y = torch.randint(0, 30, (BT,), generator=torch.Generator().manual_seed(9))  # every target in the first shard
    start, stop = _shard_range(rank, world)
    results = []
    for filter_eps, rescue in ((None, None), (eps, None), (eps, 2)):
        x = x_full.clone().requires_grad_()
        w = w_full[start:stop].clone().requires_grad_()
        b = b_full[start:stop].clone().requires_grad_()
        loss = fused_linear_cross_entropy(
            x, w, y, b, policy=CHUNKS, tp_group=dist.group.WORLD, grad_weight_filter=filter_eps,
            grad_weight_filter_rescue=rescue,
        )  # fmt: skip
        results.append((loss.detach(), *torch.autograd.grad(loss, (x, w, b))))
    (dense_loss, dense_gx, _, _), (loss, gx, gw, gb), (rescued_loss, rescued_gx, rescued_gw, rescued_gb) = results
    assert torch.equal(loss, dense_loss) and torch.equal(gx, dense_gx)
    assert torch.equal(rescued_loss, dense_loss) and torch.equal(rescued_gx, dense_gx)
    logits = (x_full.double() @ w_full.double().T + b_full.double()).requires_grad_()
    (grad,) = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, y), logits)
    p = logits.detach().softmax(-1)
    onehot = torch.nn.functional.one_hot(y, V).double()
    keep = unflagged_after_a_dense_chunk((((p - onehot).abs() >= eps) | (onehot > 0))[:, start:stop], CHUNKS.chunk_size)
    mask = _tile_mask(keep, CHUNKS.chunk_size, stop - start)
    shard_grad = grad[:, start:stop] * mask
    assert_close(gw, shard_grad.T @ x_full.double(), FP32_TOL, "grad_weight (shard, filtered)")
    assert_close(gb, shard_grad.sum(0), FP32_TOL, "grad_bias (shard, filtered)")
    scale = rescue_scale(
        keep, (p - onehot).abs()[:, start:stop], x_full, chunk=CHUNKS.chunk_size,
        vocab_chunk=stop - start, rescue=2, eps=eps,
    )  # fmt: skip
    rescued_grad = grad[:, start:stop] * scale
    assert_close(rescued_gw, rescued_grad.T @ x_full.double(), FP32_TOL, "grad_weight (shard, rescued)")
    assert_close(rescued_gb, rescued_grad.sum(0), FP32_TOL, "grad_bias (shard, rescued)")


def _grad_weight_filter_rest(rank, world):
    """A policy's rest on a shard: after a call whose flags went dense (flat logits: every tile kept), the shard
    problem's next calls run dense without flags (grad_weight the unfiltered call's bit for bit, every tile
    counted), then one flags again (the filtered call's grad_weight, bit for bit)."""
    from flce_policy import FLCEPolicy
    from flce_policy.kernels.weight_grad_filter import observe_tiles
    from flce_policy.plan import weight_filter

    eps, rest_calls = 0.01, 2
    inputs = make_inputs(BT, H, V)
    y = torch.randint(0, 30, (BT,), generator=torch.Generator().manual_seed(9))
    start, stop = _shard_range(rank, world)
    peaked = (inputs["x"], 0.3 * inputs["w"][start:stop], torch.linspace(3.0, -9.0, V)[start:stop])
    flat = (inputs["x"], torch.zeros(stop - start, H), torch.zeros(stop - start))  # p = 1/97 >= eps everywhere

    def call(leaves, policy, filter_eps):
        x, w, b = (t.clone().requires_grad_() for t in leaves)
        with observe_tiles() as tiles:  # the driver computes the gradients in the forward
            loss = fused_linear_cross_entropy(
                x, w, y, b, policy=policy, tp_group=dist.group.WORLD, grad_weight_filter=filter_eps
            )
        grads = torch.autograd.grad(loss, (x, w, b))
        return (loss.detach(), *grads), (sum(int(t.kept) for t in tiles), sum(t.total for t in tiles))

    # every rank makes the same calls (their collectives pair up); the checks come after the last one
    dense, _ = call(peaked, CHUNKS, None)
    filtered, filtered_tiles = call(peaked, CHUNKS, eps)  # a strategy remembers nothing: every call flags
    saved = weight_filter.FILTER_REST_CALLS
    weight_filter.FILTER_REST_CALLS = rest_calls
    try:
        policy = FLCEPolicy(default=CHUNKS)
        _, flat_tiles = call(flat, policy, eps)  # flags that went dense: the rest starts
        rested = [call(peaked, policy, eps) for _ in range(rest_calls)]
        after, after_tiles = call(peaked, policy, eps)
    finally:
        weight_filter.FILTER_REST_CALLS = saved
    kept, total = filtered_tiles
    assert kept < total or rank == 0, f"rank {rank}: {kept} of {total} tiles kept, the check would not tell"
    assert flat_tiles[0] == flat_tiles[1] > 0, f"flat logits: {flat_tiles} (kept, total)"
    for results, (kept, total) in rested:
        assert kept == total > 0, f"a rested call skipped {total - kept} of {total} tiles"
        assert all(torch.equal(a, b) for a, b in zip(results, dense, strict=True)), (
            "a rested call differs from the dense one"
        )
    assert after_tiles == filtered_tiles, f"after the rest {after_tiles}, a strategy's call {filtered_tiles}"
    assert all(torch.equal(a, b) for a, b in zip(after, filtered, strict=True)), (
        "the call after the rest is not filtered"
    )


CHECKS: dict[str, Callable[[int, int], None]] = {
    "hf_colwise_head": _hf_colwise_head,
    **{
        f"{name}-{reduction}": _option_check(input_kw, options, reduction)
        for name, (input_kw, options) in OPTION_CASES.items()
        for reduction in ("mean", "sum", "none")
    },
    "token_scaling-mean": _token_scaling("mean"),
    "token_scaling-none": _token_scaling("none"),
    "extras_and_ties": _extras_and_ties,
    "vocab_tiled": _vocab_tiled,
    "chunk_sizes_agree": _chunk_sizes_agree,
    "partial_grad_input": _partial_grad_input,
    "autocast": _autocast,
    "dtensor_colwise": _dtensor_colwise,
    "group_of_one": _group_of_one,
    "bad_input": _bad_input,
    "grad_weight_filter": _grad_weight_filter,
    "grad_weight_filter_rest": _grad_weight_filter_rest,
}


#: Three ranks (a middle shard with offsets on both sides) run the combined cases only, to keep CI short.
THREE_RANK_CHECKS = (
    "everything-mean", "everything-sum", "everything-none", "smoothing_class_weight-mean", "token_scaling-none",
    "extras_and_ties", "vocab_tiled", "chunk_sizes_agree", "dtensor_colwise", "bad_input", "grad_weight_filter",
)  # fmt: skip
CHECKS_BY_WORLD = {2: tuple(CHECKS), 3: THREE_RANK_CHECKS}


# --------------------------------------------------------------------------- the process group


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import _interpreter_patch  # a spawned process: tests/conftest.py did not run here

    _interpreter_patch.for_tests()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=180)
    )
    torch.manual_seed(0)
    results: dict[str, str | None] = {}
    try:
        for name in CHECKS_BY_WORLD[world]:
            try:
                CHECKS[name](rank, world)
                results[name] = None
            except Exception:  # noqa: BLE001 - reported to the test of that check
                results[name] = traceback.format_exc()
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_RESULTS: dict[int, list[dict[str, str | None]]] = {}


def _results(world: int, tmp_path_factory) -> list[dict[str, str | None]]:
    """Run every check once on a group of ``world`` processes; each rank's outcome per check."""
    if world not in _RESULTS:
        out_dir = tmp_path_factory.mktemp(f"vocab_parallel_{world}")
        context = _warm_start.context()  # spawn's usage, forked from a process that imported torch already
        port = _free_port()
        procs = [context.Process(target=_worker, args=(r, world, port, str(out_dir))) for r in range(world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + WORLD_TIMEOUT_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        _RESULTS[world] = [
            json.loads(path.read_text()) if (path := Path(out_dir, f"rank{r}.json")).exists() else {}
            for r in range(world)
        ]
    return _RESULTS[world]


#: One pytest-xdist worker per world size: its tests read the outcomes of one launch (``_results``).
@pytest.mark.parametrize(
    ("world", "check"),
    [
        pytest.param(world, check, marks=pytest.mark.xdist_group(f"vocab_parallel_{world}"))
        for world, checks in CHECKS_BY_WORLD.items()
        for check in checks
    ],
)
def test_vocab_parallel(world, check, tmp_path_factory):
    for rank, results in enumerate(_results(world, tmp_path_factory)):
        assert check in results, f"rank {rank} of {world} never reported {check} (crashed or timed out)"
        assert results[check] is None, f"rank {rank} of {world}:\n{results[check]}"


def test_needs_an_initialised_group():
    inputs = make_inputs(BT, H, V)
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        fused_linear_cross_entropy(inputs["x"], inputs["w"], inputs["y"], tp_group=object())


def test_tp_grad_input_needs_a_vocab_parallel_head():
    inputs = make_inputs(BT, H, V)
    with pytest.raises(ValueError, match="vocab-parallel head only"):
        fused_linear_cross_entropy(inputs["x"], inputs["w"], inputs["y"], tp_grad_input="partial")
    # the module takes the tensor-parallel keywords and hands them to the call
    module = FusedLinearCrossEntropyLoss(tp_group=None, tp_grad_input="partial")
    with pytest.raises(ValueError, match="vocab-parallel head only"):
        module(inputs["x"], inputs["w"], inputs["y"])
