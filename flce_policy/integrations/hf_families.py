"""The one table of Hugging Face causal-LM families: what each does to its logits after ``lm_head``.

A family's transform is read where its own forward reads it: the text config
(``config.get_text_config(decoder=True)``, a composite model's ``text_config``) first, then the top
level. Two guards keep a loss from being silently wrong:

- the config guard: an unlisted family whose config (top level or text config) sets one of
  :data:`TRANSFORM_ATTRIBUTES` is refused;
- the forward guard (:func:`unapplied_forward_reads`): the model's own ``forward`` source is read,
  and every ``self.…`` value it reads between its ``lm_head`` call and its ``self.loss_function``
  call (where families softcap, scale, slice or mask their logits) must be neutral (None, False,
  1) or a transform its family applies here. ``tests/test_hf_sweep.py`` checks that
  :data:`TRANSFORM_ATTRIBUTES` holds every name the installed transformers reads there.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LogitTransform",
    "FAMILIES",
    "TRANSFORM_ATTRIBUTES",
    "logit_transform",
    "unapplied_transform_attributes",
    "unapplied_forward_reads",
    "forward_logit_reads",
]


@dataclass(frozen=True)
class LogitTransform:
    """``logits = softcap(scale * lm_head(h))``: what a family does between ``lm_head`` and the loss."""

    softcap: float | None = None
    scale: float = 1.0


@dataclass(frozen=True)
class _Family:
    softcap_attr: str | None = None  # config attribute: logits = cap * tanh(logits / cap)
    scale_attr: str | None = None  # config attribute of a linear logit scale, applied before the softcap
    scale_divides: bool = False  # Granite divides by its `logits_scaling`, Cohere multiplies

    @property
    def applied(self) -> tuple[str, ...]:
        return tuple(a for a in (self.softcap_attr, self.scale_attr) if a)


_PLAIN = _Family()
_SOFTCAP = _Family(softcap_attr="final_logit_softcapping")
_COHERE = _Family(scale_attr="logit_scale")
_GRANITE = _Family(scale_attr="logits_scaling", scale_divides=True)

#: ``config.model_type`` (the top-level one) -> family. Each entry is tested against HF's own loss
#: (``tests/test_hf_integration.py``, ``tests/test_hf_sweep.py``).
FAMILIES: dict[str, _Family] = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2"), _PLAIN),
    "gemma": _PLAIN,
    "jetmoe": _PLAIN,  # its router loss coefficient is `aux_loss_coef`: its own forward adds it
    # Aya Vision's forward multiplies by its text config's logit_scale since transformers 5.25, not before: the
    # family applies it where the forward reads it (logit_transform's `read`)
    "aya_vision": _COHERE,
    # their text config sets a logit attribute that their own forward does not apply (transformers 5.25):
    "cohere2_vision": _PLAIN,  # Cohere2's logit_scale
    "mpt": _PLAIN,  # logit_scale
    "minicpm3": _PLAIN,  # logits_scaling (it scales the hidden states before lm_head instead)
    **dict.fromkeys(("gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text"), _SOFTCAP),
    # multimodal: their text config's softcap (gemma3's multimodal class does not apply it in 5.24, which
    # the forward guard sees: a family attribute the forward does not read is not applied)
    **dict.fromkeys(("gemma3", "gemma3n", "gemma4", "gemma4_unified", "shieldgemma2"), _SOFTCAP),
    "paligemma": _SOFTCAP,  # PaliGemma 2's Gemma-2 text config sets it; PaliGemma 1's has none
    **dict.fromkeys(("vaultgemma", "nanochat", "beam"), _SOFTCAP),
    "recurrent_gemma": _Family(softcap_attr="logits_soft_cap"),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), _COHERE),
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared", "granitemoehybrid"), _GRANITE),
    **dict.fromkeys(("granite_swa", "granitemoe_swa", "granite_docling"), _GRANITE),  # docling: its text config's
    # HyperCLOVA X multiplies by its logits_scaling (MuP), where Granite divides
    **dict.fromkeys(("hyperclovax", "hyperclovax_vision_v2"), _Family(scale_attr="logits_scaling")),
    "falcon_h1": _Family(scale_attr="lm_head_multiplier"),
    "muse_glimmer": _Family(softcap_attr="final_logit_softcapping", scale_attr="output_multiplier"),
}

#: Config attributes that change the logits after ``lm_head`` in some family of transformers 5.24
#: (every name its forwards read between ``lm_head`` and the loss; the sweep test re-derives the
#: list from the installed sources). An unlisted family whose config sets one is refused.
TRANSFORM_ATTRIBUTES = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
    "lm_head_multiplier",
    "logit_softcapping",
    "logits_soft_cap",
    "output_logit_soft_cap",
    "logit_softcap",
    "unpadded_vocab_size",
)


def _is_neutral(value: Any) -> bool:
    """None, False or the number 1: a value that leaves the logits as they are."""
    if value is None or value is False:
        return True
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value == 1


def _configs(config: Any) -> list[Any]:
    """The text config (where composite models keep their logit settings), then the top level."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text(decoder=True) if callable(get_text) else None
    return [text, config] if text is not None and text is not config else [config]


def _read(config: Any, attr: str) -> Any:
    for c in _configs(config):
        value = getattr(c, attr, None)
        if value is not None:
            return value
    return None


