"""Train a tiny Llama with HF's Trainer through flce-policy: seconds on a CPU, or on a GPU.

    pip install -e ".[hf]"   # transformers and accelerate (HF's Trainer needs it)
    python examples/train_tiny_hf.py [--steps 4]

The model is built from a config (no download); the data is random tokens. On a machine without
a GPU the Triton kernels run in the interpreter (slow, so the model is tiny).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before flce_policy's kernels are imported

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from flce_policy.integrations.transformers import apply_flce  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = apply_flce(LlamaForCausalLM(config), return_token_accuracy=True)

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(16):
        ids = torch.randint(0, config.vocab_size, (16,), generator=g)
        labels = ids.clone()
        labels[:4] = -100  # the prompt is not trained on
        rows.append({"input_ids": ids, "labels": labels})

    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=args.steps,
            learning_rate=3e-3,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=not torch.cuda.is_available(),
            bf16=torch.cuda.is_available(),
        )
        trainer = Trainer(model=model, args=training, train_dataset=rows)
        result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    per_step = ", ".join(f"{x:.3f}" for x in losses)
    print(f"trained {result.global_step} steps through flce-policy; loss per step: {per_step}")


if __name__ == "__main__":
    main()
