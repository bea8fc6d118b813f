"""The largest chunk whose slab fits in what the GPU can give now, optionally under another strategy's cap."""

from __future__ import annotations

import math
from typing import Any

import torch

from flce_policy.plan import memory_now
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.memory import held_beside_slab
from flce_policy.plan.problem import Problem, checked_dtype
from flce_policy.plan.units import format_bytes, parse_bytes

from .base import ChunkStrategy, StrategyError, builtin_strategy, checked_geometry
from .nested import nested_config, nested_strategy, validate_nested

__all__ = ["FreeMemory", "NotEnoughFreeMemoryError"]


class NotEnoughFreeMemoryError(StrategyError, torch.cuda.OutOfMemoryError):
    """Not even one row of logits fits in what :class:`FreeMemory` finds available at call time.

    An out-of-memory condition, so it is a ``torch.cuda.OutOfMemoryError`` (a training loop that
    skips or shrinks a batch on OOM catches it), and a :class:`StrategyError` as the strategy's
    other errors are. It is raised while the geometry is decided, before the loss allocates
    anything, so it reaches the caller as is: the OOM fallback, which halves a slab that failed
    to allocate, never sees it (halving cannot help when less than one row fits the budget).
    """


@builtin_strategy
class FreeMemory(ChunkStrategy):
    """The slab sized at call time from live memory: ``fraction`` of what ``reserve`` and the call's buffers leave.

    available = free device memory + the caching allocator's reserved-but-unallocated bytes
    (read on every call, :func:`flce_policy.plan.memory_now.available_bytes`); from it go ``reserve``
    (bytes or "1GiB", kept for the rest of the step) and the buffers the call holds beside the
    slab (gradients, per-row outputs; :func:`flce_policy.plan.memory.held_beside_slab`, with the
    grad_weight accumulator in ``accum_dtype``, which the geometry carries to the loss: "float32"
    for fp32-accurate weight gradients). The slab gets ``fraction`` of the rest.

    ``cap`` bounds the answer by another strategy's: ``FreeMemory(cap=HeuristicC(16))`` is Liger's
    C=16 unless less fits now. In YAML it is that strategy's mapping (``cap: {strategy:
    heuristic_c, c: 16}``); in code, a strategy object or the mapping.

    When not even one row fits, :class:`NotEnoughFreeMemoryError` (a ``torch.cuda.OutOfMemoryError``)
    names what was available, the reserve, the buffers and what would be needed.
    """

    name = "free_memory"
    dynamic = True

    def __init__(
        self,
        fraction: float = 0.5,
        reserve: int | str = "1GiB",
        cap: ChunkStrategy | dict[str, Any] | None = None,
        accum_dtype: str | None = None,
    ) -> None:
        self.fraction = fraction
        self.reserve = reserve
        self.cap = cap
        self.accum_dtype = accum_dtype

    @property
    def reserve_bytes(self) -> int:
        try:
            return parse_bytes(self.reserve)
        except ValueError as err:
            raise StrategyError(f"free_memory: reserve: {err}", param="reserve") from None

    def validate_params(self) -> None:
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise StrategyError(f"free_memory: fraction must be a number in (0, 1], got {fraction!r}", param="fraction")
        self.reserve_bytes  # noqa: B018 - parses, raising StrategyError on a bad size
        if self.accum_dtype is not None:
            try:
                checked_dtype(self.accum_dtype, "accum_dtype")
            except ValueError as err:
                raise StrategyError(f"free_memory: {err}; or null (the weight dtype)", param="accum_dtype") from None
        validate_nested(self, "cap")

    def planned_accum_dtype(self) -> str | None:
        return self.accum_dtype

    def cap_strategy(self) -> ChunkStrategy | None:
        """``cap`` as a strategy: built once from a mapping (and again only if the mapping changes)."""
        return nested_strategy(self, "cap")

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        """Rows whose slab fits in ``fraction`` of what is available now (the cap aside)."""
        try:
            available = memory_now.available_bytes(device)
        except ValueError as err:
            raise StrategyError(f"free_memory: {err}") from None
        reserve = self.reserve_bytes
        held = held_beside_slab(problem, accum_dtype=self.accum_dtype)
        budget = math.floor(self.fraction * (available - reserve - held))
        row_bytes = problem.vocab * problem.itemsize
        if budget < row_bytes:
            needed = reserve + held + math.ceil(row_bytes / self.fraction)
            raise NotEnoughFreeMemoryError(
                f"free_memory: {format_bytes(available)} available on {device.name}, less the reserve "
                f"{format_bytes(reserve)} and {format_bytes(held)} of gradients and per-row buffers for "
                f"{problem.describe()}, times fraction={self.fraction}, leaves {format_bytes(max(budget, 0))} "
                f"for the slab; one row of logits needs {format_bytes(row_bytes)}, so at least "
                f"{format_bytes(needed)} must be available"
            )
        return budget // row_bytes

    def geometry(self, problem: Problem, device: DeviceInfo, *, rule: str | None = None) -> Geometry:
        """The geometry that fits now, or the cap's when that has fewer rows."""
        fits = super().geometry(problem, device, rule=rule)
        cap = self.cap_strategy()
        if cap is None:
            return fits
        capped = checked_geometry(cap, problem, device, rule=rule)
        if fits.chunk_size <= capped.chunk_size:
            return fits
        # the cap's shape, with this strategy's accumulator (the one its memory budget assumed)
        return Geometry.for_problem(
            problem,
            capped.chunk_size,
            vocab_chunk=capped.vocab_chunk,
            accum_dtype=self.planned_accum_dtype(),
            strategy=repr(self),
            rule=rule,
        )

    def to_config(self) -> dict[str, Any]:
        config = super().to_config()
        nested_config(self, "cap", config)
        return config
