"""What a loss call does when its slab does not fit: the OOM fallback's settings and its warning.

Kept free of torch so the policy (which plans without a GPU) can hand these settings out; the
retry loop itself is :func:`flce_policy.kernels.resilient.run_with_oom_fallback`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flce_policy.plan.geometry import Geometry

__all__ = ["DEFAULT_MIN_CHUNK_SIZE", "DEFAULT_OOM_FALLBACK", "OOMFallback", "OOMFallbackWarning"]

#: The fallback halves the chunk down to this many rows and no further. Below 64 rows the GEMMs
#: leave most of a tensor-core tile idle while the slab is already small (32 MiB at V=262144 bf16),
#: so an OOM there is not the slab's doing and halving again would only slow the failure down.
DEFAULT_MIN_CHUNK_SIZE = 64


class OOMFallbackWarning(UserWarning):
    """A loss call ran out of memory on its slab and completed at a smaller chunk size."""


@dataclass(frozen=True)
class OOMFallback:
    """Retry at half the rows on ``torch.cuda.OutOfMemoryError``, down to ``min_chunk_size``.

    ``remember(geometry)`` records the geometry that completed, so later calls start from it
    (an :class:`~flce_policy.engine.policy.FLCEPolicy` hands out its ``remember`` bound to the problem
    and device); None when nothing records it. Built per call by the policy, which validated
    ``min_chunk_size`` once, so nothing is checked here.
    """

    min_chunk_size: int = DEFAULT_MIN_CHUNK_SIZE
    remember: Callable[[Geometry], None] | None = None


#: The fallback of a call given a Geometry or a strategy rather than a policy: on, at the default
#: floor, remembering nothing (there is no policy to remember it in).
DEFAULT_OOM_FALLBACK = OOMFallback()
