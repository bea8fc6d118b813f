"""A strategy's geometry with its slab form: the strategy decides the rows, the engine the form.

Where the strategy chose no form (:meth:`~flce_policy.strategies.ChunkStrategy.decides_slab_form`) and nothing
pins one, the rows run in the fastest form the GPU and the problem can run
(:func:`flce_policy.plan.form_choice.choose_slab_form`); a pin (a rule's or the call's ``slab_form``) runs that
form, or the next one down where it cannot run.
"""

from __future__ import annotations

import functools

from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.form_choice import FormChoice, choose_slab_form, pinned_slab_form
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem
from flce_policy.strategies import ChunkStrategy, checked_geometry

__all__ = ["form_choice", "planned_geometry"]


def form_choice(
    strategy: ChunkStrategy, geometry: Geometry, device: DeviceInfo, slab_form: str | None = None
) -> FormChoice:
    """The form ``geometry`` (``strategy``'s answer) runs on ``device``, and why; ``slab_form`` pins one."""
    if slab_form is not None:
        return pinned_slab_form(slab_form, geometry, device)
    if strategy.decides_slab_form() or geometry.slab_form != "logits":
        return FormChoice(geometry.slab_form, f"the strategy's ({type(strategy).__name__})")
    return choose_slab_form(geometry, device, strategy.planned_rates(device))


def planned_geometry(
    strategy: ChunkStrategy,
    problem: Problem,
    device: DeviceInfo,
    *,
    rule: str | None = None,
    slab_form: str | None = None,
) -> Geometry:
    """``strategy``'s geometry for ``problem`` on ``device``, in the form :func:`form_choice` gives."""
    geometry = checked_geometry(strategy, problem, device, rule=rule)
    return _in_form(geometry, form_choice(strategy, geometry, device, slab_form).slab_form)


@functools.lru_cache(maxsize=1024)
def _in_form(geometry: Geometry, slab_form: str) -> Geometry:
    """``geometry`` on ``slab_form``'s slab, validated once per distinct geometry (a dynamic strategy asks per call)."""
    return geometry.with_slab_form(slab_form)
