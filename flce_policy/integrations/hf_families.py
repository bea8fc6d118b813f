"""The one table of Hugging Face causal-LM families: what each does to its logits after ``lm_head``.

A family not listed here goes through the generic path when its config carries none of the
logit-transform attributes below; one that carries an attribute we do not know how to apply is
refused (a wrong loss would be silent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LogitTransform", "FAMILIES", "TRANSFORM_ATTRIBUTES", "logit_transform", "unapplied_transform_attributes"]


@dataclass(frozen=True)
class LogitTransform:
    """``logits = softcap(scale * lm_head(h))``: what a family does between ``lm_head`` and the loss."""

    softcap: float | None = None
    scale: float = 1.0


@dataclass(frozen=True)
class _Family:
    softcap_attr: str | None = None  # config attribute: logits = cap * tanh(logits / cap)
    scale_attr: str | None = None  # config attribute of a linear logit scale
    scale_divides: bool = False  # Granite divides by its `logits_scaling`, Cohere multiplies


_PLAIN = _Family()
_SOFTCAP = _Family(softcap_attr="final_logit_softcapping")
_COHERE = _Family(scale_attr="logit_scale")
_GRANITE = _Family(scale_attr="logits_scaling", scale_divides=True)

#: ``config.model_type`` -> family. Each entry's loss and gradients are tested against HF's own path.
FAMILIES: dict[str, _Family] = {
    "llama": _PLAIN,
    "mistral": _PLAIN,
    "mixtral": _PLAIN,
    "qwen2": _PLAIN,
    "qwen3": _PLAIN,
    "qwen3_moe": _PLAIN,
    "phi3": _PLAIN,
    "olmo2": _PLAIN,
    "gemma": _PLAIN,
    "gemma2": _SOFTCAP,
    "gemma3_text": _SOFTCAP,
    "cohere": _COHERE,
    "cohere2": _COHERE,
    "granite": _GRANITE,
    "granitemoe": _GRANITE,
}

#: Config attributes that change the logits after ``lm_head`` in some family. An unlisted family
#: whose config sets one of them is refused rather than guessed.
TRANSFORM_ATTRIBUTES = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
    "lm_head_multiplier",
    "logit_softcapping",
)


def unapplied_transform_attributes(config: Any) -> list[str]:
    """The :data:`TRANSFORM_ATTRIBUTES` set on ``config`` (not None or 1) that its family does not apply.

    For an unlisted family, every one that is set. A caller that reads these attributes whatever
    the family (TRL's fused LM head does) would transform the logits where the model does not.
    """
    family = FAMILIES.get(getattr(config, "model_type", None))
    applied = () if family is None else (family.softcap_attr, family.scale_attr)
    return [a for a in TRANSFORM_ATTRIBUTES if a not in applied and getattr(config, a, None) not in (None, 1, 1.0)]


def logit_transform(config: Any) -> LogitTransform:
    """The transform ``config``'s family applies to its logits; ValueError for an unknown transform."""
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
    softcap = getattr(config, family.softcap_attr, None) if family.softcap_attr else None
    scale = getattr(config, family.scale_attr, None) if family.scale_attr else None
    if scale is None:
        scale = 1.0
    elif family.scale_divides:
        scale = 1.0 / scale
    return LogitTransform(softcap=None if softcap is None else float(softcap), scale=float(scale))
