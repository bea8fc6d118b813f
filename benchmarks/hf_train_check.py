"""Train tiny HF models for N AdamW steps twice — HF's own loss and apply_flce — and compare every step's loss.

    python -m flce_policy.benchmarks.hf_train_check --out DIR [--steps 50]

A tiny Llama and a tiny Gemma-3 (final_logit_softcapping 30), on one repeated batch, from the same
initial weights: bf16 weights, and fp32 master weights under bf16 autocast. PASS when every
step's loss is within 1% of HF's (relative). Both are also compared with HF's path on fp32 weights
without autocast (TF32 off), the trajectory bf16 rounding departs from: a difference to HF that
comes from HF's own bf16 roundings shows as flce being the closer of the two to it. Gemma's softcap
is rounded as HF rounds it (apply_flce's default ``softcap_rounding="eager"``); flce with an fp32
softcap, and HF with one, are run beside it as a diagnostic. HF runs on the same batch with its sequences rotated
(the same loss in exact arithmetic) measure how far HF's path drifts from itself under rounding
alone: the floor for the per-step comparison. Writes hf_train_check.json in DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

CASES = {
    "llama": dict(vocab_size=32000),
    "gemma3_text": dict(vocab_size=32000, final_logit_softcapping=30.0, sliding_window=64),
}
TOLERANCE = 0.01


#: the models' sizes but their vocabulary (CASES)
SIZES = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
)


def tiny(model_type: str, dtype: torch.dtype, device: str = "cuda", **sizes):
    """The tiny model of ``model_type`` from seed 0; ``sizes`` replace config fields (the CPU smoke test's)."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **{**SIZES, **CASES[model_type], **sizes})
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).train()


def train(model, ids, labels, steps: int, autocast: bool) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def with_fp32_softcap(model):
    """HF's path with the final softcap applied to fp32 logits (as flce does) instead of bf16 ones: a diagnostic."""
    cap = model.config.final_logit_softcapping
    model.config.final_logit_softcapping = None  # the family's forward then leaves the logits alone
    head_forward = model.lm_head.forward

    def forward(hidden_states):
        return cap * torch.tanh(head_forward(hidden_states).float() / cap)

    model.lm_head.forward = forward
    return model


def _worst(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def compare(model_type: str, ids: torch.Tensor, labels: torch.Tensor, steps: int, build: Callable) -> list[dict]:
    """HF's loss and apply_flce's, trained side by side from ``build(dtype)``'s model, for bf16 weights and an fp32
    master under autocast; one result (and one PASS/FAIL line printed) per weights."""
    from flce_policy.integrations.transformers import apply_flce

    results = []
    softcapped = CASES[model_type].get("final_logit_softcapping")
    fp32 = train(build(torch.float32), ids, labels, steps, False)
    for weights, dtype, autocast in (
        ("bf16", torch.bfloat16, False),
        ("fp32 master + autocast", torch.float32, True),
    ):
        hf = train(build(dtype), ids, labels, steps, autocast)
        ours = train(apply_flce(build(dtype)), ids, labels, steps, autocast)
        # HF's own path again with the batch's sequences rotated: the same loss in exact arithmetic,
        # other rounding (reduction orders). How far HF drifts from itself is the floor below which a
        # per-step difference says nothing about the loss being computed right.
        hf_rotated = [
            train(build(dtype), ids.roll(k, 0), labels.roll(k, 0), steps, autocast) for k in range(1, ids.shape[0])
        ]
        floors = [_worst(r, hf) for r in hf_rotated]
        worst = _worst(ours, hf)
        passed = worst <= TOLERANCE
        softcap_diag = {}
        if softcapped:
            # apply_flce rounds the softcap as HF does (softcap_rounding="eager"); how far the fp32
            # softcap moves each path: flce with softcap_rounding="fp32", HF with an fp32 softcap
            flce32 = train(apply_flce(build(dtype), softcap_rounding="fp32"), ids, labels, steps, autocast)
            hf32 = train(with_fp32_softcap(build(dtype)), ids, labels, steps, autocast)
            softcap_diag = {
                "flce_fp32_softcap": flce32,
                "flce_fp32_softcap_worst_vs_hf": _worst(flce32, hf),
                "flce_fp32_softcap_worst_vs_fp32": _worst(flce32, fp32),
                "hf_fp32_softcap": hf32,
                "flce_fp32_softcap_worst_vs_hf_fp32_softcap": _worst(flce32, hf32),
                "hf_worst_vs_hf_fp32_softcap": _worst(hf, hf32),
            }
            print(
                f"  diagnostic {model_type} {weights}: flce with softcap_rounding='fp32' vs HF "
                f"{_worst(flce32, hf):.2e} (vs the fp32 run {_worst(flce32, fp32):.2e}); HF with an fp32 "
                f"softcap vs that flce {_worst(flce32, hf32):.2e}, vs HF's own {_worst(hf, hf32):.2e}",
                flush=True,
            )
        results.append(
            dict(
                model=model_type,
                weights=weights,
                steps=steps,
                worst_relative_diff=worst,
                hf_worst_vs_hf_rotated=floors,
                hf_rotated=hf_rotated,
                hf_worst_vs_fp32=_worst(hf, fp32),
                flce_worst_vs_fp32=_worst(ours, fp32),
                hf=hf,
                flce=ours,
                fp32=fp32,
                passed=passed,
                **softcap_diag,
            )
        )
        print(
            f"{'PASS' if passed else 'FAIL'} {model_type} {weights}: {steps} AdamW steps, worst per-step "
            f"loss diff to HF {worst:.2e} (limit {TOLERANCE}); loss {hf[0]:.4f} -> {hf[-1]:.4f} (HF) / "
            f"{ours[0]:.4f} -> {ours[-1]:.4f} (flce); worst diff to the fp32 run: HF {_worst(hf, fp32):.2e}, "
            f"flce {_worst(ours, fp32):.2e}; HF vs HF on the batch rotated by 1..{len(floors)} sequences: "
            + ", ".join(f"{f:.2e}" for f in floors),
            flush=True,
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    results = []
    g = torch.Generator(device="cuda").manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    for model_type in CASES:
        ids = torch.randint(0, CASES[model_type]["vocab_size"], (4, 512), device="cuda", generator=g)
        labels = ids.clone()
        labels[:, :64] = -100
        if model_type not in args.models:  # the batches are drawn in the same order either way
            continue
        results += compare(model_type, ids, labels, args.steps, lambda dtype, m=model_type: tiny(m, dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_train_check.json").write_text(json.dumps(results, indent=2))
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
