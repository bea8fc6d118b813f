"""FLCEPolicy: a default strategy plus ordered per-device rules, resolved to a Geometry per (problem, device)."""

from __future__ import annotations

import fnmatch
import functools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any, NamedTuple

from flce_policy.engine.clock import Clock, clock_for
from flce_policy.engine.config import (
    CONFIG_VERSION,
    ConfigError,
    dump_yaml,
    load_yaml_file,
    load_yaml_text,
    parse_config,
)
from flce_policy.engine.measured_entry import MeasuredEntry, Trial
from flce_policy.engine.measured_head import MeasuredHead
from flce_policy.engine.planned import form_choice, planned_geometry
from flce_policy.plan.collectives import comm_plan
from flce_policy.plan.cost_model import predict_seconds
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.form_choice import checked_slab_form
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.measuring import bucket_label, bucket_problem
from flce_policy.plan.memory import gathered_head_bytes, predict_peak
from flce_policy.plan.oom import DEFAULT_MIN_CHUNK_SIZE, OOMFallback
from flce_policy.plan.problem import Problem
from flce_policy.plan.scaled_exp import (
    SCALED_EXP_TILE,
    SOFTCAP_LIMIT,
    WS_TILE,
    call_form,
    is_scaled_exp,
)
from flce_policy.plan.units import format_bytes, parse_bytes
from flce_policy.plan.weight_filter import (
    FILTER_COLS,
    FILTER_ROWS,
    FilterRest,
    check_rescue_has_filter,
    checked_filter_eps,
    checked_filter_rescue,
)
from flce_policy.plan.weight_grad_gemm import planned_weight_grad_gemm
from flce_policy.strategies import ChunkStrategy, HeuristicC

__all__ = ["CONFIG_ENV_VAR", "DEFAULT_RULE", "DeviceRule", "FLCEPolicy", "softcapped_geometry"]

#: Names a user policy file that :meth:`FLCEPolicy.default` loads instead of the packaged one.
CONFIG_ENV_VAR = "FLCE_POLICY_CONFIG"
#: The rule description of a decision no device rule made.
DEFAULT_RULE = "default"
_PACKAGED_SOURCE = "<packaged default.yaml>"
# Dynamic shapes (varying BT per step) add a key per distinct token count; the cap keeps a long run
# from growing the cache without bound, and refilling it costs one strategy call per shape.
_CACHE_LIMIT = 4096


class _AskEachCall(NamedTuple):
    """The cache entry of a dynamic strategy: which one to ask, and the most rows known to fit.

    ``ceiling`` is the geometry an OOM fallback completed at: the strategy's answer is used
    while it asks for no more rows than that, so a step never pays a known failure again.
    """

    rule: str
    strategy: ChunkStrategy
    ceiling: Geometry | None = None
    grad_weight_filter: float | None = None  # the rule's, set on every geometry the strategy answers
    grad_weight_filter_rescue: int | None = None
    slab_form: str | None = None  # the rule's pin, if any

    def geometry(self, problem: Problem, device: DeviceInfo) -> Geometry:
        geometry = planned_geometry(self.strategy, problem, device, rule=self.rule, slab_form=self.slab_form)
        if self.ceiling is not None and geometry.chunk_size > self.ceiling.chunk_size:
            return self.ceiling
        return geometry.with_filter(self.grad_weight_filter, self.grad_weight_filter_rescue)


