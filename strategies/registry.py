"""Strategy lookup by short name (built-ins) or import path (``mypkg.rules:MyStrategy``).

The built-ins register themselves in :data:`~flce_policy.strategies.base.BUILTIN_STRATEGIES` as they are
imported: this module imports none of them, so one may use it (``free_memory`` builds its ``cap`` here).
"""

from __future__ import annotations

import importlib
import inspect
import re
import traceback
from collections.abc import Mapping
from typing import Any

from .base import BUILTIN_STRATEGIES, ChunkStrategy, StrategyError

__all__ = ["BUILTIN_STRATEGIES", "strategy_class", "strategy_from_config"]

# A module or attribute path as Python spells one: identifiers joined by single dots.
_DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


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
    if not (_DOTTED_NAME.fullmatch(module_name) and _DOTTED_NAME.fullmatch(attr_path)):
        raise StrategyError(
            f"strategy {name!r}: an import path is 'package.module:Class', an absolute module path and a class "
            "name, each of dotted Python identifiers (no leading dots, nothing empty)"
        )
    obj: Any = _import_user_module(name, module_name)
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise StrategyError(f"strategy {name!r}: module {module_name!r} has no attribute {attr_path!r}") from None
    if not (inspect.isclass(obj) and issubclass(obj, ChunkStrategy)) or inspect.isabstract(obj):
        raise StrategyError(f"strategy {name!r} is not a concrete subclass of flce_policy.strategies.ChunkStrategy")
    return obj


def _import_user_module(name: str, module_name: str) -> Any:
    """Import the module of a strategy given by import path: the user's code, so any error it raises
    on import (a syntax error, an exception at top level) becomes one StrategyError naming its file."""
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        # the module itself not found (not one it imports): most often its folder is not on sys.path
        hint = ""
        if isinstance(err, ModuleNotFoundError) and f"{module_name}.".startswith(f"{err.name}."):
            hint = " (is the folder holding it on the import path? e.g. run with PYTHONPATH=that_folder)"
        raise StrategyError(f"strategy {name!r}: cannot import module {module_name!r}: {err}{hint}") from None
    except SyntaxError as err:
        where = f"{err.filename}, line {err.lineno}" if err.filename else "its source"
        raise StrategyError(
            f"strategy {name!r}: module {module_name!r} has a syntax error ({where}): {err.msg}"
        ) from None
    except Exception as err:  # noqa: BLE001 - whatever the user's module raises at import, said on one line
        frame = traceback.extract_tb(err.__traceback__)[-1]
        raise StrategyError(
            f"strategy {name!r}: importing module {module_name!r} raised {type(err).__name__}: {_one_line(err)} "
            f"({frame.filename}, line {frame.lineno})"
        ) from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def strategy_from_config(config: Mapping[str, Any]) -> ChunkStrategy:
    """Build and validate a strategy from ``{"strategy": name, **params}``."""
    if not isinstance(config, Mapping):
        raise TypeError(
            f"strategy_from_config expects a mapping {{'strategy': name, **params}}, got {config!r}"
            + (f"; for a name alone write {{'strategy': {config!r}}}" if isinstance(config, str) else "")
        )
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
        strategy.get_params()  # a parameter kept under another name: said here, where the file names the strategy
    except TypeError as err:
        raise StrategyError(f"strategy {name!r}: {err}") from None
    strategy.validate_params()
    return strategy
