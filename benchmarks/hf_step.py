"""End-to-end HF training step: a 2-layer model with a real LM head, one fwd+bwd, per loss path.

    python -m flce_policy.benchmarks.hf_step --out DIR [--families llama3-8b gemma3-27b] [--repeats 5]

Rows: HF's own loss (logits materialised), Liger-Kernel with only its fused linear cross-entropy
patched in (rope/rms_norm/swiglu off), flce-policy's default policy, and a 256 MiB slab policy;
each on a bf16 model and on an fp32-master model under bf16 autocast (HF Trainer ``bf16=True`` on
an fp32 model). Time is the median fwd+bwd step (CUDA events); peak is the step's allocation
over the model and its inputs. Ratios are taken within this run. Writes hf_step.json / .csv /
.png in DIR and prints the issue's targets as PASS/FAIL lines.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from flce_policy.benchmarks.measure import measure

GiB = 2**30

#: family -> (model_type, config overrides, batch rows, sequence length, Liger's patch function)
FAMILIES: dict[str, tuple[str, dict, int, int, str]] = {
    "llama3-8b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        ),
        2,
        8192,
        "apply_liger_kernel_to_llama",
    ),
    "gemma3-27b": (
        "gemma3_text",
        dict(
            vocab_size=262144,
            hidden_size=5376,
            intermediate_size=21504,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=128,
            final_logit_softcapping=30.0,
            sliding_window=1024,
        ),
        1,
        8192,
        "apply_liger_kernel_to_gemma3_text",
    ),
}


def build_model(family: str, master_dtype: torch.dtype, device: str = "cuda", sizes: dict | None = None):
    """The family's two-layer model with its real head; ``sizes`` replaces config fields (the CPU smoke test's
    small head)."""
    import transformers

    model_type, overrides, *_ = FAMILIES[family]
    config = transformers.AutoConfig.for_model(
        model_type,
        num_hidden_layers=2,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
        **{**overrides, **(sizes or {})},
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=master_dtype)
    model.train()
    return model


def patch(model, family: str, method: str) -> None:
    if method == "hf":
        return
    if method == "liger":
        import liger_kernel.transformers as liger

        getattr(liger, FAMILIES[family][4])(
            rope=False,
            rms_norm=False,
            cross_entropy=False,
            fused_linear_cross_entropy=True,
            model=model,
            **({"swiglu": False} if family.startswith("llama") else {"geglu": False}),
        )
        return
    from flce_policy.integrations.transformers import apply_flce
    from flce_policy.strategies import SlabBudget

    apply_flce(model, policy=SlabBudget("256MiB") if method == "flce_256MiB" else None)


def step_fn(model, ids, labels, autocast: bool) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        model.zero_grad(set_to_none=True)  # the step leaves nothing behind (measure's contract)

    return step


def run_row(
    family: str,
    method: str,
    autocast: bool,
    repeats: int,
    *,
    device: str = "cuda",
    sizes: dict | None = None,
    batch: tuple[int, int] | None = None,
) -> dict:
    """One row: the step's loss, median time and peak. ``device``, ``sizes`` and ``batch`` (rows, sequence
    length) are the CPU smoke test's, where ``measure`` is replaced (it times with CUDA events)."""
    model = build_model(family, torch.float32 if autocast else torch.bfloat16, device, sizes)
    patch(model, family, method)
    rows, seq = batch or FAMILIES[family][2:4]
    g = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), device=device, generator=g)
    labels = ids.clone()
    labels[:, : seq // 8] = -100  # a prompt that is not trained on
    try:
        step = step_fn(model, ids, labels, autocast)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=labels).loss.item()
        model.zero_grad(set_to_none=True)
        result = measure(step, warmup=2, repeats=repeats)
        row = dict(ms=result.median_ms, peak_gib=result.peak_bytes / GiB, loss=loss, error=None)
    except torch.cuda.OutOfMemoryError as err:
        row = dict(ms=None, peak_gib=None, loss=None, error=f"OOM: {str(err).splitlines()[0]}")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return dict(family=family, method=method, weights="fp32 master + autocast" if autocast else "bf16", **row)


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, each as one PASS/FAIL line (ratios within this run)."""
    by = {(r["family"], r["method"], r["weights"]): r for r in rows}
    lines = []
    for family in sorted({r["family"] for r in rows}):
        ours, liger, slab, hf = (by.get((family, m, "bf16")) for m in ("flce_default", "liger", "flce_256MiB", "hf"))
        master = by.get((family, "flce_default", "fp32 master + autocast"))
        if ours and liger and ours["ms"] and liger["ms"]:
            lines.append(_judge(f"{family}: flce default step <= Liger's", ours["ms"] / liger["ms"], 1.0, "x"))
            lines.append(
                _judge(
                    f"{family}: flce default peak <= Liger's + 2 GiB",
                    ours["peak_gib"] - liger["peak_gib"],
                    2.0,
                    " GiB over",
                )
            )
        if slab and liger and slab["ms"] and liger["ms"]:
            lines.append(
                _judge(
                    f"{family}: 256 MiB slab peak <= Liger's", slab["peak_gib"] - liger["peak_gib"], 0.0, " GiB over"
                )
            )
        if master and ours and master["ms"] and ours["ms"]:
            lines.append(
                _judge(
                    f"{family}: fp32-master autocast step <= 1.10x the bf16 step", master["ms"] / ours["ms"], 1.10, "x"
                )
            )
        if hf and ours and hf["loss"] is not None and ours["loss"] is not None:
            rel = abs(ours["loss"] - hf["loss"]) / abs(hf["loss"])
            lines.append(_judge(f"{family}: flce loss vs HF's (relative)", rel, 0.01, ""))
    return lines


def _judge(what: str, value: float, limit: float, unit: str) -> str:
    return f"{'PASS' if value <= limit else 'FAIL'} {what}: {value:.3f}{unit} (limit {limit}{unit})"


def write(rows: list[dict], out: Path, lines: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", torch=torch.__version__)
    (out / "hf_step.json").write_text(json.dumps(dict(meta=meta, rows=rows, targets=lines), indent=2))
    with open(out / "hf_step.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    families = sorted({r["family"] for r in rows})
    fig, axes = plt.subplots(1, len(families), figsize=(6.5 * len(families), 4.8), squeeze=False)
    for ax, family in zip(axes[0], families, strict=True):
        for r in (r for r in rows if r["family"] == family and r["ms"]):
            marker = "o" if r["weights"] == "bf16" else "s"
            ax.scatter(r["peak_gib"], r["ms"], marker=marker, s=50)
            ax.annotate(
                f"{r['method']}{'' if r['weights'] == 'bf16' else ' (fp32 master)'}",
                (r["peak_gib"], r["ms"]),
                textcoords="offset points",
                xytext=(5, 4),
                fontsize=8,
            )
        ax.set_title(f"{family}: one fwd+bwd step (2 layers, real head)")
        ax.set_xlabel("peak GiB over model + inputs")
        ax.set_ylabel("step ms (median)")
        ax.margins(0.25)
    fig.tight_layout()
    fig.savefig(out / "hf_step.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--methods", nargs="+", default=["hf", "flce_default", "flce_256MiB", "liger"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = []
    for family in args.families:
        for autocast in (False, True):
            for method in args.methods:
                row = run_row(family, method, autocast, args.repeats)
                rows.append(row)
                print(json.dumps(row), flush=True)
    lines = targets(rows)
    print("\n".join(lines))
    write(rows, args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