@dataclass(frozen=True)
class DeviceRule:
    """Use ``strategy`` on devices that ``match`` and whose total memory lies within the optional bounds.

    ``match`` equals a :attr:`DeviceInfo.family` (case-insensitive, e.g. ``"H100"``, ``"cpu"``), or is
    an fnmatch glob on :attr:`DeviceInfo.name` (case-insensitive, e.g. ``"NVIDIA H100*"``). ``"*"``
    matches every device, the CPU fallback included; write ``match: cpu`` to single that out.
    Memory bounds are bytes or strings such as ``"200GiB"``, inclusive, kept as written.
    ``grad_weight_filter``: the eps of the grad_weight filter on those devices (None: dense), which a
    loss call's own ``grad_weight_filter`` overrides (flce_policy.plan.weight_filter); ``grad_weight_filter_rescue``
    its rescue N (needs the eps; the call's keyword overrides it too). ``slab_form``: pins the slab form on those
    devices (one of :data:`~flce_policy.plan.scaled_exp.SLAB_FORMS`; None: the fastest the GPU runs,
    :mod:`flce_policy.plan.form_choice`), which a loss call's own ``slab_form`` overrides.
    """

    match: str
    strategy: ChunkStrategy
    min_total_memory: int | str | None = field(default=None, kw_only=True)
    max_total_memory: int | str | None = field(default=None, kw_only=True)
    grad_weight_filter: float | None = field(default=None, kw_only=True)
    grad_weight_filter_rescue: int | None = field(default=None, kw_only=True)
    slab_form: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        checked_slab_form(self.slab_form, "DeviceRule.slab_form")
        if not isinstance(self.match, str) or not self.match.strip():
            raise ValueError(f"DeviceRule.match must be a non-empty family or glob, got {self.match!r}")
        if not isinstance(self.strategy, ChunkStrategy):
            raise TypeError(f"DeviceRule.strategy must be a ChunkStrategy, got {self.strategy!r}")
        self.strategy.validate_params()
        self.strategy.get_params()  # a parameter kept under another name is refused here, not at first use
        object.__setattr__(self, "grad_weight_filter", checked_filter_eps(self.grad_weight_filter))
        object.__setattr__(self, "grad_weight_filter_rescue", checked_filter_rescue(self.grad_weight_filter_rescue))
        check_rescue_has_filter(self.grad_weight_filter, self.grad_weight_filter_rescue, "DeviceRule: ")
        low = None if self.min_total_memory is None else parse_bytes(self.min_total_memory)
        high = None if self.max_total_memory is None else parse_bytes(self.max_total_memory)
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"min_total_memory {self.min_total_memory!r} exceeds max_total_memory {self.max_total_memory!r}"
            )
        # Parsed once here so matching on the hot path compares ints.
        object.__setattr__(self, "_bounds", (low, high))
        object.__setattr__(self, "_lower", self.match.lower())

    def names(self, device: DeviceInfo) -> bool:
        """Whether ``match`` names ``device`` (its family, or a glob on its name), memory bounds aside."""
        pattern: str = self._lower  # type: ignore[attr-defined]
        return pattern == device.family.lower() or fnmatch.fnmatchcase(device.name.lower(), pattern)

    def matches(self, device: DeviceInfo) -> bool:
        """Whether this rule applies to ``device``: it is named and its total memory is within bounds."""
        if not self.names(device):
            return False
        low, high = self._bounds  # type: ignore[attr-defined]
        total = device.total_memory_bytes
        return (low is None or total >= low) and (high is None or total <= high)

    def describe(self) -> str:
        """``match H100`` plus any memory bounds, as written."""
        text = f"match {self.match}"
        if self.min_total_memory is not None:
            text += f", total memory >= {self.min_total_memory}"
        if self.max_total_memory is not None:
            text += f", total memory <= {self.max_total_memory}"
        return text

    def to_config(self) -> dict[str, Any]:
        """The YAML ``devices`` entry: rule keys, then ``strategy`` and its parameters."""
        entry: dict[str, Any] = {"match": self.match}
        for key in (
            "min_total_memory",
            "max_total_memory",
            "grad_weight_filter",
            "grad_weight_filter_rescue",
            "slab_form",
        ):
            if getattr(self, key) is not None:
                entry[key] = getattr(self, key)
        return {**entry, **self.strategy.to_config()}


