"""The shape of one fused linear cross-entropy call: BT token rows, hidden size H, vocab V.

Under tensor parallelism (a vocab-parallel LM head) a Problem is one rank's: ``vocab`` is the
rank's shard of the vocabulary and ``tp_size`` the size of the group, so every strategy sizes the
slab of the shard it runs (:func:`vocab_shard_sizes` gives the split ``ColwiseParallel`` makes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer

if TYPE_CHECKING:
    import torch

__all__ = ["Problem", "DTYPE_ITEMSIZE", "LogitsDType", "checked_dtype", "normalise_dtype", "vocab_shard_sizes"]

LogitsDType = Literal["bfloat16", "float16", "float32"]

#: Bytes per logits element for each supported logits dtype: the one place slab sizes come from.
DTYPE_ITEMSIZE: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


class Problem(BaseModel):
    """An FLCE problem: ``cross_entropy(x @ W.T, y)`` with x ``[tokens, hidden]`` and W ``[vocab, hidden]``.

    ``dtype`` is the dtype the logits are computed in (the input dtype). With ``tp_size > 1``
    the head is sharded over the vocabulary across a tensor-parallel group and ``vocab`` is this
    rank's shard (rows of its weight), not the whole vocabulary.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: int = Field(ge=1, description="BT, the number of token rows (leading dims flattened)")
    hidden: int = Field(ge=1, description="H, the hidden size")
    vocab: int = Field(ge=1, description="V, the vocabulary size (rows of the LM head; this rank's shard under TP)")
    dtype: LogitsDType = "bfloat16"
    tp_size: int = Field(default=1, ge=1, description="ranks of the tensor-parallel group the vocabulary is split over")

    def __init__(self, tokens: int, hidden: int, vocab: int, dtype: Any = "bfloat16", **kw: Any) -> None:
        super().__init__(tokens=tokens, hidden=hidden, vocab=vocab, dtype=dtype, **kw)

    @field_validator("dtype", mode="before")
    @classmethod
    def _normalise_dtype(cls, value: Any) -> Any:
        return normalise_dtype(value)

    @model_serializer(mode="wrap")
    def _omit_default_tp(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # An unsharded problem dumps as it always did (explain --json, benchmark records).
        data = handler(self)
        if data.get("tp_size") == 1:
            del data["tp_size"]
        return data

    @property
    def itemsize(self) -> int:
        """Bytes per logits element."""
        return DTYPE_ITEMSIZE[self.dtype]

    @classmethod
    def from_tensors(cls, input: torch.Tensor, weight: torch.Tensor) -> Problem:
        """The problem of ``input [..., H]`` against LM head ``weight [V, H]``."""
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
        if input.dim() < 1 or input.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"input's last dim must equal weight's hidden size {weight.shape[1]}, "
                f"got input shape {tuple(input.shape)}"
            )
        tokens = input.numel() // input.shape[-1] if input.shape[-1] else 0
        return cls(tokens=tokens, hidden=weight.shape[1], vocab=weight.shape[0], dtype=input.dtype)

    def describe(self) -> str:
        shard = f" (vocab shard of a TP group of {self.tp_size})" if self.tp_size > 1 else ""
        return f"BT={self.tokens} H={self.hidden} V={self.vocab}{shard} {self.dtype}"


def vocab_shard_sizes(vocab: int, tp_size: int) -> list[int]:
    """Rows of each rank's shard when ``vocab`` is split over ``tp_size`` ranks as a ``Shard(0)`` DTensor
    (``torch.chunk``: ``cdiv(vocab, tp_size)`` rows each, the last ones shorter or empty)."""
    if vocab < 1 or tp_size < 1:
        raise ValueError(f"vocab and tp_size must be positive, got vocab={vocab}, tp_size={tp_size}")
    step = -(-vocab // tp_size)
    return [max(0, min(step, vocab - rank * step)) for rank in range(tp_size)]


def checked_dtype(value: Any, name: str) -> str:
    """``value`` (a torch dtype, a name or an alias such as "bf16") as one of :data:`DTYPE_ITEMSIZE`'s dtypes.

    ValueError naming ``name`` (the argument or option, e.g. "master_dtype" or "--master-dtype") and listing
    the accepted dtypes otherwise: the one rule for every dtype argument outside a pydantic model.
    """
    dtype = normalise_dtype(value)
    if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
        accepted = ", ".join(DTYPE_ITEMSIZE)
        aliases = ", ".join(_DTYPE_ALIASES)
        raise ValueError(f"{name} must be one of {accepted} (or a torch dtype, or {aliases}); got {value!r}")
    return dtype


def normalise_dtype(value: Any) -> Any:
    """``torch.bfloat16``, "bf16", "BFloat16" -> "bfloat16" and so on; other values unchanged (for pydantic)."""
    if value.__class__.__name__ == "dtype" and str(value).startswith("torch."):
        value = str(value).removeprefix("torch.")
    if isinstance(value, str):
        value = _DTYPE_ALIASES.get(value.lower(), value.lower())
    return value
