"""Pluggable chunk strategies: each decides the row chunk size for a (problem, device).

May import: :mod:`flce_policy.plan` (the terms they reason in and the models that price a geometry); never
the engine that asks them, the kernels or anything above.
"""

if __name__ == "strategies":  # imported from the repository root: yield to an installed `strategies` (docs/layout.md)
    from flce_policy.top_level_names import hand_over

    hand_over(__name__, __path__[0])
else:
    from .base import ChunkStrategy, StrategyError, checked_geometry
    from .by_hidden import ByHidden
    from .fastest import Fastest
    from .fixed_chunk_size import FixedChunkSize
    from .free_memory import FreeMemory, NotEnoughFreeMemoryError
    from .heuristic_c import HeuristicC
    from .measured import Measured
    from .memory_rule import MemoryRule
    from .registry import BUILTIN_STRATEGIES, strategy_class, strategy_from_config
    from .scaled_exp import ScaledExp
    from .slab_budget import SlabBudget

__all__ = [
    "ChunkStrategy",
    "StrategyError",
    "checked_geometry",
    "HeuristicC",
    "FixedChunkSize",
    "SlabBudget",
    "FreeMemory",
    "NotEnoughFreeMemoryError",
    "Fastest",
    "ScaledExp",
    "ByHidden",
    "Measured",
    "MemoryRule",
    "BUILTIN_STRATEGIES",
    "strategy_class",
    "strategy_from_config",
]
