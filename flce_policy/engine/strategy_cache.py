"""The geometry of a strategy handed to the loss itself (``policy=SlabBudget(...)``), cached.

An :class:`~flce_policy.engine.policy.FLCEPolicy` caches its decisions per (problem, device); a strategy
given directly would otherwise be asked, validated and its Geometry built on every loss call
(0.05 ms for SlabBudget, milliseconds for Fastest's search). The cache keys on the strategy's
class and parameters (:meth:`~flce_policy.strategies.ChunkStrategy.params_key`), not on the
object: strategies are scikit-learn-style objects whose parameters a user may set at any time,
and a changed parameter is then a new key rather than a stale answer. A dynamic strategy (one
reading free memory) is asked on every call. Entries hold no strategy, only its class, and the
cache is cleared when full, so a long run with changing shapes or parameters cannot grow it
without bound.
"""

from __future__ import annotations

from flce_policy.engine.planned import planned_geometry
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.strategies import ChunkStrategy

__all__ = ["strategy_geometry", "clear_strategy_cache"]

# A key per (strategy parameters, problem, device); dynamic shapes add one per token count. Refilling
# after a clear costs one strategy call per key.
_CACHE_LIMIT = 1024
_cache: dict[tuple[type, str, Problem, DeviceInfo], Geometry] = {}


def strategy_geometry(strategy: ChunkStrategy, problem: Problem, device: DeviceInfo) -> Geometry:
    """``strategy``'s geometry in the form the engine gives it (:func:`~flce_policy.engine.planned.planned_geometry`),
    asked once per parameters, problem and device unless dynamic."""
    if strategy.dynamic:
        return planned_geometry(strategy, problem, device)
    key = (type(strategy), strategy.params_key(), problem, device)
    geometry = _cache.get(key)
    if geometry is None:
        geometry = planned_geometry(strategy, problem, device)  # an invalid strategy raises here, never stored
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = geometry
    return geometry


def clear_strategy_cache() -> None:
    """Forget every cached geometry (a strategy whose answer changed without a parameter changing, say)."""
    _cache.clear()
