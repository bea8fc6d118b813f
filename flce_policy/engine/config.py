"""The versioned YAML schema of a policy file, checked at the boundary with pydantic.

A file reads::

    version: 1
    oom_fallback: true       # optional (default true): retry at half the rows when the slab does not fit
    min_chunk_size: 64       # optional (default 64): the fallback halves no further than this
    default:                 # optional; Liger's heuristic_c with c=1 when left out
      strategy: heuristic_c
      c: 1
    devices:                 # ordered; the first rule that matches wins
      - match: H100          # a family (case-insensitive) or a glob on the device name
        min_total_memory: 90GiB   # optional; also max_total_memory
        strategy: slab_budget
        max_slab: 512MiB     # a strategy's parameters sit beside its name
      - match: "*"
        grad_weight_filter: 2**-12   # optional, here or in default: the grad_weight filter's eps
        grad_weight_filter_rescue: 16  # optional, with a filter: skipped tiles kept one in 2..16 by level (unbiased)
        strategy: free_memory
        cap:                 # a strategy parameter may itself be a strategy mapping
          strategy: heuristic_c
          c: 16

``match`` is a device family (case-insensitive) or an fnmatch glob on the device name; ``"*"``
matches every device, the CPU fallback included (write ``match: cpu`` to single that out).
Every error names the source (file) and the key path, e.g.
``config.yaml: devices[1].max_slab: cannot parse 'lots' as a byte size ...``, and into a nested
strategy: ``devices[1].cap.c: c must be a positive integer, got 0``. YAML aliases (``*name``) are refused
where they stand, as the file is read: nothing walks the values a few of them can stand for.
This module only parses; :mod:`flce_policy.engine.policy` turns the result into a policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError, field_validator, model_validator

from flce_policy.plan.form_choice import checked_slab_form
from flce_policy.plan.units import parse_bytes
from flce_policy.plan.weight_filter import check_rescue_has_filter, checked_filter_eps, checked_filter_rescue
from flce_policy.strategies import ChunkStrategy, StrategyError, strategy_class, strategy_from_config

__all__ = [
    "CONFIG_VERSION",
    "MAX_NESTING",
    "ALIASES_REFUSED",
    "RULE_KEYS",
    "DEFAULT_KEYS",
    "ConfigError",
    "RuleConfig",
    "PolicyConfig",
    "parse_config",
    "load_yaml_text",
    "load_yaml_file",
    "dump_yaml",
]

CONFIG_VERSION = 1
#: The deepest nesting of mappings and lists a policy accepts. A real file nests a few levels (a
#: rule, its cap strategy, that one's rates); a deeper one is a mistake, and walking it would
#: only exhaust Python's recursion limit somewhere less clear.
MAX_NESTING = 32
#: Why a policy file's alias (``*name``) is an error: a few lines of them can stand for billions of values.
ALIASES_REFUSED = (
    "a policy file may not use YAML aliases (*name), which can make a few lines stand for billions of values; "
    "write the value out where it is used"
)
#: Keys a ``devices`` entry understands besides the parameters of its strategy.
RULE_KEYS = (
    "match", "min_total_memory", "max_total_memory", "strategy", "grad_weight_filter", "grad_weight_filter_rescue",
    "slab_form",
)  # fmt: skip
#: Keys ``default`` understands besides the parameters of its strategy.
DEFAULT_KEYS = ("strategy", "grad_weight_filter", "grad_weight_filter_rescue", "slab_form")
_TOP_KEYS = ("version", "oom_fallback", "min_chunk_size", "default", "devices")


class ConfigError(ValueError):
    """An invalid policy file or dict. ``problems`` holds ``(key path, message)`` pairs, one per line of str()."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = list(problems)
        super().__init__(
            "\n".join(f"{source}: {path}: {msg}" if path else f"{source}: {msg}" for path, msg in problems)
        )


class RuleConfig(NamedTuple):
    """One validated ``devices`` entry; memory bounds as written (bytes or strings like "200GiB")."""

    match: str
    strategy: ChunkStrategy
    min_total_memory: int | str | None
    max_total_memory: int | str | None
    grad_weight_filter: float | None = None
    grad_weight_filter_rescue: int | None = None
    slab_form: str | None = None


class PolicyConfig(NamedTuple):
    """A validated file: the default strategy and OOM settings (None when the file leaves them out), and the rules."""

    default: ChunkStrategy | None
    rules: list[RuleConfig]
    oom_fallback: bool | None = None
    min_chunk_size: int | None = None
    default_grad_weight_filter: float | None = None
    default_grad_weight_filter_rescue: int | None = None
    default_slab_form: str | None = None


# --- the schema ----------------------------------------------------------------------------------