def unapplied_transform_attributes(config: Any) -> list[str]:
    """The :data:`TRANSFORM_ATTRIBUTES` set (not None or 1) on ``config`` or its text config, not applied by its family.

    For an unlisted family, every one that is set. A caller that reads these attributes whatever
    the family (TRL's fused LM head does) would transform the logits where the model does not.
    """
    family = FAMILIES.get(getattr(config, "model_type", None))
    applied = () if family is None else family.applied
    return [a for a in TRANSFORM_ATTRIBUTES if a not in applied and not _is_neutral(_read(config, a))]


def logit_transform(config: Any, read: tuple[str, ...] | None = None) -> LogitTransform:
    """The transform ``config``'s family applies to its logits; ValueError for an unknown transform.

    ``read``: the attribute names the model's forward reads between its head and its loss
    (:func:`forward_logit_reads`), where known; a family attribute it does not read is not applied
    (the installed transformers may have dropped a family's transform from one of its classes).
    """
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        present = unapplied_transform_attributes(config)
        if present:
            raise ValueError(
                f"flce-policy does not know how model_type={model_type!r} applies {', '.join(present)} to its "
                f"logits, so it cannot compute its loss without them; supported families: {', '.join(FAMILIES)}"
            )
        return LogitTransform()
    attrs = (family.softcap_attr, family.scale_attr)
    softcap_attr, scale_attr = (a if read is None or a in read else None for a in attrs)
    softcap = _read(config, softcap_attr) if softcap_attr else None
    scale = _read(config, scale_attr) if scale_attr else None
    if scale is None:
        scale = 1.0
    elif family.scale_divides:
        scale = 1.0 / scale
    return LogitTransform(softcap=None if softcap is None else float(softcap), scale=float(scale))


def _dotted(node: ast.AST) -> str | None:
    """``self.config.get_text_config().x`` for an attribute chain (through argument-free calls), else None."""
    parts: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args:
            parts.append(node.func.attr + "()")
            node = node.func.value
        elif isinstance(node, ast.Name):
            parts.append(node.id)
            return ".".join(reversed(parts))
        else:
            return None


@functools.lru_cache(maxsize=256)
def _forward_reads(forward: Any, head_path: str) -> tuple[tuple[str, ...], bool] | None:
    """(``self.…`` chains read between the head call and ``self.loss_function``, whether that call exists).

    None when the source cannot be read. ``head_path`` is the head's module path (``lm_head``); a
    call of it or of a module above it (``self.cls(...)`` for ``cls.predictions.decoder``) starts the region.
    """
    try:
        source = textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError):
        return None
    function = ast.parse(source).body[0]
    heads = {"self." + ".".join(head_path.split(".")[:i]) for i in range(1, head_path.count(".") + 2)}
    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call)]
    head_calls = [c for c in calls if _dotted(c.func) in heads]
    head_lines = [c.lineno for c in head_calls]
    # what the head is given (a transform of the hidden states before it) is what the fused loss is given
    head_inputs = {id(n) for c in head_calls for a in (*c.args, *c.keywords) for n in ast.walk(a)}
    loss_lines = [c.lineno for c in calls if _dotted(c.func) == "self.loss_function"]
    if not head_lines:
        return (), bool(loss_lines)
    start = min(head_lines)
    end = min([line for line in loss_lines if line >= start], default=start)
    reads: set[str] = set()
    for node in ast.walk(function):
        if not start <= getattr(node, "lineno", -1) < end or id(node) in head_inputs:
            continue
        if isinstance(node, ast.Attribute):
            chain = _dotted(node)
            if chain is not None and chain.startswith("self."):
                reads.add(chain)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2:
            obj, name = _dotted(node.args[0]), node.args[1]
            if obj is not None and obj.startswith("self") and isinstance(name, ast.Constant):
                reads.add(f"{obj}.{name.value}")
    reads = {r for r in reads if not any(r == h or r.startswith(h + ".") for h in heads)}  # the head's own
    maximal = {r for r in reads if not any(o.startswith(r + ".") for o in reads)}
    return tuple(sorted(maximal)), bool(loss_lines)


def _value_of(model: Any, chain: str) -> Any:
    value = model
    for part in chain.split(".")[1:]:
        value = getattr(value, part.removesuffix("()"), None)
        if part.endswith("()") and callable(value):
            value = value()
        if value is None:
            return None
    return value


def forward_logit_reads(model: Any, head_path: str) -> tuple[dict[str, Any], bool] | None:
    """``{chain: value}`` of what ``model.forward`` reads between its head and its loss, and whether it
    calls ``self.loss_function``; None where its source cannot be read."""
    found = _forward_reads(type(model).forward, head_path)
    if found is None:
        return None
    chains, calls_loss_function = found
    return {c: _value_of(model, c) for c in chains}, calls_loss_function


def unapplied_forward_reads(model: Any, head_path: str) -> list[str]:
    """The values ``model``'s forward reads between its head and its loss that change the logits in a way
    its family (the table) does not apply, as ``"name=value"``: a non-neutral config value, a module
    other than the head (a softcap module, a vocabulary mask's holder), a tensor or a list."""
    found = forward_logit_reads(model, head_path)
    if found is None:
        return []
    import torch

    family = FAMILIES.get(getattr(model.config, "model_type", None))
    applied = () if family is None else family.applied
    head = model.get_submodule(head_path)
    stray = []
    for chain, value in found[0].items():
        if isinstance(value, torch.nn.Module):
            if head in tuple(value.modules()):
                continue  # the head itself, or the module that calls it
        elif chain.rsplit(".", 1)[-1] in applied + ("training",) or _is_neutral(value) or callable(value):
            continue
        stray.append(f"{chain.removeprefix('self.')}={_short(value)}")
    return stray


def _short(value: Any) -> str:
    text = type(value).__name__ if hasattr(value, "modules") else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
