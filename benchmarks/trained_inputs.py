"""Benchmark inputs from a trained model: held-out head inputs of a small Llama trained through apply_flce.

    python -m flce_policy.benchmarks.trained_inputs --out DIR [--steps N] [--seed S] [--cache-dir D]

Builds (or loads from the cache) the inputs, then writes to DIR: ``trained_inputs.json`` (the
settings, the training's seconds, first and final loss, and the distribution report of
:mod:`.logit_stats` on the held-out inputs), ``loss_curve.json`` ([[step, loss], ...]) and
``loss_curve.png``. ``flce-policy bench --inputs trained`` runs every bench method on the same
inputs.

A build: corpus (:mod:`.trained_corpus`) -> byte-level BPE (:mod:`.trained_tokenizer`) -> training
(:mod:`.trained_model`) -> the held-out hidden states [T, H] bf16, the head weight [V, H] bf16 and
the targets [T], saved with the tokenizer, the training token counts and the loss curve in one
``torch.save`` file, ``<cache dir>/<cache_key>.pt`` (default ``~/.cache/flce-policy/trained-inputs``).
A missing file is rebuilt; a present one is loaded as it is. The cache lies outside the repository.
The key names the settings, not the machine: the corpus is whatever Python this machine holds, so a
file carried from another machine is that machine's build (the file lists the corpus files it read).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .methods import Inputs
from .trained_config import RANDOM_INPUTS, TRAINED_INPUTS, TrainedConfig, cache_key
from .trained_corpus import Corpus

__all__ = [
    "DEFAULT_CACHE_DIR",
    "log_stderr",
    "MAX_TRAIN_SECONDS",
    "Streams",
    "prepare_streams",
    "build_cache",
    "cache_path",
    "load_or_build",
    "trained_inputs",
    "inputs_from_spec",
    "frequency_order",
    "distribution_report",
    "main",
]

#: Where builds are kept unless told otherwise (FLCE_POLICY_CACHE moves the root).
DEFAULT_CACHE_DIR = Path(os.environ.get("FLCE_POLICY_CACHE", Path.home() / ".cache" / "flce-policy")) / "trained-inputs"


#: The issue's bound on training time on the H200; past it a build stops with an error.
MAX_TRAIN_SECONDS = 240.0


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cache_path(config: TrainedConfig, cache_dir: Path | str | None = None) -> Path:
    return Path(cache_dir or DEFAULT_CACHE_DIR) / f"{cache_key(config)}.pt"


def log_stderr(message: str) -> None:
    print(f"[trained-inputs] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Streams:
    """What training reads: the corpus, its tokenizer and the token streams of both splits."""

    corpus: Corpus
    tokenizer: Any  # tokenizers.Tokenizer
    train_ids: torch.Tensor  # [N] int64
    held_out_ids: torch.Tensor  # [M] int64


def prepare_streams(
    config: TrainedConfig, *, sources: Callable[[], list] | None = None, log: Callable[[str], None] = log_stderr
) -> Streams:
    """Corpus, tokenizer and token streams of ``config``; ``sources()`` lists the corpus files.

    Training twice (a loss option off, then on) reads one ``Streams``: same tokens, and with
    ``trained_model.train``'s seed, the same batches in the same order.
    """
    from .trained_corpus import python_sources, split_corpus
    from .trained_tokenizer import token_stream, train_tokenizer

    files = (sources or python_sources)()
    corpus = split_corpus(
        files,
        train_bytes=config.train_bytes,
        held_out_bytes=config.held_out_bytes,
        held_out_share=config.held_out_share,
    )
    log(
        f"corpus: {len(corpus.train_names)} train files ({corpus.train_bytes:,} bytes), "
        f"{len(corpus.held_out_names)} held-out files ({corpus.held_out_bytes:,} bytes) of {len(files)}"
    )
    tokenizer = train_tokenizer(corpus.train_texts, config.vocab_size, min_frequency=config.min_frequency)
    streams = Streams(
        corpus, tokenizer, token_stream(tokenizer, corpus.train_texts), token_stream(tokenizer, corpus.held_out_texts)
    )
    log(
        f"tokenizer: V={config.vocab_size}, {streams.train_ids.numel():,} train tokens, "
        f"{streams.held_out_ids.numel():,} held-out tokens"
    )
    return streams


def build_cache(
    config: TrainedConfig,
    *,
    device: torch.device | None = None,
    sources: Callable[[], list] | None = None,
    log: Callable[[str], None] = log_stderr,
    max_train_seconds: float | None = None,
) -> dict[str, Any]:
    """Build everything a cache file holds (see the module doc); ``sources()`` lists the corpus files.

    ``max_train_seconds`` stops a training that runs longer with an error (see ``train``).
    """
    from .trained_model import held_out_head_inputs, train

    device = device or default_device()
    began = time.perf_counter()
    streams = prepare_streams(config, sources=sources, log=log)
    prepared = time.perf_counter() - began
    log(f"prepared in {prepared:.1f} s")

    def on_log(step: int, loss: float, seconds: float) -> None:
        log(f"step {step + 1}/{config.steps} loss {loss:.4f} ({seconds:.1f} s)")

    result = train(
        config,
        streams.train_ids,
        device=device,
        log_every=max(1, config.steps // 20),
        on_log=on_log,
        max_seconds=max_train_seconds,
    )
    log(f"trained {config.steps} steps in {result.seconds:.1f} s on {device}")
    hidden, target = held_out_head_inputs(result.model, config, streams.held_out_ids, device=device)
    weight = result.model.get_output_embeddings().weight.detach().to(torch.bfloat16)
    return {
        "config": config.model_dump(),
        "key": cache_key(config),
        "x": hidden.cpu(),
        "weight": weight.cpu().contiguous(),
        "target": target.cpu(),
        "token_counts": torch.bincount(streams.train_ids, minlength=config.vocab_size),
        "tokenizer": streams.tokenizer.to_str(),
        "train_files": list(streams.corpus.train_names),
        "held_out_files": list(streams.corpus.held_out_names),
        "train_tokens": streams.train_ids.numel(),
        "losses": result.losses,
        "train_seconds": result.seconds,
        "prepare_seconds": prepared,
        "device": str(device),
        "torch": str(torch.__version__),  # a plain str: weights_only loading refuses TorchVersion
    }


def load_or_build(
    config: TrainedConfig,
    cache_dir: Path | str | None = None,
    *,
    device: torch.device | None = None,
    sources: Callable[[], list] | None = None,
    log: Callable[[str], None] = log_stderr,
    max_train_seconds: float | None = None,
) -> dict[str, Any]:
    """The cache file for ``config``, built and saved first when it is missing."""
    path = cache_path(config, cache_dir)
    if path.is_file():
        log(f"loading {path}")
        return {**torch.load(path, map_location="cpu", weights_only=True), "cache_file": str(path)}
    log(f"no cache at {path}: building it")
    data = build_cache(config, device=device, sources=sources, log=log, max_train_seconds=max_train_seconds)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".pt.partial")
    torch.save(data, partial)
    partial.replace(path)  # a build cut short leaves no file that looks complete
    log(f"saved {path}")
    return {**data, "cache_file": str(path)}


def trained_inputs(data: dict[str, Any], device: torch.device | str = "cuda") -> Inputs:
    """The cached tensors as bench :class:`Inputs` on ``device``."""
    return Inputs(data["x"].to(device), data["weight"].to(device), data["target"].to(device))


def inputs_from_spec(spec: str | None, device: torch.device | str = "cuda") -> tuple[Inputs | None, str]:
    """(Inputs, label) of an ``--inputs`` value: (None, "random") for random inputs; else a trained build's.

    "trained" loads (or builds) the default config's cache; any other value is a cache file's path.
    A build that cannot be made (too few tokens for the vocab, too slow) is a ValueError.
    """
    if spec in (None, RANDOM_INPUTS):
        return None, RANDOM_INPUTS
    from .trained_model import TrainingTooSlow
    from .trained_tokenizer import VocabTooLarge

    if spec == TRAINED_INPUTS:
        try:
            data = load_or_build(TrainedConfig(), max_train_seconds=MAX_TRAIN_SECONDS)
        except (VocabTooLarge, TrainingTooSlow) as err:
            raise ValueError(str(err)) from None
    else:
        data = torch.load(spec, map_location="cpu", weights_only=True)
    return trained_inputs(data, device), f"{TRAINED_INPUTS} {data['key']}"


def frequency_order(token_counts: torch.Tensor) -> torch.Tensor:
    """The vocab ids by descending training count (ties by id)."""
    return torch.sort(token_counts, descending=True, stable=True).indices


def distribution_report(data: dict[str, Any], device: torch.device | str, **options: Any) -> dict[str, Any]:
    """:func:`.logit_stats.logit_distribution` of the cached inputs, with the frequency order."""
    from .logit_stats import logit_distribution

    inputs = trained_inputs(data, device)
    order = frequency_order(data["token_counts"])
    return logit_distribution(inputs.x, inputs.weight, inputs.target, vocab_order=order, **options)


# --- command line ---------------------------------------------------------------------------------

_OVERRIDABLE = (
    "steps",
    "seed",
    "vocab_size",
    "min_frequency",
    "hidden_size",
    "num_layers",
    "train_bytes",
    "batch_size",
    "seq_len",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flce_policy.benchmarks.trained_inputs",
        description="Train (or load from the cache) the trained-model bench inputs and report their distribution.",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the JSON report and loss-curve PNG")
    parser.add_argument("--cache-dir", metavar="DIR", help=f"cache folder (default {DEFAULT_CACHE_DIR})")
    defaults = TrainedConfig()
    for name in _OVERRIDABLE:
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help=f"(default {getattr(defaults, name)})"
        )
    parser.add_argument("--lr", type=float, default=None, help=f"AdamW peak rate (default {defaults.lr})")
    parser.add_argument(
        "--max-train-seconds",
        type=float,
        default=MAX_TRAIN_SECONDS,
        help=f"stop with an error when training runs longer (default {MAX_TRAIN_SECONDS:.0f})",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> TrainedConfig:
    given = {n: getattr(args, n) for n in (*_OVERRIDABLE, "lr") if getattr(args, n) is not None}
    return TrainedConfig(**given)


def write_reports(data: dict[str, Any], report: dict[str, Any], out: Path) -> list[Path]:
    """trained_inputs.json, loss_curve.json and (with matplotlib) loss_curve.png in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    curve = [[step + 1, loss] for step, loss in enumerate(data["losses"])]
    summary = {
        "key": data["key"],
        "cache_file": data.get("cache_file"),  # `flce-policy bench --inputs FILE` runs on it
        "config": data["config"],
        "device": data["device"],
        "torch": data["torch"],
        "train_seconds": data["train_seconds"],
        "prepare_seconds": data["prepare_seconds"],
        "train_tokens": data["train_tokens"],
        "train_files": len(data["train_files"]),
        "held_out_files": len(data["held_out_files"]),
        "first_loss": curve[0][1],
        "final_loss": curve[-1][1],
        "distribution": report,
    }
    written = [out / "trained_inputs.json", out / "loss_curve.json"]
    written[0].write_text(json.dumps(summary, indent=2) + "\n")
    written[1].write_text(json.dumps(curve) + "\n")
    try:
        written.append(_plot_curve(curve, data["key"], out / "loss_curve.png"))
    except ImportError:
        print("note: no loss_curve.png (matplotlib is not installed)", file=sys.stderr)
    return written


def _plot_curve(curve: list[list[float]], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s for s, _ in curve], [v for _, v in curve], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED

    args = build_parser().parse_args(argv)
    device = default_device()
    if device.type == "cpu" and not KERNELS_INTERPRETED:
        print("error: training needs a CUDA GPU (or TRITON_INTERPRET=1 for a tiny CPU run)", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from .trained_model import TrainingTooSlow
    from .trained_tokenizer import VocabTooLarge

    try:
        data = load_or_build(config, args.cache_dir, device=device, max_train_seconds=args.max_train_seconds)
    except (VocabTooLarge, TrainingTooSlow) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = distribution_report(data, device)
    for path in write_reports(data, report, Path(args.out)):
        print(f"wrote {path}", file=sys.stderr)
    print(json.dumps({k: report[k] for k in ("ce", "entropy", "logit_std")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
