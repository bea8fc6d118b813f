"""The chunk geometry a strategy decides and the driver runs, validated against its problem."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from flce_policy.plan.problem import DTYPE_ITEMSIZE, LogitsDType, Problem, checked_dtype, normalise_dtype
from flce_policy.plan.scaled_exp import is_scaled_exp, scaled_exp_unsupported
from flce_policy.plan.units import cdiv, format_bytes
from flce_policy.plan.weight_filter import check_rescue_has_filter, checked_filter_eps, checked_filter_rescue

__all__ = ["OVERLAP_NO_FILTER", "Geometry"]


class Geometry(BaseModel):
    """How the BT x V logits are walked: row chunks of ``chunk_size`` and vocab tiles of ``vocab_chunk``.

    A row-only geometry has ``vocab_chunk == problem.vocab`` (one vocab tile); the slab, the logits
    buffer one step holds, is ``[chunk_size, vocab_chunk]`` of the problem's dtype.
    ``accum_dtype`` is the grad_weight accumulator the strategy planned (its peak and time assume
    it): the loss accumulates in it, and a call asking for another accumulator is an error.
    Build one with :meth:`for_problem`; direct construction is validated the same way and an
    inconsistent field is an error, never silently corrected.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    problem: Problem
    chunk_size: int = Field(description="token rows per chunk")
    num_chunks: int = Field(description="cdiv(tokens, chunk_size)")
    vocab_chunk: int = Field(description="vocab columns per tile; equals vocab for row-only geometry")
    num_vocab_chunks: int = Field(description="cdiv(vocab, vocab_chunk)")
    slab_bytes: int = Field(description="bytes of one [chunk_size, vocab_chunk] logits slab")
    accum_dtype: LogitsDType | None = Field(
        default=None, description="grad_weight accumulator across row chunks; None = the problem's dtype"
    )
    grad_weight_filter: float | None = Field(
        default=None,
        description="eps of the grad_weight filter a policy rule set (flce_policy.plan.weight_filter); None = dense",
    )
    grad_weight_filter_rescue: int | None = Field(
        default=None,
        description=(
            "N: a tile the filter skips kept anyway with probability 2^-L (L its octaves below eps, at most "
            "log2(N)), counted 2^L times (unbiased); None = none"
        ),
    )
    slab_form: Literal["logits", "scaled_exp", "scaled_exp_rows", "scaled_exp_ws"] = Field(
        default="logits",
        description="what the slab holds: the logits, or exp(z - m) per column tile from the logits GEMM's "
        "epilogue, or (scaled_exp_rows, where the call allows) exp(z - z_y) per row; scaled_exp_ws: that with a "
        "warp-specialised GEMM on Hopper (flce_policy.plan.scaled_exp)",
    )
    overlap_weight_grad: bool = Field(
        default=False,
        strict=True,
        description="each row chunk's grad_weight GEMM (and grad_bias) on a second CUDA stream beside its grad_input "
        "GEMM: both only read the slab, and grad_weight's read-modify-write of [V, H] is memory-bound where "
        "grad_input's GEMM is compute-bound, so the two may overlap at no memory cost; row-only geometry on the "
        "logits slab without a grad_weight filter; off by default (no gain at 256-512 rows on the H100: "
        "docs/results.md); serial (the same results) on CPU",
    )
    strategy: str = Field(default="manual", description="the strategy (with its parameters) that produced it")
    rule: str | None = Field(default=None, description="the policy rule that chose the strategy, if any")

    @classmethod
    def for_problem(
        cls,
        problem: Problem,
        chunk_size: int,
        *,
        vocab_chunk: int | None = None,
        accum_dtype: str | None = None,
        strategy: str = "manual",
        rule: str | None = None,
        grad_weight_filter: float | None = None,
        grad_weight_filter_rescue: int | None = None,
        slab_form: str = "logits",
        overlap_weight_grad: bool = False,
    ) -> Geometry:
        """The geometry of ``chunk_size`` rows (and ``vocab_chunk`` columns, default all of V)."""
        vocab_chunk = problem.vocab if vocab_chunk is None else vocab_chunk
        _check_extent("chunk_size", chunk_size, problem.tokens, "tokens")
        _check_extent("vocab_chunk", vocab_chunk, problem.vocab, "vocab")
        return cls(
            problem=problem,
            chunk_size=chunk_size,
            num_chunks=cdiv(problem.tokens, chunk_size),
            vocab_chunk=vocab_chunk,
            num_vocab_chunks=cdiv(problem.vocab, vocab_chunk),
            slab_bytes=chunk_size * vocab_chunk * problem.itemsize,
            accum_dtype=accum_dtype,
            grad_weight_filter=grad_weight_filter,
            grad_weight_filter_rescue=grad_weight_filter_rescue,
            slab_form=slab_form,
            overlap_weight_grad=overlap_weight_grad,
            strategy=strategy,
            rule=rule,
        )

    @field_validator("accum_dtype", mode="before")
    @classmethod
    def _normalise_accum_dtype(cls, value: Any) -> Any:
        return normalise_dtype(value)

    @field_validator("grad_weight_filter", mode="before")
    @classmethod
    def _checked_filter(cls, value: Any) -> Any:
        return checked_filter_eps(value)

    @field_validator("grad_weight_filter_rescue", mode="before")
    @classmethod
    def _checked_rescue(cls, value: Any) -> Any:
        return checked_filter_rescue(value)

    @model_validator(mode="after")
    def _consistent(self) -> Geometry:
        check_rescue_has_filter(self.grad_weight_filter, self.grad_weight_filter_rescue)
        p = self.problem
        _check_extent("chunk_size", self.chunk_size, p.tokens, "tokens")
        _check_extent("vocab_chunk", self.vocab_chunk, p.vocab, "vocab")
        expected = {
            "num_chunks": cdiv(p.tokens, self.chunk_size),
            "num_vocab_chunks": cdiv(p.vocab, self.vocab_chunk),
            "slab_bytes": self.chunk_size * self.vocab_chunk * p.itemsize,
        }
        for field, want in expected.items():
            got = getattr(self, field)
            if got != want:
                raise ValueError(
                    f"{field}={got} is inconsistent with chunk_size={self.chunk_size}, "
                    f"vocab_chunk={self.vocab_chunk} for {p.describe()}: expected {want}"
                )
        if is_scaled_exp(self.slab_form):
            why_not = scaled_exp_unsupported(p, self.vocab_chunk)
            if why_not is not None:
                raise ValueError(f"slab_form={self.slab_form!r} cannot run {p.describe()}: {why_not}")
        if self.overlap_weight_grad:
            why_not = _overlap_unsupported(self)
            if why_not is not None:
                raise ValueError(f"overlap_weight_grad=True cannot run {self.describe()}: {why_not}")
        return self

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a logits-slab geometry without the side stream dumps as it always did (explain --json, benchmark records)
        data = handler(self)
        if data.get("slab_form") == "logits":
            del data["slab_form"]
        if data.get("overlap_weight_grad") is False:
            del data["overlap_weight_grad"]
        return data

    @property
    def is_row_only(self) -> bool:
        """True when every chunk spans the whole vocabulary."""
        return self.vocab_chunk == self.problem.vocab

    @property
    def writes_weight_grad_once(self) -> bool:
        """True when each grad_weight element is written by one GEMM (one row chunk), never added to.

        The GEMM accumulates in fp32 internally, so a wider accumulator would add nothing.
        """
        return self.num_chunks == 1

    def accumulator_dtype(self, accum_dtype: Any = None, master_dtype: Any = None) -> str:
        """The dtype of the grad_weight buffer the driver allocates ("bfloat16", "float32", ...).

        ``accum_dtype`` overrides the planned one (None: :attr:`accum_dtype`, itself None = the
        problem's dtype); a geometry that writes grad_weight once needs no wider buffer.
        ``master_dtype`` is the dtype of the weight the gradient is returned for when it differs
        from the problem's (an fp32 master weight under autocast): an fp32 master's gradient is
        accumulated in fp32 directly, never in a low-precision buffer that is cast afterwards.
        """
        master = checked_dtype(master_dtype, "master_dtype") if master_dtype is not None else self.problem.dtype
        if master == "float32" or self.writes_weight_grad_once:
            return master
        accum_dtype = accum_dtype or self.accum_dtype
        return self.problem.dtype if accum_dtype is None else checked_dtype(accum_dtype, "accum_dtype")

    def accum_itemsize(self, accum_dtype: Any = None, master_dtype: Any = None) -> int:
        """Bytes per element of the grad_weight buffer the driver allocates (:meth:`accumulator_dtype`)."""
        return DTYPE_ITEMSIZE[self.accumulator_dtype(accum_dtype, master_dtype)]

    @property
    def last_chunk_size(self) -> int:
        """Rows in the final (possibly shorter) chunk."""
        return self.problem.tokens - (self.num_chunks - 1) * self.chunk_size

    def with_filter(self, grad_weight_filter: float | None, grad_weight_filter_rescue: int | None = None) -> Geometry:
        """A copy whose grad_weight filter is ``grad_weight_filter`` with ``grad_weight_filter_rescue`` (a policy
        rule's; the shape is unchanged)."""
        if (grad_weight_filter, grad_weight_filter_rescue) == (self.grad_weight_filter, self.grad_weight_filter_rescue):
            return self
        eps, rescue = checked_filter_eps(grad_weight_filter), checked_filter_rescue(grad_weight_filter_rescue)
        check_rescue_has_filter(eps, rescue)
        if self.overlap_weight_grad and eps:
            raise ValueError(f"overlap_weight_grad=True cannot run {self.describe()}: {OVERLAP_NO_FILTER}")
        return self.model_copy(update={"grad_weight_filter": eps, "grad_weight_filter_rescue": rescue})

    def with_slab_form(self, slab_form: str) -> Geometry:
        """A copy whose slab holds ``slab_form`` (one of :data:`flce_policy.plan.scaled_exp.SLAB_FORMS`); ValueError
        where it cannot run."""
        if slab_form == self.slab_form:
            return self
        return Geometry.model_validate({**self.model_dump(), "problem": self.problem, "slab_form": slab_form})

    def with_overlap_weight_grad(self, overlap_weight_grad: bool = True) -> Geometry:
        """A copy whose grad_weight GEMM runs on a side stream (or not; :attr:`overlap_weight_grad`); ValueError
        where it cannot run."""
        if overlap_weight_grad == self.overlap_weight_grad:
            return self
        data = {**self.model_dump(), "problem": self.problem, "overlap_weight_grad": overlap_weight_grad}
        return Geometry.model_validate(data)

    def with_origin(self, *, strategy: str | None = None, rule: str | None = None) -> Geometry:
        """A copy whose provenance fields are replaced (the shape is unchanged)."""
        updates: dict[str, Any] = {}
        if strategy is not None:
            updates["strategy"] = strategy
        if rule is not None:
            updates["rule"] = rule
        return self.model_copy(update=updates)

    def check_tensors(self, x: Any, weight: Any, dtype: Any = None) -> None:
        """Raise ValueError unless ``x [BT, H]`` and ``weight [V, H]``, with logits in ``dtype`` (default
        ``x``'s), are the problem this geometry was made for."""
        p = self.problem
        actual = (x.shape[0], x.shape[1], weight.shape[0], normalise_dtype(x.dtype if dtype is None else dtype))
        if (p.tokens, p.hidden, p.vocab, p.dtype) != actual:
            raise ValueError(
                f"geometry was made for {p.describe()} but the tensors are BT={actual[0]} H={actual[1]} "
                f"V={actual[2]} {actual[3]}; resolve a geometry for this problem"
            )

    def describe(self) -> str:
        tiles = "" if self.is_row_only else f" x {self.num_vocab_chunks} vocab tiles of {self.vocab_chunk}"
        accum = "" if self.accum_dtype is None else f", grad_weight accumulated in {self.accum_dtype}"
        if self.grad_weight_filter is not None:
            accum += f", grad_weight filter eps={self.grad_weight_filter:g}"
            if self.grad_weight_filter_rescue is not None:
                accum += f" rescuing by level, at least 1 in {self.grad_weight_filter_rescue}"
        if self.slab_form != "logits":
            accum += f", {self.slab_form.replace('_', '-')} slab"
        if self.overlap_weight_grad:
            accum += ", grad_weight GEMM on a side stream"
        return (
            f"{self.num_chunks} chunks of {self.chunk_size} rows{tiles}, "
            f"slab {format_bytes(self.slab_bytes)}{accum} ({self.strategy})"
        )


