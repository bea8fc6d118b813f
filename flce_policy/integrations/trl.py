"""TRL: flce-policy's loss behind TRL's fused-LM-head contract, for ``SFTTrainer`` (TRL >= 1.16).

TRL's trainers call ``model(..., labels=..., fused_lm_head=True)`` on a model patched by
``trl.trainer.utils.add_fused_lm_head`` and read per-token fields of its ``FusedCausalLMOutput``
(``SFTTrainer``: ``log_probs`` for the loss, ``entropy`` and ``is_top1`` for its metrics).
:func:`add_flce_lm_head` patches a model instance with the same contract, computed by
:func:`~flce_policy.fused_linear_cross_entropy` (``reduction="none"``, so each token's
log-probability carries its own gradient); :func:`apply_flce_to_sft_trainer` does it for the
model of a built ``SFTTrainer``, replacing the head TRL installed in ``__init__``.

Logits are ``softcap(scale * lm_head(h)) / temperature``, in TRL's order, with ``softcap`` and
``scale`` from the family table (:mod:`flce_policy.integrations.hf_families`): the scale and the
temperature are applied exactly on the hidden states (and bias), the softcap in the kernel.
Refused, with an error naming the problem: a softcap with ``temperature != 1`` (not a softcap of
scaled logits), a config whose logit attributes TRL would read but the family does not apply,
the ``log_sum_sq_probs`` and ``mean_logits`` fields, and a ZeRO-3-partitioned head. The
``entropy`` field carries no gradient: a backward through it raises instead of dropping it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from flce_policy.distributed.sharded import is_dtensor, is_zero3_partitioned
from flce_policy.integrations.hf_families import logit_transform, unapplied_transform_attributes
from flce_policy.loss import FLCEOutput, fused_linear_cross_entropy

__all__ = ["add_flce_lm_head", "apply_flce_to_sft_trainer", "SUPPORTED_OUTPUTS", "REFUSED_OUTPUTS", "SFT_OUTPUTS"]

#: ``FusedCausalLMOutput`` per-token fields this head computes (``log_probs`` always).
SUPPORTED_OUTPUTS = ("log_probs", "entropy", "is_top1")
#: Fields of TRL's head that the kernel does not compute: asking for them is a ValueError.
REFUSED_OUTPUTS = ("log_sum_sq_probs", "mean_logits")
#: What ``SFTTrainer`` asks its head for (its loss, its ``entropy`` and ``mean_token_accuracy`` metrics).
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
_IGNORE = -100  # TRL's label padding


@dataclasses.dataclass(frozen=True)
class _Head:
    """What one :func:`add_flce_lm_head` patch computes with."""

    policy: Any
    outputs: tuple[str, ...]
    softcap: float | None
    hidden_scale: float  # logit scale / temperature, applied to the hidden states and the bias
    cast_to_fp32: bool
    previous_forward: Any  # the forward TRL's fused_lm_head=False call runs (the model's, or TRL's patch)


def add_flce_lm_head(
    model: nn.Module,
    policy: Any = None,
    *,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
) -> None:
    """Give ``model`` (this instance) TRL's fused LM head, computed by flce-policy.

    Same contract as ``trl.trainer.utils.add_fused_lm_head``: ``model(..., labels=labels,
    fused_lm_head=True)`` (or ``shift_labels=``, used unshifted; ``num_items_in_batch=``) returns
    TRL's ``FusedCausalLMOutput`` with per-token fields of shape ``(batch, seq - 1)`` (``(batch,
    seq)`` with ``shift_labels``), zero where the label is -100: ``log_probs`` (fp32, nats, with
    gradient), ``entropy`` (fp32 nats, no gradient) and ``is_top1`` (bool) when listed in
    ``outputs``, else None; ``label_mask``; ``loss`` = ``-log_probs.sum()`` over
    ``num_items_in_batch`` (else the non-ignored count) plus ``router_aux_loss_coef * aux_loss``
    for an MoE config with ``output_router_logits``. Without ``fused_lm_head`` the forward that was
    there runs. ``policy`` goes to :func:`~flce_policy.fused_linear_cross_entropy`;
    ``cast_lm_head_to_fp32`` computes the head in fp32 outside autocast (an fp32 copy of a
    low-precision weight for the call). A PEFT model: pass its base model, as TRL does.
    """
    text_config = _text_config(model)
    unknown = [name for name in outputs if name not in SUPPORTED_OUTPUTS + REFUSED_OUTPUTS]
    if isinstance(outputs, str) or unknown:
        raise ValueError(f"outputs must be a tuple of {SUPPORTED_OUTPUTS + REFUSED_OUTPUTS}; got {outputs!r}")
    refused = [name for name in outputs if name in REFUSED_OUTPUTS]
    if refused:
        raise ValueError(
            f"flce-policy's head does not compute {', '.join(refused)} (its kernel keeps no such sums); "
            f"it computes {', '.join(SUPPORTED_OUTPUTS)}: use TRL's add_fused_lm_head for the others"
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    softcap, scale = _logit_transform(text_config)
    if softcap is not None and temperature != 1.0:
        raise ValueError(
            f"temperature={temperature} with final_logit_softcapping={softcap}: TRL divides the softcapped "
            "logits by the temperature, which is not a softcap flce-policy's kernel can apply; use temperature=1.0"
        )
    previous = getattr(model.__dict__.get("_flce_trl_head"), "previous_forward", None) or model.forward
    head = _Head(policy, tuple(outputs), softcap, scale / temperature, bool(cast_lm_head_to_fp32), previous)
    model._flce_trl_head = head
    model.forward = types.MethodType(_fused_forward(type(model).forward, head, text_config), model)


def apply_flce_to_sft_trainer(trainer: Any, policy: Any = None) -> Any:
    """Replace the fused LM head ``SFTTrainer.__init__`` installed by flce-policy's; returns ``trainer``.

    Call it after building the trainer and before ``train()``. Patches ``trainer.model`` (its base
    model under PEFT, as TRL does) with :func:`add_flce_lm_head` for :data:`SFT_OUTPUTS`; TRL's
    ``compute_loss`` (``nll`` and ``dft``), metrics and evaluation then run on it unchanged.
    """
    from trl import SFTTrainer

    if not isinstance(trainer, SFTTrainer):
        raise TypeError(f"apply_flce_to_sft_trainer needs a trl.SFTTrainer, got {type(trainer).__name__}")
    model = trainer.model
    if type(model).__name__.startswith("Peft") and callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    add_flce_lm_head(model, policy, outputs=SFT_OUTPUTS)
    return trainer


def _text_config(model: nn.Module) -> Any:
    if type(model).__name__.startswith("Peft"):
        raise TypeError("add_flce_lm_head patches the base model under PEFT, as TRL does: pass model.get_base_model()")
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "get_output_embeddings", None)):
        raise TypeError(
            f"add_flce_lm_head needs a transformers causal LM (with .config and get_output_embeddings()), "
            f"got {type(model).__name__}"
        )
    return config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config


def _logit_transform(text_config: Any) -> tuple[float | None, float]:
    """``(softcap, scale)`` as TRL applies them, from the family table; ValueError where TRL would differ."""
    transform = logit_transform(text_config)  # an unknown family with a logit attribute is refused here
    stray = unapplied_transform_attributes(text_config)
    if stray:
        raise ValueError(
            f"model_type={text_config.model_type!r} sets {', '.join(stray)}, which its family does not apply to "
            "its logits but TRL's fused head may: refusing rather than computing a different loss"
        )
    return transform.softcap, transform.scale


def _fused_forward(class_forward: Any, head: _Head, text_config: Any) -> Any:
    @functools.wraps(class_forward)  # generate() validates its kwargs against this signature
    def forward(
        self: nn.Module,
        *args: Any,
        fused_lm_head: bool = False,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        **kwargs: Any,
    ) -> Any:
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return head.previous_forward(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        if labels is None and shift_labels is None:
            raise ValueError("fused_lm_head=True needs labels (shifted here) or shift_labels (used as given)")
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        body = _backbone(self, text_config)(*args, **kwargs)
        hidden = body.last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        per_token, mask = _per_token(self, head, hidden, labels)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -per_token["log_probs"].sum() / count
        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = _router_aux_loss(self, text_config, body, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return _output_class()(loss=loss, **per_token, label_mask=mask, aux_loss=aux_loss)

    return forward


def _backbone(model: nn.Module, text_config: Any) -> nn.Module:
    """The body whose ``last_hidden_state`` feeds the head (looked up per call: FSDP and PEFT replace it)."""
    import transformers
    from packaging.version import Version

    if text_config is not model.config and Version(transformers.__version__) < Version("5.0.0"):
        return model.model  # before transformers 5, a vision-language model's language backbone
    return model.base_model


def _per_token(
    model: nn.Module, head: _Head, hidden: torch.Tensor, labels: torch.Tensor
) -> tuple[dict[str, torch.Tensor | None], torch.Tensor]:
    """The per-token fields, ``labels``' shape, zero where ignored; and the label mask."""
    lm_head = model.get_output_embeddings()
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    if is_zero3_partitioned(weight):
        raise RuntimeError(
            "lm_head.weight is a DeepSpeed ZeRO-3 partitioned parameter: flce-policy's TRL head reads it outside "
            "the head's own call and would need it again, gathered, in backward; use TRL's own fused head there, "
            "or HF Trainer with flce_policy.integrations.transformers.apply_flce"
        )
    if is_dtensor(weight):  # FSDP2: the whole head for this call, its gradient reduce-scattered back
        weight = weight.full_tensor()
        bias = None if bias is None else bias.full_tensor()
    hidden, labels = hidden.to(weight.device), labels.to(weight.device)
    mask = labels != _IGNORE
    autocast = nullcontext()
    if head.cast_to_fp32:
        hidden, weight = hidden.float(), weight.float()
        bias = None if bias is None else bias.float()
        autocast = torch.autocast(hidden.device.type, enabled=False)
    rows, targets = hidden[mask], labels[mask]  # only the scored positions go through the head
    if head.hidden_scale != 1.0:  # (h W^T + b) * s = (s h) W^T + s b, exactly
        rows = rows * head.hidden_scale
        bias = None if bias is None else bias * head.hidden_scale
    with autocast:
        out = fused_linear_cross_entropy(
            rows,
            weight,
            targets,
            bias,
            policy=head.policy,
            reduction="none",
            softcap=head.softcap,
            return_entropy="entropy" in head.outputs,
            return_predicted_tokens="is_top1" in head.outputs,
        )
    if not isinstance(out, FLCEOutput):  # log_probs alone: the loss comes back as a plain tensor
        out = FLCEOutput(out, None, None)

    def scatter(values: torch.Tensor) -> torch.Tensor:
        # masked_scatter keeps log_probs connected to the model even when no label is valid
        return values.new_zeros(mask.shape).masked_scatter(mask, values)

    fields: dict[str, torch.Tensor | None] = {"log_probs": scatter(-out.loss), "entropy": None, "is_top1": None}
    if out.entropy is not None:
        fields["entropy"] = _NoGradient.apply(scatter(out.entropy), rows)
    if out.predicted_tokens is not None:
        fields["is_top1"] = scatter(out.predicted_tokens == targets)
    return fields, mask