class _TopLevel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Any
    oom_fallback: Any = None
    min_chunk_size: Any = None
    default: dict[str, Any] | None = None
    devices: list[Any] | None = None  # `devices:` with nothing under it reads as null: no rules

    @field_validator("version")
    @classmethod
    def _version(cls, value: Any) -> int:
        # bool is an int in Python; `version: true` is a mistake, not version 1.
        if isinstance(value, bool) or value != CONFIG_VERSION:
            raise ValueError(f"unsupported version {value!r}; this flce-policy reads version {CONFIG_VERSION}")
        return CONFIG_VERSION

    @field_validator("oom_fallback")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value

    @field_validator("min_chunk_size")
    @classmethod
    def _rows(cls, value: Any) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"expected a positive number of rows, got {value!r}")
        return value


class _StrategyEntry(BaseModel):
    # Unknown keys are kept: they are the strategy's parameters, checked against its signature below.
    model_config = ConfigDict(extra="allow")

    strategy: StrictStr
    grad_weight_filter: Any = None  # rule keys, not strategy parameters
    grad_weight_filter_rescue: Any = None
    slab_form: Any = None

    @field_validator("slab_form")
    @classmethod
    def _form(cls, value: Any) -> str | None:
        return checked_slab_form(value, "slab_form")

    @field_validator("grad_weight_filter")
    @classmethod
    def _eps(cls, value: Any) -> float | None:
        try:
            return checked_filter_eps(value, "grad_weight_filter", text=True)
        except TypeError as err:  # pydantic reports a ValueError under the key's path; a TypeError would escape
            raise ValueError(str(err)) from None

    @field_validator("grad_weight_filter_rescue")
    @classmethod
    def _rescue(cls, value: Any) -> int | None:
        try:
            return checked_filter_rescue(value, "grad_weight_filter_rescue", text=True)
        except TypeError as err:
            raise ValueError(str(err)) from None

    @model_validator(mode="after")
    def _rescue_has_filter(self) -> _StrategyEntry:
        check_rescue_has_filter(self.grad_weight_filter, self.grad_weight_filter_rescue)
        return self


class _RuleEntry(_StrategyEntry):
    match: StrictStr
    min_total_memory: Any = None
    max_total_memory: Any = None

    @field_validator("min_total_memory", "max_total_memory")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        if value is not None:
            parse_bytes(value)
        return value  # kept as written so a dump shows what the user wrote

    @field_validator("match")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("match must be a non-empty family or glob")
        return value

    @model_validator(mode="after")
    def _ordered(self) -> _RuleEntry:
        low, high = self.min_total_memory, self.max_total_memory
        if low is not None and high is not None and parse_bytes(low) > parse_bytes(high):
            raise ValueError(f"min_total_memory {low!r} is larger than max_total_memory {high!r}; no device can match")
        return self


# --- parsing -------------------------------------------------------------------------------------


def parse_config(data: Any, *, source: str = "<dict>") -> PolicyConfig:
    """Validate a loaded policy mapping; raises :class:`ConfigError` listing every problem found."""
    if data is None:
        raise ConfigError(source, [("", f"the file is empty; a policy needs at least 'version: {CONFIG_VERSION}'")])
    if not isinstance(data, dict):
        raise ConfigError(source, [("", f"expected a mapping at the top level, got {_type_name(data)}")])
    too_deep = _too_deep(data)
    if too_deep is not None:
        raise ConfigError(source, [(_key_path(too_deep), f"nested more than {MAX_NESTING} levels deep")])
    problems: list[tuple[str, str]] = []
    top = _validate(_TopLevel, data, (), problems)
    if top is None:
        raise ConfigError(source, problems)
    default, default_filter, default_form = None, (None, None), None
    if top.default is not None:
        entry = _validate(_StrategyEntry, top.default, ("default",), problems)
        if entry is not None:
            default = _build_strategy(entry, DEFAULT_KEYS, ("default",), problems)
            default_filter = (entry.grad_weight_filter, entry.grad_weight_filter_rescue)
            default_form = _rule_pin(entry, default)
    rules: list[RuleConfig] = []
    for i, raw in enumerate(top.devices or []):
        loc = ("devices", i)
        rule = _validate(_RuleEntry, raw, loc, problems)
        strategy = None if rule is None else _build_strategy(rule, RULE_KEYS, loc, problems)
        if strategy is not None:
            rules.append(
                RuleConfig(
                    rule.match,
                    strategy,
                    rule.min_total_memory,
                    rule.max_total_memory,
                    rule.grad_weight_filter,
                    rule.grad_weight_filter_rescue,
                    _rule_pin(rule, strategy),
                )  # fmt: skip
            )
    if problems:
        raise ConfigError(source, problems)
    return PolicyConfig(default, rules, top.oom_fallback, top.min_chunk_size, *default_filter, default_form)


def _rule_pin(entry: _StrategyEntry, strategy: ChunkStrategy | None) -> str | None:
    """The entry's ``slab_form`` as the rule's pin, unless its strategy took it as a parameter."""
    if strategy is not None and "slab_form" in strategy.param_names():
        return None
    return entry.slab_form


def _too_deep(data: Any) -> tuple | None:
    """The key path of a value nested deeper than :data:`MAX_NESTING`, else None (walked without recursion)."""
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, loc = stack.pop()
        if len(loc) > MAX_NESTING:
            return loc
        if isinstance(value, dict):
            stack.extend((v, (*loc, str(k))) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, (*loc, i)) for i, v in enumerate(value))
    return None


