"""Strategy lookup by short name (built-ins) or import path (``mypkg.rules:MyStrategy``)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from .base import ChunkStrategy, StrategyError
from .fastest import Fastest
from .fixed_chunk_size import FixedChunkSize
from .free_memory import FreeMemory
from .heuristic_c import HeuristicC
from .slab_budget import SlabBudget

__all__ = ["BUILTIN_STRATEGIES", "strategy_class", "strategy_from_config"]

BUILTIN_STRATEGIES: dict[str, type[ChunkStrategy]] = {
    cls.name: cls
    for cls in (HeuristicC, FixedChunkSize, SlabBudget, FreeMemory, Fastest)  # type: ignore[misc]
}


def strategy_class(name: str) -> type[ChunkStrategy]:
    """The strategy class a YAML ``strategy:`` value names."""
    if not isinstance(name, str) or not name.strip():
        raise StrategyError(f"a strategy name must be a non-empty string, got {name!r}")
    if name in BUILTIN_STRATEGIES:
        return BUILTIN_STRATEGIES[name]
    if ":" not in name:
        known = ", ".join(sorted(BUILTIN_STRATEGIES))
        raise StrategyError(
            f"unknown strategy {name!r}; built-ins are {known}, or give a class by import path 'package.module:Class'"
        )
    module_name, _, attr_path = name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise StrategyError(f"strategy {name!r}: cannot import module {module_name!r}: {err}") from None
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise StrategyError(f"strategy {name!r}: module {module_name!r} has no attribute {attr_path!r}") from None
    if not (inspect.isclass(obj) and issubclass(obj, ChunkStrategy)) or inspect.isabstract(obj):
        raise StrategyError(f"strategy {name!r} is not a concrete subclass of flce_policy.strategies.ChunkStrategy")
    return obj


def strategy_from_config(config: dict[str, Any]) -> ChunkStrategy:
    """Build and validate a strategy from ``{"strategy": name, **params}``."""
    params = dict(config)
    name = params.pop("strategy", None)
    if name is None:
        raise StrategyError("missing key 'strategy'")
    cls = strategy_class(name)
    accepted = cls.param_names()
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise StrategyError(
            f"strategy {name!r} got unknown parameter(s) {', '.join(unknown)}; "
            f"it accepts: {', '.join(accepted) or 'none'}",
            param=unknown[0],
        )
    signature = inspect.signature(cls.__init__)
    for key in accepted:
        if key not in params and signature.parameters[key].default is inspect.Parameter.empty:
            raise StrategyError(f"{name}: required parameter {key!r} is missing", param=key)
    try:
        strategy = cls(**params)
    except TypeError as err:
        raise StrategyError(f"strategy {name!r}: {err}") from None
    strategy.validate_params()
    return strategy
