"""Train a small Llama through ``apply_flce`` on a token stream, and read its held-out head inputs.

The model is made from a config (no download), its weights drawn on the CPU from the seed so every
machine starts from the same ones, then moved to the device. Sequences are cut from the stream
end to end and visited in an order drawn from the seed, epoch after epoch: two runs with one
config see the same batches in the same order. ``loss_options`` go to ``apply_flce`` (and through
it to every loss call), so a second run with an option switched on (a filter) differs from the
first by that option alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .trained_config import TrainedConfig

__all__ = [
    "TrainResult",
    "TrainingTooSlow",
    "build_model",
    "sequences",
    "batches",
    "train",
    "held_out_head_inputs",
    "held_out_loss",
]


@dataclass
class TrainResult:
    model: torch.nn.Module
    losses: list[float]  # the training loss of each step, in nats
    seconds: float  # wall time of the steps (device synchronised)


def build_model(config: TrainedConfig) -> torch.nn.Module:
    """A LlamaForCausalLM with untied head, fp32 weights on the CPU, initialised from ``config.seed``."""
    import transformers

    llama = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.seq_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(config.seed)
    return transformers.LlamaForCausalLM(llama)


def sequences(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The stream cut into [N, seq_len] non-overlapping sequences (the tail shorter than one dropped)."""
    count = stream.numel() // seq_len
    if count == 0:
        raise ValueError(f"a stream of {stream.numel()} tokens holds no sequence of {seq_len}")
    return stream[: count * seq_len].view(count, seq_len)


def batches(seqs: torch.Tensor, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """[batch_size, seq_len] batches forever: each epoch a permutation drawn from (seed, epoch)."""
    if seqs.shape[0] < batch_size:
        raise ValueError(f"{seqs.shape[0]} training sequences are fewer than one batch of {batch_size}")
    epoch = 0
    while True:
        order = torch.randperm(seqs.shape[0], generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        for start in range(0, seqs.shape[0] - batch_size + 1, batch_size):
            yield seqs[order[start : start + batch_size]]
        epoch += 1


def _schedule(config: TrainedConfig) -> Callable[[int], float]:
    """Linear warmup to the peak rate, then cosine decay to a tenth of it at the last step."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _autocast(config: TrainedConfig, device: torch.device):
    enabled = config.autocast_bf16 and device.type == "cuda"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TrainingTooSlow(RuntimeError):
    """Training passed its time limit; nothing is kept (a shorter run would be another build)."""


def train(
    config: TrainedConfig,
    train_stream: torch.Tensor,
    *,
    device: torch.device,
    policy: Any = None,
    loss_options: dict[str, Any] | None = None,
    log_every: int = 0,
    on_log: Callable[[int, float, float], None] | None = None,
    max_seconds: float | None = None,
) -> TrainResult:
    """``config.steps`` AdamW steps through ``apply_flce(model, policy, **loss_options)``.

    Every ``log_every`` steps (and at the last) ``on_log(step, loss, seconds so far)`` is called
    (a host sync); other steps never wait for the device. Past ``max_seconds`` it raises
    :class:`TrainingTooSlow` rather than stop short, so a build is always ``config.steps`` long.
    ``policy`` None: a fresh ``FLCEPolicy.default()``, so that nothing an earlier training of the process left in a
    policy (an OOM fallback's size, the grad_weight filter's rest) reaches this one: runs from one seed repeat.
    """
    from flce_policy import FLCEPolicy
    from flce_policy.integrations.transformers import apply_flce

    policy = FLCEPolicy.default() if policy is None else policy
    model = apply_flce(build_model(config).to(device).train(), policy, **(loss_options or {}))
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        betas=(0.9, 0.95),
        weight_decay=config.weight_decay,
        fused=device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
    data = batches(sequences(train_stream, config.seq_len), config.batch_size, config.seed)
    losses: list[torch.Tensor] = []
    _sync(device)
    start = time.perf_counter()
    for step in range(config.steps):
        ids = next(data).to(device, non_blocking=True)
        with _autocast(config, device):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
        last = step == config.steps - 1
        if on_log is not None and (last or (log_every and step % log_every == 0)):
            on_log(step, losses[-1].item(), time.perf_counter() - start)
        elapsed = time.perf_counter() - start
        if max_seconds is not None and elapsed > max_seconds and not last:
            rate = elapsed / (step + 1)
            raise TrainingTooSlow(
                f"training passed {max_seconds:.0f} s at step {step + 1} of {config.steps} ({rate:.3f} s a step): "
                f"ask for fewer steps (about {int(max_seconds / rate)} fit) or a longer limit"
            )
    _sync(device)
    seconds = time.perf_counter() - start
    return TrainResult(model, torch.stack(losses).cpu().tolist(), seconds)


@torch.no_grad()
def held_out_head_inputs(
    model: torch.nn.Module, config: TrainedConfig, stream: torch.Tensor, *, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states [T, H] bf16, targets [T] int64) of ``config.held_out_tokens`` held-out positions.

    The hidden states are what ``lm_head`` reads (the body's output, after its final norm), under
    the autocast training ran with; each position's target is the next token of its sequence.
    """
    seqs = sequences(stream, config.seq_len)
    per_seq = config.seq_len - 1
    need = -(-config.held_out_tokens // per_seq)
    if seqs.shape[0] < need:
        raise ValueError(
            f"the held-out text gives {seqs.shape[0] * per_seq} positions, fewer than held_out_tokens "
            f"{config.held_out_tokens}; raise held_out_bytes"
        )
    # sequences spread evenly over the held-out text, so the positions come from many files, not the first few
    seqs = seqs[torch.linspace(0, seqs.shape[0] - 1, need).round().long()]
    was_training = model.training
    model.eval()
    hidden, targets = [], []
    for start in range(0, need, config.batch_size):
        ids = seqs[start : start + config.batch_size].to(device)
        with _autocast(config, device):
            states = model.model(input_ids=ids, use_cache=False).last_hidden_state
        hidden.append(states[:, :-1].reshape(-1, states.shape[-1]).to(torch.bfloat16))
        targets.append(ids[:, 1:].reshape(-1))
    model.train(was_training)
    tokens = config.held_out_tokens
    return torch.cat(hidden)[:tokens].contiguous(), torch.cat(targets)[:tokens].contiguous()


@torch.no_grad()
def held_out_loss(
    model: torch.nn.Module, config: TrainedConfig, stream: torch.Tensor, *, device: torch.device, chunk_rows: int = 1024
) -> float:
    """Mean CE in nats over the held-out positions of :func:`held_out_head_inputs`.

    From the bf16 hidden states and head weight the bench inputs hold, in fp32, ``chunk_rows`` at
    a time: the number to compare between two trainings of one config (a loss option off and on).
    """
    hidden, target = held_out_head_inputs(model, config, stream, device=device)
    weight = model.get_output_embeddings().weight.detach().to(torch.bfloat16).float()
    total = 0.0
    for start in range(0, hidden.shape[0], chunk_rows):
        logits = hidden[start : start + chunk_rows].float() @ weight.t()
        total += torch.nn.functional.cross_entropy(logits, target[start : start + chunk_rows], reduction="sum").item()
    return total / hidden.shape[0]