def _router_aux_loss(model: nn.Module, text_config: Any, body: Any, attention_mask: Any) -> torch.Tensor:
    """The MoE load-balancing loss of the body's router logits, as the families' own forwards compute it."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    num_experts = getattr(text_config, "num_experts", None) or getattr(model, "num_experts", None)
    if num_experts is None:
        raise ValueError(f"output_router_logits is set but {type(model).__name__}'s config names no num_experts")
    return load_balancing_loss_func(body.router_logits, num_experts, text_config.num_experts_per_tok, attention_mask)


@functools.cache
def _output_class() -> type:
    try:
        from trl.trainer.utils import FusedCausalLMOutput
    except ImportError as err:
        raise ImportError(
            "flce_policy.integrations.trl needs TRL >= 1.16 (trl.trainer.utils.FusedCausalLMOutput): "
            'pip install "flce-policy[trl]"'
        ) from err
    return FusedCausalLMOutput


class _NoGradient(torch.autograd.Function):
    """The entropy as given; a backward through it raises: the kernel computes no entropy gradient."""

    @staticmethod
    def forward(ctx: Any, entropy: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return entropy.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:  # type: ignore[override]
        raise RuntimeError(
            "flce-policy's fused head returns the entropy without a gradient; detach it (as SFTTrainer's metrics "
            "do), or use TRL's add_fused_lm_head for an entropy term in the loss"
        )