def _validate(model: type[BaseModel], raw: Any, loc: tuple, problems: list[tuple[str, str]]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        for e in err.errors():
            problems.append((_key_path(loc + tuple(e["loc"])), _message(e, model)))
        return None


def _build_strategy(
    entry: _StrategyEntry, own_keys: tuple[str, ...], loc: tuple, problems: list[tuple[str, str]]
) -> ChunkStrategy | None:
    name = entry.strategy
    try:
        cls = strategy_class(name)
    except StrategyError as err:
        problems.append((_key_path(loc + ("strategy",)), str(err)))
        return None
    accepted = cls.param_names()
    params = dict(entry.model_extra or {})
    before = len(problems)
    for key in params:
        if key not in accepted:
            problems.append(
                (
                    _key_path(loc + (key,)),
                    f"unknown key; not one of {', '.join(own_keys)} nor a parameter of strategy {name!r} "
                    f"(it accepts: {', '.join(accepted) or 'none'})",
                )
            )
    if "slab_form" in accepted and entry.slab_form is not None:
        params["slab_form"] = entry.slab_form  # a strategy that plans on a form (fastest) takes the pin as its own
    for key in set(accepted) & set(own_keys) - {"slab_form"}:
        problems.append((_key_path(loc + ("strategy",)), f"strategy {name!r} has a parameter {key!r}, a rule key"))
    if len(problems) > before:
        return None
    try:
        return strategy_from_config({"strategy": name, **params})
    except StrategyError as err:
        key, message = _locate(err, cls)
        problems.append((_key_path(loc + ((key,) if key else ())), message))
        return None


def _locate(err: StrategyError, cls: type[ChunkStrategy]) -> tuple[str | None, str]:
    """The parameter a strategy's error is about, and the message without the prefixes the key path repeats."""
    message = str(err)
    if err.param is None:
        return None, message
    rest = message.removeprefix(f"{cls.config_name()}: ").removeprefix(f"{err.param}: ")
    return err.param, rest


def _key_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _message(error: Any, model: type[BaseModel]) -> str:
    kind, value = error["type"], error.get("input")
    if kind == "missing":
        return "required key is missing"
    if kind == "extra_forbidden":
        return f"unknown key; a policy file's top-level keys are {', '.join(_TOP_KEYS)}"
    if kind in ("dict_type", "model_type"):
        return f"expected a mapping (key: value lines), got {_type_name(value)}"
    if kind == "list_type":
        return f"expected a list of rules (lines starting with '- '), got {_type_name(value)}"
    if kind == "string_type":
        return f"expected a string, got {_type_name(value)} {value!r}"
    if kind == "value_error":
        return str(error["ctx"]["error"])
    return error["msg"]


def _type_name(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "a string", type(None): "null", bool: "a boolean"}
    return names.get(type(value), type(value).__name__)


# --- reading YAML --------------------------------------------------------------------------------


class _AliasRefused(yaml.composer.ComposerError):
    """An alias (``*name``) in a policy file: refused before anything walks the value it stands for."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which plain YAML silently resolves to the last one, and aliases.

    An alias is the node it names, shared, so nine anchors of nine aliases each compose in a
    millisecond and stand for 9**9 values: every later walk (the nesting check, validation) would
    visit each one. Refused here, at its event, the file is never expanded.
    """

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasRefused(None, None, f"alias *{event.anchor}", event.start_mark)
        return super().compose_node(parent, index)


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # an unhashable key; the base constructor reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_yaml_text(text: str, *, source: str = "<string>") -> Any:
    """Parse YAML text: the one reader of a policy's YAML (files, ``tune``'s output, ``--param`` values).

    A syntax error, a duplicate key or an alias becomes a :class:`ConfigError` naming the line and column.
    """
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        if isinstance(err, _AliasRefused):
            raise ConfigError(source, [(where, f"{problem}: {ALIASES_REFUSED}")]) from None
        raise ConfigError(source, [(where, f"YAML syntax error: {problem}")]) from None
    except RecursionError:  # the YAML parser recurses once per level of nesting
        raise ConfigError(
            source, [("", f"nested too deeply to read (a policy needs at most {MAX_NESTING} levels)")]
        ) from None


class _PlainDumper(yaml.SafeDumper):
    """SafeDumper that writes a value shared in two places twice, never as an anchor and alias (refused on reading)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(data: Any) -> str:
    """``data`` as YAML text :func:`load_yaml_text` reads back: keys in their order, no aliases."""
    return yaml.dump(data, Dumper=_PlainDumper, sort_keys=False)


def load_yaml_file(path: str | Path, *, source: str | None = None) -> Any:
    """Read and parse a YAML file; ``source`` (default: the path as given) prefixes every error."""
    source = str(path) if source is None else source
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(source, [("", "no such file")]) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(source, [("", f"cannot read: {err}")]) from None
    return load_yaml_text(text, source=source)
