"""A byte-level BPE tokenizer trained on the corpus, and the token streams it makes of each split.

The ``tokenizers`` library's BPE trainer (a transformers dependency) has no randomness: it counts
words, then merges the most frequent pair, ties broken by the pair's ids. Byte-level BPE starts
from the 256 byte symbols, sorted, and adds no continuing-subword tokens, so its ids do not depend
on hash-map order and two runs on the same texts give the same vocabulary (the tests check it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["END_OF_TEXT", "VocabTooLarge", "train_tokenizer", "token_stream"]

#: Separates files in a token stream; id 0.
END_OF_TEXT = "<|endoftext|>"


class VocabTooLarge(ValueError):
    """The corpus has too few distinct pairs to reach the requested vocabulary."""


def train_tokenizer(texts: Sequence[str], vocab_size: int, *, min_frequency: int = 2):
    """A ``tokenizers.Tokenizer`` with exactly ``vocab_size`` tokens, trained on ``texts``.

    Raises :class:`VocabTooLarge` when the trainer stops short of ``vocab_size`` (every pair seen
    ``min_frequency`` times merged already): a larger corpus is needed, or a smaller vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    reached = tokenizer.get_vocab_size()
    if reached != vocab_size:
        size = sum(len(t.encode()) for t in texts)
        raise VocabTooLarge(
            f"the BPE trainer reached {reached} tokens, not the {vocab_size} asked for: {size:,} bytes of "
            f"training text has too few pairs seen {min_frequency}+ times; raise the corpus budget, "
            "lower the vocab or the min frequency"
        )
    return tokenizer


def token_stream(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """The texts' tokens in order, each file followed by END_OF_TEXT, as one int64 tensor."""
    end = tokenizer.token_to_id(END_OF_TEXT)
    ids: list[int] = []
    # encode_batch_fast (tokenizers >= 0.20) skips the character offsets, which are not needed here
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    for encoding in encode(list(texts)):
        ids.extend(encoding.ids)
        ids.append(end)
    return torch.tensor(ids, dtype=torch.int64)