class FLCEPolicy:
    """A default strategy plus ordered device rules; the first rule that matches a device wins.

    Build one in code, ``FLCEPolicy(default=HeuristicC(1), rules=[DeviceRule("H100", SlabBudget("1GiB"))])``,
    or from YAML (:meth:`from_yaml`, :meth:`default`). :meth:`resolve` caches its answer per
    (problem, device), so treat a policy as immutable once in use (or call :meth:`clear_cache`);
    a dynamic strategy (one reading free memory) is asked on every call instead.
    ``oom_fallback``: a loss call whose slab runs out of memory is retried at half the rows, down
    to ``min_chunk_size``, and the geometry that completed is remembered (:meth:`remember`).
    ``grad_weight_filter``, ``grad_weight_filter_rescue``: the default rule's grad_weight filter eps (None: dense)
    and its rescue N (None: none); a device rule sets its own.
    Equality compares content (strategies, rules, OOM settings), not where the policy was loaded from.
    """

    def __init__(
        self,
        *,
        default: ChunkStrategy | None = None,
        rules: Sequence[DeviceRule] = (),
        source: str = "<code>",
        oom_fallback: bool = True,
        min_chunk_size: int = DEFAULT_MIN_CHUNK_SIZE,
        grad_weight_filter: float | None = None,
        grad_weight_filter_rescue: int | None = None,
        slab_form: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.default_slab_form = checked_slab_form(slab_form, "FLCEPolicy: slab_form")
        self.clock = clock
        self.default_grad_weight_filter = checked_filter_eps(grad_weight_filter)
        self.default_grad_weight_filter_rescue = checked_filter_rescue(grad_weight_filter_rescue)
        check_rescue_has_filter(self.default_grad_weight_filter, self.default_grad_weight_filter_rescue, "FLCEPolicy: ")
        self.default_strategy: ChunkStrategy = HeuristicC(c=1) if default is None else default
        if not isinstance(self.default_strategy, ChunkStrategy):
            raise TypeError(f"default must be a ChunkStrategy, got {self.default_strategy!r}")
        self.default_strategy.validate_params()
        self.default_strategy.get_params()  # a parameter kept under another name is refused here, not at first use
        if isinstance(rules, (str, bytes, DeviceRule)) or not isinstance(rules, Iterable):
            raise TypeError(f"rules must be a list of DeviceRule objects, got {rules!r}")
        self.rules: tuple[DeviceRule, ...] = tuple(rules)
        for rule in self.rules:
            if not isinstance(rule, DeviceRule):
                raise TypeError(f"rules must be DeviceRule objects, got {rule!r}")
        if not isinstance(oom_fallback, bool):
            raise ValueError(f"oom_fallback must be True or False, got {oom_fallback!r}")
        if isinstance(min_chunk_size, bool) or not isinstance(min_chunk_size, int) or min_chunk_size < 1:
            raise ValueError(f"min_chunk_size must be a positive number of rows, got {min_chunk_size!r}")
        self.oom_fallback = oom_fallback
        self.min_chunk_size = min_chunk_size
        self.source = source
        self._cache: dict[tuple[Problem, DeviceInfo], Geometry | _AskEachCall | MeasuredEntry] = {}
        self._filter_rests: dict[tuple[Problem, DeviceInfo], FilterRest] = {}
        self._measured_heads: dict[tuple[Any, ...], MeasuredHead] = {}  # a measured strategy's buckets, per head
        self._probed: DeviceInfo | None = None
        from flce_policy.engine.policy_keys import register_policy  # the compiled loss finds it by id

        register_policy(self)

    # --- loading and saving ----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<dict>") -> FLCEPolicy:
        """A policy from a loaded YAML mapping; :class:`ConfigError` names ``source`` and the key path."""
        config = parse_config(data, source=source)
        rules = [
            DeviceRule(
                r.match, r.strategy, min_total_memory=r.min_total_memory, max_total_memory=r.max_total_memory,
                grad_weight_filter=r.grad_weight_filter, grad_weight_filter_rescue=r.grad_weight_filter_rescue,
                slab_form=r.slab_form,
            )
            for r in config.rules
        ]  # fmt: skip
        # Settings the file leaves out keep the constructor's defaults.
        given = {
            "oom_fallback": config.oom_fallback,
            "min_chunk_size": config.min_chunk_size,
            "grad_weight_filter": config.default_grad_weight_filter,
            "grad_weight_filter_rescue": config.default_grad_weight_filter_rescue,
            "slab_form": config.default_slab_form,
        }
        settings = {key: value for key, value in given.items() if value is not None}
        return cls(default=config.default, rules=rules, source=source, **settings)

    @classmethod
    def from_yaml_text(cls, text: str, *, source: str = "<string>") -> FLCEPolicy:
        """A policy from YAML text."""
        return cls.from_dict(load_yaml_text(text, source=source), source=source)

    @classmethod
    def from_yaml(cls, path: str | Path, *, source: str | None = None) -> FLCEPolicy:
        """A policy from a YAML file; errors name the file (or ``source``) and the key path."""
        source = str(path) if source is None else source
        return cls.from_dict(load_yaml_file(path, source=source), source=source)

    @classmethod
    def packaged(cls) -> FLCEPolicy:
        """The packaged ``configs/default.yaml``, whatever ``FLCE_POLICY_CONFIG`` says."""
        text = files("flce_policy.configs").joinpath("default.yaml").read_text(encoding="utf-8")
        return cls.from_yaml_text(text, source=_PACKAGED_SOURCE)

    @classmethod
    def default(cls) -> FLCEPolicy:
        """The active policy: the file ``$FLCE_POLICY_CONFIG`` names if set (and non-empty), else :meth:`packaged`."""
        path = os.environ.get(CONFIG_ENV_VAR, "").strip()
        if not path:
            return cls.packaged()
        if not Path(path).is_file():
            raise ConfigError(
                f"{CONFIG_ENV_VAR}={path}",
                [("", f"no such file; fix or unset {CONFIG_ENV_VAR} to use the packaged default")],
            )
        return cls.from_yaml(path, source=f"{path} (from {CONFIG_ENV_VAR})")

    def to_dict(self) -> dict[str, Any]:
        """The YAML mapping :meth:`from_dict` reads back, parameters as written."""
        return {
            "version": CONFIG_VERSION,
            "oom_fallback": self.oom_fallback,
            "min_chunk_size": self.min_chunk_size,
            "default": {
                **self.default_strategy.to_config(),
                **_filter_entry(self.default_grad_weight_filter, self.default_grad_weight_filter_rescue),
                **({} if self.default_slab_form is None else {"slab_form": self.default_slab_form}),
            },
            "devices": [rule.to_config() for rule in self.rules],
        }

    def to_yaml(self) -> str:
        """:meth:`to_dict` as YAML text."""
        return dump_yaml(self.to_dict())

    # --- deciding --------------------------------------------------------------------------------

    def resolve_rule(self, device: DeviceInfo) -> tuple[str, ChunkStrategy]:
        """The rule that applies to ``device`` (``"devices[0] (match H100)"`` or ``"default"``), and its strategy."""
        index, rule = self._matching_rule(device)
        return (
            (DEFAULT_RULE, self.default_strategy)
            if rule is None
            else (f"devices[{index}] ({rule.describe()})", rule.strategy)
        )

    def grad_weight_filter_for(self, device: DeviceInfo) -> float | None:
        """The grad_weight filter eps of the rule that applies to ``device`` (None: dense)."""
        return self._filter_for(device)[0]

    def grad_weight_filter_rescue_for(self, device: DeviceInfo) -> int | None:
        """The grad_weight filter rescue N of the rule that applies to ``device`` (None: none)."""
        return self._filter_for(device)[1]

    def slab_form_for(self, device: DeviceInfo) -> str | None:
        """The slab form the rule that applies to ``device`` pins (None: the engine's choice)."""
        _, rule = self._matching_rule(device)
        return self.default_slab_form if rule is None else rule.slab_form

    def _filter_for(self, device: DeviceInfo) -> tuple[float | None, int | None]:
        """The grad_weight filter eps and rescue of the rule that applies to ``device``."""
        _, rule = self._matching_rule(device)
        if rule is None:
            return self.default_grad_weight_filter, self.default_grad_weight_filter_rescue
        return rule.grad_weight_filter, rule.grad_weight_filter_rescue

    def _matching_rule(self, device: DeviceInfo) -> tuple[int, DeviceRule | None]:
        """The first device rule that matches ``device`` and its index; (-1, None) for the default rule."""
        for i, rule in enumerate(self.rules):
            if rule.matches(device):
                return i, rule
        return -1, None

    def same_strategy_as(self, other: FLCEPolicy, device: DeviceInfo) -> bool:
        """True when ``other`` gives ``device`` an equal strategy (same class and parameters), whichever rule."""
        return self.resolve_rule(device)[1] == other.resolve_rule(device)[1]

    def resolve(self, problem: Problem, device: DeviceInfo | None = None) -> Geometry:
        """The geometry for ``problem`` on ``device`` (probed once per policy when None).

        Called every training step: a repeated (problem, device) is one dict lookup, unless the
        strategy is dynamic (it is then asked again, under any geometry :meth:`remember` recorded).
        """
        if device is None:
            device = self._probe()
        key = (problem, device)
        entry = self._cache.get(key) if isinstance(problem, Problem) else None  # a list is unhashable
        if entry is None:
            entry = self._entry(problem, device)
            self._store(key, entry)
        if type(entry) is _AskEachCall:
            return entry.geometry(problem, device)
        if type(entry) is MeasuredEntry:
            return entry.resolve()
        return entry  # type: ignore[return-value]

    def resolve_call(
        self, problem: Problem, device: DeviceInfo, kind: str = ""
    ) -> tuple[Geometry, OOMFallback | None, Trial | None]:
        """What a loss call of ``problem`` on ``device`` runs: the geometry, its OOM fallback, and the trial that
        times it while a ``measured`` strategy measures (None otherwise). ``kind``: the options of the call that
        change its kernels (:func:`flce_policy.call.resolve.call_kind`), measured apart. One dict lookup more
        than :meth:`resolve` per call."""
        entry = self._cache.get((problem, device))
        if entry is None:
            self.resolve(problem, device)
            entry = self._cache.get((problem, device))
        if type(entry) is MeasuredEntry:
            return entry.for_call(kind)
        return self.resolve(problem, device), self.oom_fallback_for(problem, device), None

    def _entry(self, problem: Problem, device: DeviceInfo) -> Geometry | _AskEachCall | MeasuredEntry:
        """A new cache entry: the planned geometry, a dynamic strategy to ask each call, or a measured one's state."""
        _check_resolve_args(problem, device)
        rule, strategy = self.resolve_rule(device)
        eps, rescue = self._filter_for(device)
        pin = self.slab_form_for(device)
        if strategy.dynamic:
            return _AskEachCall(rule, strategy, grad_weight_filter=eps, grad_weight_filter_rescue=rescue, slab_form=pin)
        clock = self.clock if self.clock is not None else clock_for(device)
        if strategy.measures and clock is not None:
            head_key = (problem.hidden, problem.vocab, problem.dtype, problem.tp_size, device)
            head = self._measured_heads.get(head_key)
            if head is None:
                fallback = OOMFallback(self.min_chunk_size) if self.oom_fallback else None
                head = self._measured_heads[head_key] = MeasuredHead(
                    strategy, device, rule=rule, slab_form=pin, fallback=fallback, clock=clock
                )
            return MeasuredEntry(head, problem, grad_weight_filter=eps, rescue=rescue)
        return planned_geometry(strategy, problem, device, rule=rule, slab_form=pin).with_filter(eps, rescue)

    def measured_pick(self, problem: Problem, device: DeviceInfo, kind: str = "") -> tuple[Geometry, str] | None:
        """A ``measured`` strategy's pick for ``problem`` on ``device`` known without measuring (in this process,
        from its ``picks`` or the disk cache) and where it came from; None when there is none, or no measuring."""
        self.resolve(problem, device)
        entry = self._cache.get((problem, device))
        return entry.known_pick(kind) if type(entry) is MeasuredEntry else None

    def remember(self, problem: Problem, device: DeviceInfo, geometry: Geometry) -> None:
        """Use ``geometry`` for ``problem`` on ``device`` from now on: what the OOM fallback calls.

        For a dynamic strategy it becomes a ceiling: the strategy's answer is used while it asks
        for no more rows. :meth:`clear_cache` forgets it.
        """
        if geometry.problem != problem:
            raise ValueError(
                f"cannot remember a geometry made for {geometry.problem.describe()} as the one for {problem.describe()}"
            )
        rule, strategy = self.resolve_rule(device)
        eps, rescue = self._filter_for(device)
        geometry = geometry.with_filter(eps, rescue)
        measured = self._cache.get((problem, device))
        if type(measured) is MeasuredEntry:
            measured.remember("", geometry)
            return
        pin = self.slab_form_for(device)
        entry = _AskEachCall(rule, strategy, geometry, eps, rescue, pin) if strategy.dynamic else geometry
        self._store((problem, device), entry)

    def oom_fallback_for(self, problem: Problem, device: DeviceInfo) -> OOMFallback | None:
        """How a loss call of ``problem`` on ``device`` answers an OOM on its slab; None when switched off."""
        if not self.oom_fallback:
            return None
        return OOMFallback(self.min_chunk_size, functools.partial(self.remember, problem, device))

    def filter_rest_for(self, problem: Problem, device: DeviceInfo) -> FilterRest:
        """The grad_weight filter's memory of ``problem`` on ``device``: after a call whose flags bought nothing (so
        many tiles kept that its grad_weight ran the dense GEMM), the next few filtered calls run dense without flags
        (:class:`~flce_policy.plan.weight_filter.FilterRest`)."""
        key = (problem, device)
        rest = self._filter_rests.get(key)
        if rest is None:
            if len(self._filter_rests) >= _CACHE_LIMIT:
                self._filter_rests.clear()
            rest = self._filter_rests[key] = FilterRest()
        return rest

    def clear_cache(self) -> None:
        """Forget cached and remembered decisions, the filter's rests and the probed device (after mutating a
        strategy, say)."""
        self._cache.clear()
        self._filter_rests.clear()
        self._measured_heads.clear()
        self._probed = None

    def _store(self, key: tuple[Problem, DeviceInfo], entry: Geometry | _AskEachCall | MeasuredEntry) -> None:
        if len(self._cache) >= _CACHE_LIMIT and key not in self._cache:
            self._cache.clear()
        self._cache[key] = entry

    def _probe(self) -> DeviceInfo:
        if self._probed is None:
            from flce_policy.engine import probe  # deferred: probing pulls in NVML/torch, which planning never needs

            self._probed = probe.probe_device()
        return self._probed

    # --- explaining ------------------------------------------------------------------------------

    def explain_dict(
        self,
        problem: Problem,
        device: DeviceInfo | None = None,
        *,
        master_dtype: str | None = None,
        softcap: float | None = None,
        softcap_rounding: str = "fp32",
    ) -> dict[str, Any]:
        """The decision as JSON-ready data: device, problem, policy source, rule, strategy, geometry.

        ``master_dtype``: the LM head's own dtype under autocast (e.g. "float32" master weights with
        a bfloat16 problem); the predicted peak then holds its low-precision copy and its gradient.
        ``softcap``, ``softcap_rounding``: a loss call's (no bias or label smoothing, gradients in the forward); where
        the planned scaled-exp slab cannot run them the call's logits slab is shown, as the loss runs it.
        """
        if device is None:
            device = self._probe()
        geometry = self.resolve(problem, device)
        _, strategy = self.resolve_rule(device)
        accum_dtype = geometry.accum_dtype
        # the form as the engine chose it for the strategy's rows (a strategy that chose none: from the logits slab)
        asked = geometry if strategy.decides_slab_form() else geometry.with_slab_form("logits")
        form_reason = form_choice(strategy, asked, device, self.slab_form_for(device)).reason
        geometry, softcap_reason = softcapped_geometry(geometry, softcap, softcap_rounding)
        form_reason = softcap_reason or form_reason
        peak = predict_peak(geometry, master_dtype=master_dtype)
        rates = strategy.planned_rates(device)
        predicted = predict_seconds(geometry, rates)
        # Low-precision roundings of the running grad_weight: one per row chunk, or one cast of an
        # fp32 accumulator.
        weight_grad_steps = 1 if geometry.accumulator_dtype(None, master_dtype) == "float32" else geometry.num_chunks
        tp = {}
        if problem.tp_size > 1:
            plan = comm_plan(geometry)
            ms = round(predicted.terms["tp_collectives"] * 1e3, 3)
            tp = {"tp_collectives": {"count": plan.collectives, "bytes": plan.bytes, "predicted_ms": ms}}
        return {
            "device": {**device.model_dump(mode="json"), "description": device.describe()},
            "problem": problem.model_dump(mode="json"),
            "policy": self.source,
            "rule": geometry.rule,
            "strategy": strategy.config_name(),
            "params": strategy.get_params(),
            "chunk_size": geometry.chunk_size,
            "num_chunks": geometry.num_chunks,
            "last_chunk_size": geometry.last_chunk_size,
            "vocab_chunk": geometry.vocab_chunk,
            "num_vocab_chunks": geometry.num_vocab_chunks,
            "slab_bytes": geometry.slab_bytes,
            "slab": format_bytes(geometry.slab_bytes),
            "predicted_peak_bytes": peak.total_bytes,
            "predicted_peak": peak.describe(),
            "gathered_head_bytes": gathered_head_bytes(problem),
            "predicted_ms": round(predicted.seconds * 1e3, 3),
            "accum_dtype": accum_dtype,
            "master_dtype": master_dtype,
            "rates": {"matmul_flops": rates.matmul_flops, "hbm_bytes_per_s": rates.hbm_bytes_per_s},
            "weight_grad_low_precision_steps": weight_grad_steps,
            "weight_grad_gemm": planned_weight_grad_gemm(geometry, device.family, master_dtype),
            "summary": geometry.describe(),
            "dynamic": strategy.dynamic,
            "oom_fallback": self.oom_fallback,
            "min_chunk_size": self.min_chunk_size,
            "grad_weight_filter": geometry.grad_weight_filter,
            "grad_weight_filter_rescue": geometry.grad_weight_filter_rescue,
            "slab_form": geometry.slab_form,
            "slab_form_reason": form_reason,
            "softcap": softcap,
            "softcap_rounding": None if softcap is None else softcap_rounding,
            **self._measured_dict(problem, device, strategy),
            **_filter_times(geometry, rates),
            **tp,
        }

    def _measured_dict(self, problem: Problem, device: DeviceInfo, strategy: ChunkStrategy) -> dict[str, Any]:
        """explain's ``measured`` key for a strategy that measures: the pick known without measuring, or None."""
        if not strategy.measures:
            return {}
        known = self.measured_pick(problem, device)
        bucket = bucket_label(bucket_problem(problem))  # what a pick is measured and cached for
        if known is None:
            return {"measured": None, "bucket": bucket}
        geometry, source = known
        pick = {"chunk_size": geometry.chunk_size, "slab_form": geometry.slab_form, "source": source}
        return {"measured": pick, "bucket": bucket}

    def explain(
        self,
        problem: Problem,
        device: DeviceInfo | None = None,
        *,
        master_dtype: str | None = None,
        softcap: float | None = None,
        softcap_rounding: str = "fp32",
    ) -> str:
        """A readable account of the decision for ``problem`` on ``device`` (probed when None); ``softcap`` and
        ``softcap_rounding`` as for :meth:`explain_dict`."""
        device = self._probe() if device is None else device
        d = self.explain_dict(
            problem, device, master_dtype=master_dtype, softcap=softcap, softcap_rounding=softcap_rounding
        )
        params = ", ".join(f"{k}={v!r}" for k, v in d["params"].items()) or "no parameters"
        when = "; asked again on every call (it reads free memory)" if d["dynamic"] else ""
        oom = (
            f"on: retried at half the rows down to {d['min_chunk_size']}, and the size that completes is remembered"
            if d["oom_fallback"]
            else "off: an out-of-memory error on the slab propagates"
        )
        rates_text = f"{d['rates']['matmul_flops'] / 1e12:.0f} TFLOP/s, {d['rates']['hbm_bytes_per_s'] / 1e12:.2f} TB/s"
        accum = "" if d["accum_dtype"] is None else f" and grad_weight accumulated in {d['accum_dtype']} (planned)"
        if master_dtype is not None:
            accum += f", under autocast over a {master_dtype} weight (its {problem.dtype} copy and gradient included)"
        lines = [
            ("Device", d["device"]["description"]),
            ("Problem", problem.describe() + _softcap_note(softcap, softcap_rounding)),
            ("Policy", d["policy"]),
            ("Rule", d["rule"]),
            ("Strategy", f"{d['strategy']} ({params}){when}"),
            *([("Measured", _measured_note(d["measured"], device, d["bucket"]))] if "measured" in d else []),
            ("Chunk size", f"{d['chunk_size']} rows (last chunk {d['last_chunk_size']})"),
            ("Chunks", f"{d['num_chunks']} chunks over BT={problem.tokens}"),
            *(
                [
                    (
                        "Vocab tiles",
                        f"{d['num_vocab_chunks']} tiles of {d['vocab_chunk']} columns (logits computed twice)",
                    )
                ]
                if d["num_vocab_chunks"] > 1
                else []
            ),
            (
                "Slab",
                f"{d['slab']} per chunk = {d['chunk_size']} x {d['vocab_chunk']} x {problem.itemsize} bytes"
                + _slab_form_note(d["slab_form"]),
            ),
            ("Form", f"{d['slab_form']}: {d['slab_form_reason']}"),
            ("Peak", f"{d['predicted_peak']}, predicted for fwd+bwd with x and W needing grad{accum}"),
            (
                "Sharded W",
                f"under FSDP2 / ZeRO-3 the gathered head ({format_bytes(d['gathered_head_bytes'])}) is held beside "
                f"that peak: {format_bytes(d['predicted_peak_bytes'] + d['gathered_head_bytes'])} on the rank",
            ),
            ("Time", f"{d['predicted_ms']:.1f} ms predicted for fwd+bwd (cost model at {rates_text})"),
            *(
                [("Collectives", _collectives_note(d["tp_collectives"], problem.tp_size))]
                if problem.tp_size > 1
                else []
            ),
            ("W grad", _accumulation_note(d["weight_grad_low_precision_steps"]) + _gemm_note(d["weight_grad_gemm"])),
            ("W filter", _filter_note(d)),
            ("On OOM", oom),
        ]
        return "\n".join(f"{label + ':':<13}{value}" for label, value in lines)

    # --- content equality ------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FLCEPolicy):
            return NotImplemented
        return (
            self.default_strategy == other.default_strategy
            and self.rules == other.rules
            and (self.oom_fallback, self.min_chunk_size) == (other.oom_fallback, other.min_chunk_size)
            and self.default_grad_weight_filter == other.default_grad_weight_filter
            and self.default_grad_weight_filter_rescue == other.default_grad_weight_filter_rescue
            and self.default_slab_form == other.default_slab_form
        )

    __hash__ = None  # type: ignore[assignment]  # equal by content, and the cache makes it mutable

    def __repr__(self) -> str:
        return (
            f"FLCEPolicy(default={self.default_strategy!r}, rules={list(self.rules)!r}, "
            f"oom_fallback={self.oom_fallback!r}, min_chunk_size={self.min_chunk_size!r}, "
            f"grad_weight_filter={self.default_grad_weight_filter!r}, "
            f"grad_weight_filter_rescue={self.default_grad_weight_filter_rescue!r}, "
            f"slab_form={self.default_slab_form!r}, source={self.source!r})"
        )


def _measured_note(measured: dict[str, Any] | None, device: DeviceInfo, bucket: str) -> str:
    of = f" (the bucket {bucket})"
    if measured is not None:
        return f"{measured['chunk_size']} rows on the {measured['slab_form']} slab, from {measured['source']}{of}"
    if device.index is None and device.is_gpu:
        return "on that GPU: the first calls of its BT bucket time the candidates within the limit below"
    if not device.is_gpu:
        return "nothing is measured without a GPU: the limit below runs"
    return f"not yet: the first calls of its BT bucket{of} time the candidates within the limit below"


def _filter_entry(eps: float | None, rescue: int | None) -> dict[str, float | int]:
    """The ``grad_weight_filter`` and ``grad_weight_filter_rescue`` keys of a YAML rule, each absent when unset."""
    entry = {"grad_weight_filter": eps, "grad_weight_filter_rescue": rescue}
    return {key: value for key, value in entry.items() if value is not None}


def _check_resolve_args(problem: Any, device: Any) -> None:
    """Refuse what is not a Problem and a DeviceInfo, naming what was given (checked on a cache miss only)."""
    if not isinstance(problem, Problem):
        raise TypeError(
            f"resolve(problem, device): problem must be a flce_policy.Problem, e.g. Problem(tokens=8192, hidden=4096, "
            f"vocab=128256), or Problem.from_tensors(input, weight); got {type(problem).__name__} {problem!r:.80}"
        )
    if not isinstance(device, DeviceInfo):
        hint = f"; for a known GPU family write DeviceInfo.synthetic({device!r})" if isinstance(device, str) else ""
        raise TypeError(
            f"resolve(problem, device): device must be a flce_policy.DeviceInfo or None (probed), "
            f"got {type(device).__name__} {device!r:.80}{hint}"
        )


#: More bf16 roundings of the running grad_weight than this are worth a warning in explain.
_MANY_ACCUMULATION_STEPS = 8


#: Skipped shares of the filter's tiles at which explain prices the filtered path (the share depends on the logits).
_EXPLAINED_SKIPPED_SHARES = (0.5, 0.7)


def _filter_times(geometry: Geometry, rates: Any) -> dict[str, Any]:
    """explain's predicted fwd+bwd ms of a filtered geometry at a few skipped shares (none without a filter)."""
    if geometry.grad_weight_filter is None:
        return {}
    shares = (0.0, *_EXPLAINED_SKIPPED_SHARES)
    return {
        "predicted_ms_filtered": {
            f"{share:.0%}": round(predict_seconds(geometry, rates, skipped_share=share).seconds * 1e3, 3)
            for share in shares
        }
    }


def softcapped_geometry(
    geometry: Geometry, softcap: float | None, softcap_rounding: str = "fp32"
) -> tuple[Geometry, str | None]:
    """``geometry`` in the slab form a loss call with ``softcap`` runs (no bias or label smoothing, gradients in the
    forward), as :func:`flce_policy.call.resolve.geometry_for_call` routes it, and why where that form differs."""
    if softcap is None or not is_scaled_exp(geometry.slab_form):
        return geometry, None
    form, why = call_form(
        geometry.slab_form, geometry.problem.dtype, softcap, eager_rounding=softcap_rounding == "eager"
    )
    return (geometry, None) if why is None else (geometry.with_slab_form(form), why)


def _softcap_note(softcap: float | None, softcap_rounding: str) -> str:
    return "" if softcap is None else f", softcap {softcap:g} ({softcap_rounding} rounding)"


def _slab_form_note(slab_form: str) -> str:
    if slab_form == "logits":
        return ", holding the logits (cuBLAS GEMM)"
    rows = (
        ", and per row where the call has no bias or label smoothing (bf16): exp(z - z_y), no CE pass over the "
        f"slab, the backward GEMMs scaling its rows (a softcap of up to {SOFTCAP_LIMIT:g} in fp32 runs there too)"
        if slab_form in ("scaled_exp_rows", "scaled_exp_ws")
        else ""
    )
    if slab_form == "scaled_exp_ws":
        rows += (
            f", that GEMM warp-specialised on Hopper (a Gluon kernel, a partial slot per {WS_TILE} columns; calls "
            "with a softcap, the argmax or the entropy run the row-scaled form's Triton GEMM)"
        )
    return (
        f", holding exp(z - m) per {SCALED_EXP_TILE} columns from a Triton GEMM's epilogue (scaled-exp: no partial "
        f"pass, no bf16 rounding of the logits){rows}; other calls with a softcap, and GPUs before Hopper, run the "
        "logits slab"
    )


def _filter_note(d: dict[str, Any]) -> str:
    eps = d["grad_weight_filter"]
    if eps is None:
        return "off (dense grad_weight); a rule's or the call's grad_weight_filter switches it on"
    times = ", ".join(f"{ms:.1f} ms at {share}" for share, ms in d["predicted_ms_filtered"].items())
    rescue = d["grad_weight_filter_rescue"]
    rescued = (
        ""
        if rescue is None
        else (
            f", except one in 2^L of those L octaves below eps (L at most {rescue.bit_length() - 1}; a hash of "
            "the data picks them) counted 2^L times: unbiased"
        )
    )
    return (
        f"grad_weight_filter={eps:g} (from the rule): grad_weight and grad_bias skip the {FILTER_ROWS}x{FILTER_COLS} "
        f"tiles of dL/dlogits where every |softmax - onehot| < {eps:g}{rescued}; predicted {times} of the tiles "
        "skipped (the share depends on the logits); a call's grad_weight_filter overrides it"
    )


def _collectives_note(tp: dict[str, Any], tp_size: int) -> str:
    return (
        f"{tp['count']} per call over the TP group of {tp_size}, {format_bytes(tp['bytes'])} per rank "
        f"([chunk] vectors, grad_input once), {tp['predicted_ms']:.2f} ms of the time (assumed link rates)"
    )


def _gemm_note(weight_grad_gemm: str) -> str:
    if weight_grad_gemm == "gluon_in_memory":
        return "; chunks after the first add their update to it in memory (a Gluon kernel, TMA's bulk reduce)"
    if weight_grad_gemm == "gluon":
        return "; chunks after the first update it on the Gluon kernel that reads it while the GEMM runs"
    return ""


def _accumulation_note(steps: int) -> str:
    if steps == 1:
        return "each element rounded once (as eager PyTorch)"
    note = f"{steps} bf16 accumulation steps per element with accum_dtype=None"
    if steps > _MANY_ACCUMULATION_STEPS:
        note += "; WARNING: many low-precision steps, consider accum_dtype=torch.float32 or Fastest(accum='fp32')"
    return note
