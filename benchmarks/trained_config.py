"""What a trained-inputs build is made of: corpus budget, tokenizer, model, optimiser, steps, seed.

One frozen object; its JSON names the cache file (:func:`cache_key`), so a build is reused only
for the same settings. The defaults are the GPU run of issue 26 (V = 131072, H = 1024, 6 layers);
the tests shrink every field.
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["TrainedConfig", "cache_key", "CACHE_FORMAT", "RANDOM_INPUTS", "TRAINED_INPUTS"]

#: Bumped when what a cache file holds, or how it is built, changes: old files are then rebuilt.
CACHE_FORMAT = 1


#: ``--inputs`` values besides a cache file's path; "random" is the default (the bench's own inputs per shape).
RANDOM_INPUTS, TRAINED_INPUTS = "random", "trained"


class TrainedConfig(BaseModel):
    """Settings of one build. Byte budgets in bytes of UTF-8 text; ``lr`` the AdamW peak rate."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = 0
    train_bytes: int = Field(60_000_000, gt=0)
    held_out_bytes: int = Field(2_000_000, gt=0)
    held_out_share: float = Field(0.05, gt=0, lt=1)  # of the files, by name hash
    vocab_size: int = Field(131072, ge=258)  # 256 bytes, END_OF_TEXT and one merge
    # pairs seen fewer times are not merged. On the CPU machine (2026-12-01) 10 MB of its Python reached
    # 44.6k tokens at 2, 30 MB 90.7k, 60 MB the full 131072 (15.4M train tokens, 3.9 bytes each; 98 s to
    # list, read, train and encode on 2 cores); 1 reaches more, with rarer tokens
    min_frequency: int = Field(2, ge=0)
    hidden_size: int = Field(1024, gt=0)
    intermediate_size: int = Field(2816, gt=0)
    num_layers: int = Field(6, gt=0)
    num_heads: int = Field(16, gt=0)
    seq_len: int = Field(512, ge=2)  # tokens per sequence; seq_len - 1 targets each
    batch_size: int = Field(32, gt=0)  # sequences per step
    steps: int = Field(1500, gt=0)  # ~100-200 s on the H200 (estimated, not measured)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(100, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    held_out_tokens: int = Field(16384, gt=0)  # rows of the cached inputs
    autocast_bf16: bool = True  # fp32 master weights, bf16 autocast (on CUDA; CPU runs fp32)

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> TrainedConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        return self


def cache_key(config: TrainedConfig) -> str:
    """A short name fixed by the settings and the cache format, e.g. 'v131072-h1024-l6-s2000-seed0-1a2b3c4d5e6f'."""
    digest = hashlib.sha256(f"{CACHE_FORMAT}:{config.model_dump_json()}".encode()).hexdigest()[:12]
    c = config
    return f"v{c.vocab_size}-h{c.hidden_size}-l{c.num_layers}-s{c.steps}-seed{c.seed}-{digest}"
