"""Another strategy's chunks on the scaled-exp slab, where the problem and the GPU can run it."""

from __future__ import annotations

from typing import Any

from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.plan.scaled_exp import is_scaled_exp, runnable_slab_form

from .base import ChunkStrategy, StrategyError, builtin_strategy, checked_geometry
from .nested import nested_config, nested_strategy, validate_nested

__all__ = ["ScaledExp", "on_slab_form"]


@builtin_strategy
class ScaledExp(ChunkStrategy):
    """``inner``'s geometry with ``slab_form="scaled_exp"`` (:mod:`flce_policy.plan.scaled_exp`): the logits
    GEMM's epilogue stores ``exp(z - m)`` per 256 columns, for gradients without the logits' bf16 rounding
    and one pass less over the slab. Where the problem cannot run it (fp32, vocab tiles, a vocab shard,
    H or V not a multiple of 8) or the GPU is older than Hopper, ``inner``'s geometry as it is.

    With ``rows=True`` the geometry's slab form is ``"scaled_exp_rows"``: where the call has no bias or label
    smoothing the slab holds ``exp(z - z_y)`` per row and no CE pass rewrites it (the backward GEMMs scale its
    rows; :func:`flce_policy.plan.scaled_exp.row_scaled`).

    With ``warp_specialised=True`` too (it needs ``rows``) the slab form is ``"scaled_exp_ws"``: the row-scaled
    form whose logits GEMM is a warp-specialised Gluon kernel on Hopper (sm_90; a later GPU runs
    ``"scaled_exp_rows"``). ``ws_max_hidden`` (None: no limit) keeps heads of a larger hidden size on
    ``"scaled_exp_rows"``: the Gluon kernel's 128x128 tiles gain at short K (the hidden size) and lose a little to
    the Triton GEMM's 128x256 at long K. ``ws_inner`` (None: ``inner``) chunks the heads that ask for the
    warp-specialised GEMM (hidden size up to ``ws_max_hidden``), whichever form the GPU then runs: at a short K a
    chunk's fixed costs (grad_weight's read-modify-write of ``[V, H]``) weigh more against its GEMMs.

    YAML: ``{strategy: scaled_exp, inner: {strategy: slab_budget, max_slab: 2GiB}}`` (and ``rows: true``,
    ``warp_specialised: true``, ``ws_max_hidden: 3072``, ``ws_inner: {strategy: fixed_chunk_size, chunk_size: 8192}``).
    """

    name = "scaled_exp"

    def __init__(
        self,
        inner: ChunkStrategy | dict[str, Any],
        rows: bool = False,
        warp_specialised: bool = False,
        ws_max_hidden: int | None = None,
        ws_inner: ChunkStrategy | dict[str, Any] | None = None,
    ) -> None:
        self.inner = inner
        self.rows = rows
        self.warp_specialised = warp_specialised
        self.ws_max_hidden = ws_max_hidden
        self.ws_inner = ws_inner

    def validate_params(self) -> None:
        if self.inner is None:
            raise StrategyError(
                "scaled_exp: inner must be a strategy, e.g. {strategy: heuristic_c, c: 16}", param="inner"
            )
        if not isinstance(self.rows, bool):
            raise StrategyError(f"scaled_exp: rows must be true or false, got {self.rows!r}", param="rows")
        if not isinstance(self.warp_specialised, bool):
            raise StrategyError(
                f"scaled_exp: warp_specialised must be true or false, got {self.warp_specialised!r}",
                param="warp_specialised",
            )
        if self.warp_specialised and not self.rows:
            raise StrategyError(
                "scaled_exp: warp_specialised: true needs rows: true (the warp-specialised GEMM is the row-scaled "
                "form's)",
                param="warp_specialised",
            )
        limit = self.ws_max_hidden
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise StrategyError(
                f"scaled_exp: ws_max_hidden must be a positive integer (a hidden size) or null, got {limit!r}",
                param="ws_max_hidden",
            )
        if limit is not None and not self.warp_specialised:
            raise StrategyError(
                "scaled_exp: ws_max_hidden limits the warp-specialised GEMM: it needs warp_specialised: true",
                param="ws_max_hidden",
            )
        if self.ws_inner is not None and not self.warp_specialised:
            raise StrategyError(
                "scaled_exp: ws_inner chunks the heads on the warp-specialised GEMM: it needs warp_specialised: true",
                param="ws_inner",
            )
        for param in ("inner", "ws_inner"):
            validate_nested(self, param)
            chosen = nested_strategy(self, param)
            if chosen is not None and chosen.dynamic:
                raise StrategyError(
                    f"scaled_exp: {param} must decide from the problem and the device alone (a strategy that reads "
                    "free memory at each call is asked by the policy itself)",
                    param=param,
                )

    def decides_slab_form(self) -> bool:
        return True

    def _asks_ws(self, problem: Problem) -> bool:
        """Whether ``problem``'s head asks for the warp-specialised GEMM (its hidden size within the limit)."""
        return self.warp_specialised and (self.ws_max_hidden is None or problem.hidden <= self.ws_max_hidden)

    def _chunking(self, problem: Problem) -> ChunkStrategy:
        """The strategy that chunks ``problem``: ``ws_inner`` for a head asking for the Gluon GEMM, if given."""
        ws_inner = nested_strategy(self, "ws_inner") if self._asks_ws(problem) else None
        return ws_inner if ws_inner is not None else nested_strategy(self, "inner")  # type: ignore[return-value]

    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        return self._chunking(problem).pick_chunk_size(problem, device)

    def geometry(self, problem: Problem, device: DeviceInfo, *, rule: str | None = None) -> Geometry:
        self.validate_params()
        inner = checked_geometry(self._chunking(problem), problem, device, rule=rule)
        ws = self._asks_ws(problem)
        wanted = "scaled_exp_ws" if ws else "scaled_exp_rows" if self.rows else "scaled_exp"
        form = runnable_slab_form(wanted, problem, inner.vocab_chunk, device)
        return inner.with_slab_form(form).with_origin(strategy=repr(self))

    def to_config(self) -> dict[str, Any]:
        config = super().to_config()
        nested_config(self, "inner", config)
        for param in ("ws_max_hidden", "ws_inner"):  # unset: the YAML as before the key existed
            if config.get(param) is None:
                config.pop(param, None)
        if self.ws_inner is not None:
            nested_config(self, "ws_inner", config)
        return config


def on_slab_form(strategy: ChunkStrategy, slab_form: str) -> ChunkStrategy:
    """``strategy``, wrapped in ``scaled_exp`` for a scaled-exp slab form (``rows`` for the row-scaled ones,
    ``warp_specialised`` for ``"scaled_exp_ws"``)."""
    if not is_scaled_exp(slab_form):
        return strategy
    ws = slab_form == "scaled_exp_ws"
    return ScaledExp(strategy, rows=ws or slab_form == "scaled_exp_rows", warp_specialised=ws)
