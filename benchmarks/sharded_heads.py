"""apply_flce under FSDP2 and DeepSpeed ZeRO-3 on one rank, against HF's own loss under the same wrapper.

    python benchmarks/sharded_heads.py OUT_DIR [--steps 50] [--cases fsdp2,fsdp2_bf16,zero3,trainer_zero3]

World size 1 still shards (FSDP2) and partitions (ZeRO-3). For each family (Llama; Gemma-3 with its
final-logit softcap), untied and tied, and each wrapper: an unpatched model (HF's loss on materialised
logits) and a patched copy with the same weights train side by side for ``--steps`` AdamW steps on
one repeated batch; each step's losses must agree within 1%, and the first step's lm_head gradient
is compared too. The untied model is patched before wrapping, the tied one after. ZeRO-3 runs with
``stage3_max_reuse_distance=0`` so the head is released after its forward and must be re-gathered
for its backward (the path that fails when the weight is read outside the head's call).
``trainer_zero3``: the HF Trainer with a DeepSpeed ZeRO-3 config dict, a few steps each way.
Writes ``OUT_DIR/sharded_heads.json`` and prints one PASS/FAIL line per case. Runs on CUDA (nccl),
or on CPU with gloo under ``TRITON_INTERPRET=1`` (tiny shapes) for a local check.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

CASES = ("fsdp2", "fsdp2_bf16", "zero3", "trainer_zero3")
FAMILIES = {"llama": {}, "gemma3_text": {"final_logit_softcapping": 30.0}}
LOSS_RTOL = 0.01  # the bound: per-step loss within 1%
# AdamW; small enough that 50 bf16 steps on one batch do not memorise it (a tiny loss magnifies relative gaps)
LR = 3e-4


def shapes(cuda: bool) -> dict:
    if cuda:
        return dict(vocab=8192, hidden=256, inter=512, layers=2, heads=4, kv=2, head_dim=64, batch=4, seq=256)
    return dict(vocab=96, hidden=32, inter=64, layers=2, heads=4, kv=2, head_dim=8, batch=2, seq=9)


def make_model(family: str, tied: bool, s: dict) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.for_model(
        family,
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        head_dim=s["head_dim"],
        max_position_embeddings=max(64, s["seq"]),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=tied,
        **FAMILIES[family],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.train()
    return model


def make_batch(s: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, s["vocab"], (s["batch"], s["seq"]), generator=g)
    labels = ids.clone()
    labels[0, : s["seq"] // 4] = -100
    return ids.to(device), labels.to(device)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def rel_grad(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------- FSDP2


def fsdp2_pair(model: torch.nn.Module, device: torch.device, tied: bool, bf16: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from flce_policy.integrations.transformers import apply_flce

    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    mp = mp or MixedPrecisionPolicy()

    def wrap(m: torch.nn.Module, patch: bool) -> torch.nn.Module:
        m = copy.deepcopy(m).to(device)
        if patch and not tied:
            apply_flce(m)  # before wrapping
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(m, mesh=mesh, mp_policy=mp)
        if patch and tied:
            apply_flce(m)  # after wrapping
        return m

    ref, pat = wrap(model, False), wrap(model, True)
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (ref, pat)]

    def step(i: int, m: torch.nn.Module, ids, labels) -> tuple[float, torch.Tensor | None]:
        opt = opts[0 if m is ref else 1]
        loss = m(input_ids=ids, labels=labels).loss
        loss.backward()
        grad = m.lm_head.weight.grad.full_tensor().float().clone() if i == 0 else None
        opt.step()
        opt.zero_grad()
        return loss.item(), grad

    return ref, pat, step


# ---------------------------------------------------------------------------------------------- ZeRO-3


def zero3_config(bf16: bool, micro_batch: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,  # partition even tiny parameters
            "stage3_max_reuse_distance": 0,  # release the head after its forward: backward must re-gather it
            "stage3_prefetch_bucket_size": 0,
        },
        "zero_allow_untested_optimizer": True,
        "wall_clock_breakdown": False,
    }


def zero3_pair(model: torch.nn.Module, device: torch.device, tied: bool, bf16: bool, micro_batch: int):
    import deepspeed

    from flce_policy.integrations.transformers import apply_flce

    def wrap(m: torch.nn.Module, patch: bool):
        m = copy.deepcopy(m)
        if patch and not tied:
            apply_flce(m)  # before deepspeed.initialize
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        engine, *_ = deepspeed.initialize(model=m, optimizer=opt, config=zero3_config(bf16, micro_batch))
        if patch and tied:
            apply_flce(engine)  # on the engine, after
        engine.train()
        return engine

    ref, pat = wrap(model, False), wrap(model, True)
    head = pat.module.lm_head.weight
    assert hasattr(head, "ds_id") and head.numel() == 0, "the head is not ZeRO-3-partitioned"

    def step(i: int, engine, ids, labels) -> tuple[float, torch.Tensor | None]:
        from deepspeed.utils import safe_get_full_grad

        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        grad = safe_get_full_grad(engine.module.lm_head.weight).float().clone() if i == 0 else None
        engine.step()
        return loss.item(), grad

    return ref, pat, step


def run_pair(
    case: str, family: str, tied: bool, s: dict, device: torch.device, steps: int, noise_floor: bool = False
) -> dict:
    """HF's loss and flce's under one wrapper, step by step. ``noise_floor``: a third run, HF's own on the
    batch with its sequences reversed (the same loss in exact arithmetic), shows how far HF drifts from
    itself under rounding alone."""
    model = make_model(family, tied, s)
    bf16 = device.type == "cuda" and case in ("fsdp2_bf16", "zero3")
    if case.startswith("fsdp2"):
        make_pair = lambda: fsdp2_pair(model, device, tied, bf16=case == "fsdp2_bf16")  # noqa: E731
    else:
        make_pair = lambda: zero3_pair(model, device, tied, bf16, s["batch"])  # noqa: E731
    ref, pat, step = make_pair()
    # rotations of the batch's sequences: 1 .. batch-1 (at most 3)
    rotated = [(k, *make_pair()[::2]) for k in range(1, min(s["batch"], 4))] if noise_floor else []
    ids, labels = make_batch(s, device)
    ref_losses, pat_losses, t_ref, t_pat = [], [], 0.0, 0.0
    rotated_losses: list[list[float]] = [[] for _ in rotated]
    grad_err = None
    for i in range(steps):
        t0 = time.perf_counter()
        lr_, g_ref = step(i, ref, ids, labels)
        t1 = time.perf_counter()
        lp_, g_pat = step(i, pat, ids, labels)
        t2 = time.perf_counter()
        for losses, (k, engine, engine_step) in zip(rotated_losses, rotated, strict=True):
            losses.append(engine_step(i, engine, ids.roll(k, 0), labels.roll(k, 0))[0])
        if i:
            t_ref, t_pat = t_ref + t1 - t0, t_pat + t2 - t1
        ref_losses.append(lr_)
        pat_losses.append(lp_)
        if i == 0:
            grad_err = rel_grad(g_pat, g_ref)
    worst = max(rel(p, r) for p, r in zip(pat_losses, ref_losses, strict=True))
    floors = [max(rel(q, r) for q, r in zip(losses, ref_losses, strict=True)) for losses in rotated_losses]
    return {
        "max_step_loss_rel_diff": worst,
        "hf_vs_hf_rotated_max_rel_diff": floors or None,
        "lm_head_grad_rel_l2_step0": grad_err,
        "first_last_loss_hf": [ref_losses[0], ref_losses[-1]],
        "first_last_loss_flce": [pat_losses[0], pat_losses[-1]],
        "ms_per_step_hf": 1e3 * t_ref / max(1, steps - 1),
        "ms_per_step_flce": 1e3 * t_pat / max(1, steps - 1),
        "ok": worst <= LOSS_RTOL and ref_losses[-1] < ref_losses[0],
    }


# --------------------------------------------------------------------------------------- HF Trainer


def run_trainer(family: str, tied: bool, s: dict, device: torch.device, steps: int, out: Path) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from flce_policy.integrations.transformers import apply_flce

    ids, labels = make_batch(s, torch.device("cpu"))
    rows = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)] * steps

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    config = zero3_config(device.type == "cuda", s["batch"])
    config.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    config["bf16"] = {"enabled": "auto"}
    losses = []
    for patch in (False, True):
        model = make_model(family, tied, s)
        if patch:
            apply_flce(model)
        args = TrainingArguments(
            output_dir=str(out / "trainer"),
            per_device_train_batch_size=s["batch"],
            max_steps=steps,
            learning_rate=LR,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            bf16=device.type == "cuda",
            deepspeed=config,
            use_cpu=device.type == "cpu",
            lr_scheduler_type="constant",
            dataloader_num_workers=0,
            seed=0,
            data_seed=0,
        )
        spy = Losses()
        Trainer(model=model, args=args, train_dataset=rows, callbacks=[spy]).train()
        losses.append(spy.losses)
    worst = max(rel(p, r) for p, r in zip(losses[1], losses[0], strict=True)) if losses[0] else float("inf")
    return {
        "losses_hf": losses[0],
        "losses_flce": losses[1],
        "max_step_loss_rel_diff": worst,
        "ok": len(losses[0]) == steps and worst <= LOSS_RTOL,
    }


# ---------------------------------------------------------------------------------------------- main


def init_single_rank(cuda: bool) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"
    )
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--trainer-steps", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--noise-floor", action="store_true", help="also run HF on the batch rotated")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    init_single_rank(cuda)
    from flce_policy.engine.probe import device_for_tensor_device

    s = shapes(cuda)
    report = {"device": repr(device_for_tensor_device(device)), "shapes": s, "steps": args.steps, "results": []}
    print("probed per rank:", report["device"], flush=True)
    failures = 0
    for case in args.cases.split(","):
        for family in args.families.split(","):
            for tied in (False, True):
                name = f"{case} {family} {'tied' if tied else 'untied'}"
                t0 = time.perf_counter()
                try:
                    if case == "trainer_zero3":
                        result = run_trainer(family, tied, s, device, args.trainer_steps, args.out)
                    else:
                        result = run_pair(case, family, tied, s, device, args.steps, args.noise_floor)
                except Exception as e:  # a case that cannot run is a FAIL with its traceback, not the end
                    result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                result.update(case=name, seconds=time.perf_counter() - t0)
                report["results"].append(result)
                failures += not result["ok"]
                detail = result.get("error") or (
                    f"max step loss rel diff {result['max_step_loss_rel_diff']:.2e}"
                    + (
                        f", lm_head grad rel L2 {result['lm_head_grad_rel_l2_step0']:.2e}"
                        if result.get("lm_head_grad_rel_l2_step0") is not None
                        else ""
                    )
                    + (
                        "; HF vs HF on the batch rotated by 1, 2, ...: "
                        + ", ".join(f"{f:.2e}" for f in result["hf_vs_hf_rotated_max_rel_diff"])
                        if result.get("hf_vs_hf_rotated_max_rel_diff")
                        else ""
                    )
                )
                print(f"{'PASS' if result['ok'] else 'FAIL'} {name}: {detail} ({result['seconds']:.1f}s)", flush=True)
                (args.out / "sharded_heads.json").write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()
    print(f"{'PASS' if not failures else 'FAIL'} sharded_heads: {failures} failing case(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
