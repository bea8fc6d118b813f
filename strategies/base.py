"""The strategy contract: one method that picks a chunk size; the base class does the rest."""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from flce_policy.plan.cost_model import DeviceRates, rates_for
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.plan.units import prev_pow2

__all__ = ["ChunkStrategy", "StrategyError", "checked_geometry"]


class StrategyError(ValueError):
    """A strategy's parameters or its answer are invalid; ``param`` names the parameter at fault."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ChunkStrategy(ABC):
    """Decides the row chunk size for a (problem, device).

    Like a scikit-learn estimator, ``__init__`` only stores its keyword parameters under their
    own names, so :meth:`get_params` and the YAML round-trip see exactly what the user wrote.
    Subclasses implement :meth:`pick_chunk_size`; :meth:`geometry` floors the answer to a power of
    two, clamps it to the token count and validates the result.
    """

    #: Short name used in YAML (``strategy: heuristic_c``); user subclasses may leave it unset
    #: and are then referred to by import path.
    name: ClassVar[str | None] = None
    #: True when the answer depends on the moment the call is made (free memory), not only on the
    #: problem, the device and the parameters: a policy, and the loss given the strategy itself,
    #: then ask it on every call instead of caching its geometry.
    dynamic: ClassVar[bool] = False
    #: True when a policy times the strategy's candidates on the loss calls themselves and keeps the fastest
    #: (:class:`~flce_policy.strategies.Measured`); its :meth:`geometry` is then the limit, what runs where
    #: nothing measures.
    measures: ClassVar[bool] = False

    @abstractmethod
    def pick_chunk_size(self, problem: Problem, device: DeviceInfo) -> int:
        """Rows per chunk wanted for ``problem`` on ``device`` (>= 1; need not be a power of two)."""

    def validate_params(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Raise :class:`StrategyError` if a parameter is invalid. Called before any geometry."""

    def decides_slab_form(self) -> bool:
        """True when the strategy's geometries carry a slab form it chose (:class:`ScaledExp`, :class:`Fastest`).
        Otherwise the engine runs its rows in the fastest form the GPU and the call can run
        (:mod:`flce_policy.plan.form_choice`), unless a rule or the call pins one."""
        return False

    def planned_accum_dtype(self) -> str | None:
        """The grad_weight accumulator the strategy plans for ("float32"); None = the weight dtype.

        Its geometries carry it (:attr:`Geometry.accum_dtype`): peak and time are predicted with
        it, and the loss accumulates in it.
        """
        return None

    def planned_rates(self, device: DeviceInfo) -> DeviceRates:
        """The cost-model rates the strategy's decision assumes for ``device`` (the family table)."""
        return rates_for(device)

    def geometry(self, problem: Problem, device: DeviceInfo, *, rule: str | None = None) -> Geometry:
        """The validated geometry this strategy gives for ``problem`` on ``device``."""
        self.validate_params()
        wanted = self.pick_chunk_size(problem, device)
        if isinstance(wanted, bool) or not isinstance(wanted, int):
            raise StrategyError(f"{self!r}.pick_chunk_size() must return an int, got {wanted!r}")
        if wanted < 1:
            raise StrategyError(
                f"{self!r} asked for chunk_size={wanted} for {problem.describe()}; a chunk needs at least 1 row"
            )
        chunk = min(prev_pow2(wanted), problem.tokens)
        return Geometry.for_problem(
            problem, chunk, accum_dtype=self.planned_accum_dtype(), strategy=repr(self), rule=rule
        )

    @classmethod
    def param_names(cls) -> list[str]:
        """The constructor's parameter names: the keys a YAML entry may give beside ``strategy``."""
        return list(_init_param_names(cls.__init__))

    def get_params(self) -> dict[str, Any]:
        """The constructor parameters, read back from the attributes of the same names."""
        params = {}
        for name in self.param_names():
            try:
                params[name] = getattr(self, name)
            except AttributeError:
                raise TypeError(
                    f"{type(self).__qualname__}.__init__ takes a parameter {name!r} but the object has no attribute "
                    f"{name!r}: a ChunkStrategy keeps each constructor parameter under its own name "
                    f"(self.{name} = {name}) so get_params, repr and the YAML round-trip can read it back; "
                    "or override get_params"
                ) from None
        return params

    @classmethod
    def config_name(cls) -> str:
        """How YAML names this strategy: its short name, else ``module:QualName``."""
        return cls.name or f"{cls.__module__}:{cls.__qualname__}"

    def to_config(self) -> dict[str, Any]:
        """``{"strategy": name, **params}``, the YAML form that :func:`strategy_from_config` reads.

        A parameter that is itself a strategy (a cap, say) becomes its own mapping.
        """
        params = {k: v.to_config() if isinstance(v, ChunkStrategy) else v for k, v in self.get_params().items()}
        return {"strategy": self.config_name(), **params}

    def params_key(self) -> str:
        """The class's YAML name and parameters as one string, equal exactly when :meth:`to_config` is:
        what equality, hashing and the loss's geometry cache go by (a mutated parameter is a new key)."""
        return repr(_frozen(self.to_config()))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({params})"

    # Equal when the YAML is: a nested strategy given as an object equals the mapping that builds it.
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.to_config() == self.to_config()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.params_key()))


def checked_geometry(
    strategy: ChunkStrategy, problem: Problem, device: DeviceInfo, *, rule: str | None = None
) -> Geometry:
    """``strategy.geometry(...)``, refusing an answer that is not a Geometry (a subclass overriding
    ``geometry`` wrongly) where it is asked, instead of an AttributeError deep in the loss."""
    geometry = strategy.geometry(problem, device, rule=rule)
    if not isinstance(geometry, Geometry):
        # a StrategyError, as a pick_chunk_size answer that is not an int is: the strategy's answer is invalid
        raise StrategyError(
            f"{type(strategy).__qualname__}.geometry() returned {type(geometry).__name__} {geometry!r:.80}, "
            "not a flce_policy.Geometry; override pick_chunk_size to return rows, or return "
            "Geometry.for_problem(problem, chunk_size, ...) from geometry"
        )
    return geometry


@functools.lru_cache(maxsize=256)
def _init_param_names(init: Any) -> tuple[str, ...]:
    """The parameter names of a constructor, read from its signature once (it is slow to read)."""
    return tuple(
        p.name
        for p in inspect.signature(init).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )


def _frozen(value: Any) -> Any:
    """``value`` with mappings as key-sorted tuples, so equal configs give equal reprs whatever their key order."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


#: The built-in strategies by YAML name. Each built-in module registers its class here with
#: :func:`builtin_strategy` as it is imported (``flce_policy.strategies`` imports them all), so the registry
#: finds them without importing them, and a built-in may use the registry (``free_memory``'s ``cap``).
BUILTIN_STRATEGIES: dict[str, type[ChunkStrategy]] = {}


def builtin_strategy(cls: type[ChunkStrategy]) -> type[ChunkStrategy]:
    """Class decorator: register a built-in strategy under its ``name``."""
    BUILTIN_STRATEGIES[cls.name] = cls  # type: ignore[index]
    return cls
