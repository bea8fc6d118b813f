"""GPU (marker ``gpu``): the vocab-parallel path over NCCL with world size 1 equals the unsharded loss.

One process, one GPU: an NCCL group of one rank on 127.0.0.1 runs the whole vocab-parallel path
(agreeing all-gather, per-chunk all-reduces, grad_input all-reduce) with the whole head as its
shard, so its results must match the plain call. Runs on two GPUs are a separate issue.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = 2e-5  # fp32: the merge rounds lse through torch instead of the kernel; errors seen are ~1e-7


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=120)
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def _inputs(bt=4096, h=1024, v=50257, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(bt, h, device="cuda", generator=g)
    w = torch.randn(v, h, device="cuda", generator=g) * (3.0 / h**0.5)
    b = torch.randn(v, device="cuda", generator=g)
    y = torch.randint(0, v, (bt,), device="cuda", generator=g)
    y[::17] = -100
    cw = torch.rand(v, device="cuda", generator=g) + 0.5
    return x, w, b, y, cw


def _run(x, w, b, y, cw, **kw):
    from flce_policy import fused_linear_cross_entropy

    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = fused_linear_cross_entropy(x, w, y, b, class_weight=cw, return_token_accuracy=True, **kw)
    g = torch.Generator(device="cuda").manual_seed(1)
    grad_output = torch.rand(out.loss.shape, device="cuda", generator=g) if out.loss.dim() else None
    out.loss.backward(grad_output)
    return out, x.grad, w.grad, b.grad


def _rel(a, e):
    return ((a.double() - e.double()).norm() / e.double().norm()).item()


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("vocab_chunk", [None, 8192])
def test_world_size_one_equals_unsharded(group, reduction, vocab_chunk):
    from flce_policy.plan.geometry import Geometry
    from flce_policy.plan.problem import Problem

    torch.backends.cuda.matmul.allow_tf32 = False
    x, w, b, y, cw = _inputs()
    options = dict(reduction=reduction, label_smoothing=0.1, softcap=30.0, z_loss_scale=1e-4)
    policy = None
    if vocab_chunk is not None:
        policy = Geometry.for_problem(Problem(*x.shape, w.shape[0], "float32"), 2048, vocab_chunk=vocab_chunk)
    plain = _run(x, w, b, y, cw, policy=policy, **options)
    sharded = _run(x, w, b, y, cw, policy=policy, tp_group=group, **options)
    assert _rel(sharded[0].loss, plain[0].loss) < TOL
    assert sharded[0].token_accuracy.item() == pytest.approx(plain[0].token_accuracy.item(), abs=1e-6)
    for name, got, want in zip(("grad_input", "grad_weight", "grad_bias"), sharded[1:], plain[1:], strict=True):
        assert _rel(got, want) < TOL, name


def test_world_size_one_dtensor_bf16(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from flce_policy import fused_linear_cross_entropy

    x, w, _, y, _ = _inputs(bt=8192, h=2048, v=65536)
    x, w = x.bfloat16(), w.bfloat16()
    mesh = init_device_mesh("cuda", (1,))
    w_dt = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    # the input replicated, as a ColwiseParallel head's call passes it (a plain input beside a
    # Shard(0) weight is refused as an FSDP2 shard: tests/test_vocab_parallel.py)
    xs = distribute_tensor(x.clone(), mesh, [Replicate()]).requires_grad_()
    loss = fused_linear_cross_entropy(xs, w_dt, y)
    loss.backward()
    xp, wp = x.clone().requires_grad_(), w.clone().requires_grad_()
    plain = fused_linear_cross_entropy(xp, wp, y)
    plain.backward()
    assert isinstance(w_dt.grad, DTensor)
    assert abs(loss.item() - plain.item()) < 1e-4 * abs(plain.item())
    assert _rel(xs.grad.full_tensor(), xp.grad) < 5e-3 and _rel(w_dt.grad.to_local(), wp.grad) < 5e-3
