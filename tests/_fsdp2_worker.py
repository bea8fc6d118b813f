"""One rank of tests/test_fsdp2.py: FSDP2 (``fully_shard``, gloo, CPU) on tiny HF Llamas, apply_flce vs HF.

Run as ``python tests/_fsdp2_worker.py RANK WORLD PORT OUT.json`` (the test starts both ranks). Every
variant builds the same model on each rank (same seed), shards an unpatched copy (HF's own loss) and
a patched copy the same way, feeds each rank its own batch, and compares the loss and every
parameter's gradient (``full_tensor()`` of the reduced DTensor gradients), then takes an SGD step
and compares a second step. The checks go to OUT.json; the test asserts on them.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before flce_policy.kernels is imported

import _interpreter_patch  # noqa: E402

_interpreter_patch.for_tests()  # as under pytest (tests/conftest.py)

import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from test_hf_integration import batch, rel_err, tiny_config  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from flce_policy import fused_linear_cross_entropy  # noqa: E402
from flce_policy.integrations.transformers import apply_flce  # noqa: E402

FP32_TOL = 2e-5  # as tests/test_hf_integration.py: fp32 kernel vs fp32 eager, max-norm relative


@dataclasses.dataclass(frozen=True)
class Variant:
    tied: bool = False
    patch_first: bool = True  # apply_flce then fully_shard, or the other order
    reshard_after_forward: bool = True
    bf16: bool = False  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    head_group: bool = False  # lm_head in its own FSDP group (untied only)

    @property
    def name(self) -> str:
        return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


VARIANTS = [
    Variant(tied=tied, patch_first=first, reshard_after_forward=reshard)
    for tied in (False, True)
    for first in (True, False)
    for reshard in (True, False)
] + [
    Variant(head_group=True),
    Variant(head_group=True, patch_first=False, reshard_after_forward=False),
    Variant(bf16=True),
    Variant(bf16=True, tied=True, patch_first=False),
]


def shard(model: torch.nn.Module, mesh, v: Variant) -> None:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if v.bf16 else None
    mp = mp or MixedPrecisionPolicy()
    kwargs = dict(mesh=mesh, reshard_after_forward=v.reshard_after_forward, mp_policy=mp)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    if v.head_group:
        fully_shard(model.lm_head, **kwargs)
    fully_shard(model, **kwargs)


def build(v: Variant, mesh, *, patched: bool, fsdp_bf16: bool | None = None):
    torch.manual_seed(0)  # the same weights on every rank and in every copy
    model = (
        __import__("transformers")
        .AutoModelForCausalLM.from_config(tiny_config("llama", tie_word_embeddings=v.tied))
        .float()
    )
    model.train()
    v = v if fsdp_bf16 is None else dataclasses.replace(v, bf16=fsdp_bf16)
    if patched and v.patch_first:
        apply_flce(model)
    shard(model, mesh, v)
    if patched and not v.patch_first:
        apply_flce(model)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def step(model, ids, labels):
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: full(p.grad).detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def run_variant(v: Variant, mesh, rank: int, checks: list) -> None:
    def check(what: str, value: float, tol: float) -> None:
        checks.append({"variant": v.name, "check": what, "value": value, "tol": tol, "ok": bool(value <= tol)})

    ref, patched = build(v, mesh, patched=False), build(v, mesh, patched=True)
    truth = build(v, mesh, patched=False, fsdp_bf16=False) if v.bf16 else None  # fp32 HF, for bf16 bounds
    check("root class replaced by fully_shard", 0.0 if type(patched).__name__.startswith("FSDP") else 1.0, 0.0)
    kept = "_flce_patch" in patched.__dict__ and "forward" in patched.__dict__
    check("patched forward kept", 0.0 if kept else 1.0, 0.0)
    head = patched.get_output_embeddings()
    check("head forward kept", 0.0 if "_flce_head" in head.__dict__ and "forward" in head.__dict__ else 1.0, 0.0)
    if v.tied:
        check("tied after sharding", 0.0 if patched.lm_head.weight is patched.model.embed_tokens.weight else 1.0, 0.0)
    opt_ref, opt_patched = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, patched))
    opt_truth = torch.optim.SGD(truth.parameters(), lr=0.5) if truth is not None else None
    for it in range(2):  # the second step runs on the weights both optimizers updated
        ids, labels = batch(seed=10 * rank + it)  # each rank its own batch
        expected, grads_ref = step(ref, ids, labels)
        got, grads = step(patched, ids, labels)
        check(f"step {it}: no logits", 0.0 if got.logits is None else 1.0, 0.0)
        check(f"step {it}: gradients for the same parameters", float(set(grads) != set(grads_ref)), 0.0)
        if truth is None:
            check(f"step {it}: loss", rel_err(got.loss, expected.loss), FP32_TOL)
            for name, g in grads_ref.items():
                check(f"step {it}: grad {name}", rel_err(grads.get(name, torch.zeros_like(g)), g), FP32_TOL)
        else:
            # bf16 compute on both sides: ours must be as close to the fp32 truth as HF's bf16 path is
            exact, grads_truth = step(truth, ids, labels)
            hf_err = rel_err(expected.loss, exact.loss)
            bound = 2 * hf_err + 4e-3
            check(f"step {it}: bf16 loss vs fp32 (HF bf16 {hf_err:.2e})", rel_err(got.loss, exact.loss), bound)
            for name, g in grads_truth.items():
                hf_err = rel_err(grads_ref[name], g)
                check(
                    f"step {it}: bf16 grad {name} vs fp32 (HF bf16 {hf_err:.2e})",
                    rel_err(grads[name], g),
                    2 * hf_err + 1e-2,
                )
            opt_truth.step()
            opt_truth.zero_grad()
        for opt in (opt_ref, opt_patched):
            opt.step()
            opt.zero_grad()

    # The sharded head handed to the loss directly, outside any forward: flce-policy's error.
    weight = patched.lm_head.weight
    hidden = torch.randn(4, weight.shape[1], dtype=torch.bfloat16 if v.bf16 else torch.float32)
    try:
        fused_linear_cross_entropy(hidden, weight, torch.zeros(4, dtype=torch.long))
        check("sharded weight raises", 1.0, 0.0)
    except TypeError as e:
        message = str(e)
        named = "DTensor" in message and "Shard(dim=0)" in message and "apply_flce" in message and "tp_group" in message
        check(f"sharded weight raises a clear TypeError: {message[:80]}", 0.0 if named else 1.0, 0.0)


def main() -> None:
    rank, world, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    mesh = init_device_mesh("cpu", (world,))
    checks: list = []
    errors: list = []
    names = [v.name for v in VARIANTS]
    for v in VARIANTS:
        try:
            run_variant(v, mesh, rank, checks)
        except Exception:
            errors.append({"variant": v.name, "traceback": traceback.format_exc()})
            break  # the ranks may be out of step now: stop rather than hang in a collective
    with open(out_path, "w") as f:
        json.dump({"rank": rank, "variants": names, "checks": checks, "errors": errors}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