#: Why a filtered grad_weight is refused beside the side stream: its path (the flags, the host's read of their
#: count while the grad_input GEMM runs, its scratch) is built for one stream. Eps 0 runs the dense path: allowed.
OVERLAP_NO_FILTER = (
    "the grad_weight filter's flagged GEMM runs on one stream only; drop the filter (grad_weight_filter=None) "
    "or the overlap"
)


def _overlap_unsupported(geometry: Geometry) -> str | None:
    """Why ``geometry`` cannot put its grad_weight GEMM on a side stream, or None where it can."""
    if not geometry.is_row_only:
        return (
            f"the side stream runs row-only geometry (vocab_chunk == vocab={geometry.problem.vocab}); "
            f"vocab_chunk={geometry.vocab_chunk} tiles the vocabulary"
        )
    if geometry.grad_weight_filter:
        return OVERLAP_NO_FILTER
    if is_scaled_exp(geometry.slab_form):
        # kernels/target_grad.py: a 16-bit grad_weight gets the target's term written into the slab, and the
        # row-scaled form x_c times each row's scale, both after the grad_input GEMM read the slab and before
        # grad_weight's GEMM reads it: grad_weight's GEMM could not start before grad_input's ends
        return (
            f"slab_form={geometry.slab_form!r} writes the target's term into the slab (the row-scaled forms also x_c "
            "times each row's scale) after the grad_input GEMM reads it and before grad_weight's GEMM does "
            "(kernels/target_grad.py), so the two GEMMs cannot overlap; the side stream runs the logits slab "
            "(slab_form='logits')"
        )
    return None


def _check_extent(name: str, value: Any, limit: int, limit_name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not 1 <= value <= limit:
        raise ValueError(f"{name} must be between 1 and {limit_name}={limit}, got {value}")
