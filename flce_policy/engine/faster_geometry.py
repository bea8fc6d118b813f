"""explain's hint: a geometry the cost model predicts clearly faster than the chosen one in the same memory.

A strategy that decides rows alone (``SlabBudget("128MiB")``, ``FixedChunkSize(256)``, the OOM fallback's halved
rows) can land where another geometry with the same slab and no larger predicted peak runs faster: at a
128 MiB slab of the Gemma-4 31B head, all rows over vocab tiles of 8192 columns ran 1.446x the floor against
256-row chunks' 1.518x (H100, sustained; results/2026-12-05-h100, ``slab_128mib_vocab_tiles_2026_12_06``).
``explain`` names such a geometry; the loss still runs what the strategy chose.
"""

from __future__ import annotations

from typing import NamedTuple

from flce_policy.plan.cost_model import predict_seconds, rates_for
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.memory import predict_peak
from flce_policy.plan.units import exact_size, format_bytes
from flce_policy.strategies import ChunkStrategy, Fastest
from flce_policy.strategies.base import StrategyError

__all__ = ["FasterGeometry", "HINT_MARGIN", "faster_within"]

#: The least predicted gain that makes a hint: the cost model's time is within a few percent on the H100's small
#: slabs (158.4 ms predicted, 151.4-154.0 measured at 256-row chunks of the Gemma-4 head), so a smaller one could
#: point the wrong way.
HINT_MARGIN = 0.05


class FasterGeometry(NamedTuple):
    """A geometry within the chosen one's slab and predicted peak, and the strategy that picks it."""

    geometry: Geometry
    predicted_s: float
    chosen_s: float
    strategy: Fastest

    def describe(self) -> str:
        g = self.geometry
        tiles = "" if g.is_row_only else f" x {g.num_vocab_chunks} vocab tiles of {g.vocab_chunk}"
        given = {"max_slab": self.strategy.max_slab, "accum": self.strategy.accum, "max_peak": self.strategy.max_peak}
        params = ", ".join(f"{k}={v!r}" for k, v in given.items() if (k, v) != ("accum", "bf16"))
        return (
            f"{g.num_chunks} chunks of {g.chunk_size} rows{tiles} (slab {format_bytes(g.slab_bytes)}, {g.slab_form}): "
            f"{self.predicted_s * 1e3:.1f} ms predicted, {1 - self.predicted_s / self.chosen_s:.0%} less, in no more "
            f"slab or peak: Fastest({params})"
        )


def faster_within(geometry: Geometry, strategy: ChunkStrategy, device: DeviceInfo) -> FasterGeometry | None:
    """The fastest geometry (:class:`Fastest`) within ``geometry``'s slab and predicted peak, where predicted at
    least :data:`HINT_MARGIN` faster than ``geometry``; None otherwise, without a GPU, where ``strategy`` ranks by
    the cost model already, or where the geometry runs what Fastest does not price (a grad_weight filter, a side
    stream, a vocab shard)."""
    problem = geometry.problem
    if (
        not device.is_gpu
        or isinstance(strategy, Fastest)
        or geometry.grad_weight_filter is not None
        or geometry.overlap_weight_grad
        or problem.tp_size > 1
    ):
        return None
    accum = "fp32" if geometry.accum_dtype == "float32" else "bf16"
    peak = exact_size(predict_peak(geometry).total_bytes)
    fastest = Fastest(max_slab=exact_size(geometry.slab_bytes), accum=accum, max_peak=peak)
    try:
        predicted_s, best = fastest.rank(problem, device)[0]
    except StrategyError:  # nothing else fits (the limits are the chosen geometry's own, so rare)
        return None
    chosen_s = predict_seconds(geometry, rates_for(device)).seconds
    if predicted_s > chosen_s * (1 - HINT_MARGIN):
        return None
    return FasterGeometry(best, predicted_s, chosen_s, fastest)
