"""A strategy parameter that is itself a strategy: given as an object, or as its YAML mapping.

``FreeMemory(cap=...)`` and ``Fastest(max_peak=...)`` take one. A mapping is built once through the
registry and built again only when the mapping changes; an error inside it names the parameter
path (``cap.c``), so a policy file's error reads ``devices[2].cap.c``.
"""

from __future__ import annotations

import copy
from typing import Any

from . import registry
from .base import ChunkStrategy, StrategyError

__all__ = ["nested_config", "nested_error", "nested_strategy", "validate_nested"]


def nested_strategy(owner: ChunkStrategy, param: str) -> ChunkStrategy | None:
    """``owner.<param>`` as a strategy (None when it is None); StrategyError naming ``param`` otherwise."""
    value = getattr(owner, param)
    if value is None or isinstance(value, ChunkStrategy):
        return value
    if not isinstance(value, dict):
        raise StrategyError(
            f"{owner.config_name()}: {param} must be a strategy mapping such as {{strategy: heuristic_c, c: 16}}, "
            f"a ChunkStrategy, or null; got {value!r}",
            param=param,
        )
    cache_key = f"_built_{param}"
    built = owner.__dict__.get(cache_key)
    if built is None or built[0] != value:
        try:
            built = (copy.deepcopy(value), registry.strategy_from_config(value))
        except StrategyError as err:
            raise nested_error(err, owner.config_name(), param, value.get("strategy")) from None
        owner.__dict__[cache_key] = built
    return built[1]


def validate_nested(owner: ChunkStrategy, param: str) -> None:
    """Build ``owner.<param>`` and check its own parameters, errors named under ``param``."""
    inner = nested_strategy(owner, param)
    if inner is None:
        return
    try:
        inner.validate_params()
    except StrategyError as err:
        raise nested_error(err, owner.config_name(), param, inner.config_name()) from None


def nested_error(err: StrategyError, owner_name: str, param: str, inner_name: Any) -> StrategyError:
    """The inner strategy's error, its parameter prefixed with ``param.``."""
    message = str(err).removeprefix(f"{inner_name}: ")
    if err.param is not None:
        message = message.removeprefix(f"{err.param}: ")
    path = param if err.param is None else f"{param}.{err.param}"
    return StrategyError(f"{owner_name}: {path}: {message}", param=path)


def nested_config(owner: ChunkStrategy, param: str, config: dict[str, Any]) -> None:
    """Write a mapping-valued ``param`` into ``config`` as the built strategy writes itself (defaults filled in)."""
    if isinstance(getattr(owner, param), dict):
        try:
            config[param] = nested_strategy(owner, param).to_config()  # type: ignore[union-attr]
        except StrategyError:
            pass  # kept as written; validate_params reports what is wrong with it
