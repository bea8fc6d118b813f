"""Hugging Face transformers: train a causal LM through the fused loss with one call, :func:`apply_flce`.

The patch keeps the model's own forward. When a call has ``labels`` and autograd is recording
(``torch.is_grad_enabled()`` and a parameter or an input tensor requires grad; ``train()`` or
``eval()`` alike), the model's ``lm_head`` (its output embeddings) is asked, for that one call, to
compute the loss of the hidden states it is given instead of their logits, and to return empty
logits; the model's ``loss_function`` then returns that loss. Everything the family's forward does
around them (the body, ``logits_to_keep``, MoE router losses added as the family adds them, its
output class and tuple) runs unchanged. The loss is computed inside the head module's own call,
so the hooks that FSDP2 or DeepSpeed attach to that module have gathered its weight; the empty
logits depend on the loss and the loss returned depends on them, so the module's backward hooks
(FSDP2's unshard, ZeRO-3's re-gather before the weight's gradient is accumulated) fire as they do
for any layer. Without labels, or with autograd not recording (evaluation under ``no_grad``), the
original forward runs and returns the logits.

:func:`causal_lm_loss` is the loss alone: HF's ``ForCausalLMLoss`` on hidden states.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flce_policy.call.options import LossOptions
from flce_policy.distributed.sharded import gathered_zero3
from flce_policy.integrations.hf_families import (
    LogitTransform,
    forward_logit_reads,
    logit_transform,
    unapplied_forward_reads,
)
from flce_policy.loss import FLCEOutput, fused_linear_cross_entropy

__all__ = ["apply_flce", "causal_lm_loss", "remove_flce", "FLCE_OUTPUT_FIELDS"]

#: Extra fields an ``apply_flce`` model's output carries when their option is set (TRL reads token_accuracy).
FLCE_OUTPUT_FIELDS = ("z_loss", "token_accuracy", "predicted_tokens", "entropy")
#: Loss options the causal-LM loss decides itself (HF's semantics): not accepted as options.
_FIXED_OPTIONS = ("reduction", "ignore_index")
#: Training wrappers whose ``.module`` is the model (DeepSpeed's engine, DDP): apply_flce patches the model.
_WRAPPERS = ("DeepSpeedEngine", "DistributedDataParallel")


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    policy: Any = None,
    **loss_options: Any,
) -> torch.Tensor | FLCEOutput:
    """HF's ``ForCausalLMLoss(lm_head(hidden_states) * logit_scale, labels, ...)`` without the logits.

    ``labels [B, T]`` are padded with ``ignore_index`` and shifted by one, as HF does (position t
    predicts label t+1); ``shift_labels``, when given, are used as they are instead (as HF does).
    With ``num_items_in_batch`` (the non-ignored tokens of the whole accumulated batch, as HF
    Trainer passes it) the summed loss is divided by it, else the mean over this call's non-ignored
    tokens is taken. A tensor ``num_items_in_batch`` stays on the device (no host sync). ``logit_scale`` multiplies the
    logits (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``), applied exactly by scaling
    the hidden states. Other keywords go to :func:`~flce_policy.fused_linear_cross_entropy`
    (``softcap``, ``z_loss_scale``, ``use_token_scaling``, ``return_token_accuracy``, ...);
    ``reduction`` is HF's and not an option here.
    """
    for name in _FIXED_OPTIONS[:1]:
        if name in loss_options:
            raise TypeError(
                f"causal_lm_loss takes no {name!r}: HF's semantics fix it (sum / num_items_in_batch or mean)"
            )
    if num_items_in_batch is not None and (
        isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, torch.Tensor))
    ):
        raise TypeError(
            f"num_items_in_batch must be an int or a tensor (the batch's non-ignored token count), "
            f"got {type(num_items_in_batch).__name__} {num_items_in_batch!r}"
        )
    if labels is None and shift_labels is None:
        raise ValueError("causal_lm_loss needs labels (shifted here) or shift_labels (used as given, as HF does)")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden_states.device)
    if logit_scale != 1.0:
        if bias is not None:
            raise ValueError("a logit scale with an lm_head bias is not linear in the hidden states; not supported")
        hidden_states = hidden_states * logit_scale
    reduction = "mean" if num_items_in_batch is None else "sum"
    out = fused_linear_cross_entropy(
        hidden_states,
        weight,
        shift_labels,
        bias,
        policy=policy,
        ignore_index=ignore_index,
        reduction=reduction,
        **loss_options,
    )
    if num_items_in_batch is None:
        return out
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(hidden_states.device)
    if isinstance(out, FLCEOutput):
        z_loss = None if out.z_loss is None else out.z_loss / num_items_in_batch
        return out._replace(loss=out.loss / num_items_in_batch, z_loss=z_loss)
    return out / num_items_in_batch


@dataclasses.dataclass
class _Patch:
    """What ``apply_flce`` keeps on the model: the settings, the originals, pending fused calls."""

    policy: Any
    options: dict[str, Any]
    transform: LogitTransform
    original_forward: Any
    original_loss_function: Any  # the instance's own ``_loss_function`` before the patch (None: the class's)
    pending: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def apply_flce(model: nn.Module, policy: Any = None, **loss_options: Any) -> nn.Module:
    """Patch ``model`` (this instance) so that a training call with labels computes its loss through FLCE.

    ``model`` is a transformers causal LM (``*ForCausalLM``, or an image-text
    ``*ForConditionalGeneration`` whose forward calls its ``lm_head`` and ``self.loss_function``;
    a PEFT model is unwrapped to its base model). When a call has ``labels`` and autograd is
    recording (``torch.is_grad_enabled()`` and a parameter or an input tensor requires grad), in
    ``train()`` or ``eval()`` mode alike, the forward returns HF's loss (``num_items_in_batch`` and
    ``shift_labels`` honoured, the MoE router loss added by the family's own code, the family's
    softcap and logit scale applied, read from its text config where it has one) with
    ``logits=None`` (``[B, T, 0]`` logits in a ``return_dict=False`` tuple): the ``[B, T, V]``
    logits are never made. Otherwise (no labels; evaluation under ``torch.no_grad()``, where HF's
    Trainer wants the logits) the original forward runs. A model whose forward changes its logits
    in a way the family table does not apply, or whose loss is not HF's ``ForCausalLMLoss``, is
    refused with a ``ValueError`` naming what it does. A softcap is rounded as HF's forward rounds
    it (``softcap_rounding="eager"``: each op in the logits' dtype) unless
    ``softcap_rounding="fp32"`` is passed. ``policy`` and ``loss_options`` (``z_loss_scale``,
    ``use_token_scaling``, ``return_token_accuracy``, ``return_predicted_tokens``, ``accum_dtype``,
    ``return_entropy``, ...) go to :func:`causal_lm_loss`; returned extras land on the output as
    ``token_accuracy``, ``z_loss`` (None unless ``return_z_loss=True``), ``predicted_tokens``,
    ``entropy``. Applying it again replaces the settings. Returns ``model``.
    """
    base = _unwrap(model)
    for name in _FIXED_OPTIONS + ("softcap", "bias", "class_weight"):
        if name in loss_options:
            source = "HF's loss semantics" if name in _FIXED_OPTIONS else "its config and lm_head"
            raise TypeError(f"apply_flce takes no {name!r}: it follows the model ({source})")
    LossOptions(**loss_options)  # bad option names or values fail here, not at the first step
    head = _output_embeddings(base)  # a model without an lm_head fails now
    previous = getattr(base, "_flce_patch", None)
    original = previous.original_forward if previous is not None else base.forward
    own_loss = previous.original_loss_function if previous is not None else base.__dict__.get("_loss_function")
    read = _check_forward(base, head, own_loss)
    transform = logit_transform(base.config, read)
    if transform.softcap is not None:
        # HF's forward softcaps the logits op by op in their dtype: the same roundings, the same losses
        loss_options = {"softcap_rounding": "eager", **loss_options}
    patch = _Patch(policy, dict(loss_options), transform, original, own_loss)
    base._flce_patch = patch
    base.forward = _patched_forward(base, patch)
    base.loss_function = _patched_loss_function(base, patch)
    _intercept_head(base, patch)  # now, not inside a (possibly compiled) first step
    return model


def remove_flce(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_flce` on this instance (forward, loss function and head's forward become the originals)."""
    base = _unwrap(model)
    patch = base.__dict__.pop("_flce_patch", None)
    if patch is not None:
        base.__dict__.pop("forward", None)
        base.__dict__.pop("_loss_function", None)
        if patch.original_loss_function is not None:
            base._loss_function = patch.original_loss_function
        head = base.get_output_embeddings()
        if head is not None:
            for name in ("forward", "_flce_head", "_flce_original_forward"):
                head.__dict__.pop(name, None)
    return model


def _check_forward(base: nn.Module, head: nn.Module, own_loss: Any) -> tuple[str, ...] | None:
    """Refuse a model whose loss the fused path would compute differently (ValueError naming why).

    Returns the attribute names its forward reads between its head and its loss (None: source unknown).
    """
    from transformers.loss.loss_utils import ForCausalLMLoss

    name = type(base).__name__
    if not isinstance(getattr(type(base), "loss_function", None), property):
        raise TypeError(f"apply_flce needs a transformers PreTrainedModel (with a loss_function), got {name}")
    loss_function = _hf_loss_function(base, own_loss)
    if loss_function is not ForCausalLMLoss:
        raise ValueError(
            f"{name}'s loss_function is {getattr(loss_function, '__name__', loss_function)!r} (loss_type="
            f"{getattr(base, 'loss_type', None)!r}), not HF's ForCausalLMLoss: apply_flce computes only that loss"
        )
    head_path = next(path for path, module in base.named_modules() if module is head)
    found = forward_logit_reads(base, head_path)
    if found is not None and not found[1]:
        raise ValueError(
            f"{name}.forward does not compute its loss with self.loss_function (HF's standard shape), so "
            "apply_flce cannot take its place; train it with its own loss"
        )
    stray = unapplied_forward_reads(base, head_path)
    if stray:
        raise ValueError(
            f"{name}.forward changes its logits between {head_path} and its loss with {', '.join(stray)}, which "
            "flce-policy does not apply (flce_policy/integrations/hf_families.py): refusing rather than computing "
            "a different loss"
        )
    return None if found is None else tuple(chain.rsplit(".", 1)[-1] for chain in found[0])


def _hf_loss_function(base: nn.Module, own_loss: Any) -> Any:
    """The loss function HF's ``loss_function`` property gives ``base`` without apply_flce's."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    return own_loss if own_loss is not None else LOSS_MAPPING.get(getattr(base, "loss_type", None), ForCausalLMLoss)


def _autograd_recording(base: nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
    """The fused loss runs when gradients will be asked for: grad mode on and something requiring grad."""
    if not torch.is_grad_enabled():
        return False
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in (*args, *kwargs.values())):
        return True
    return any(p.requires_grad for p in base.parameters())


def _unwrap(model: nn.Module) -> nn.Module:
    while type(model).__name__ in _WRAPPERS and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    # PEFT's PeftModel forwards to its base model's forward; patching the base covers both.
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) and type(model).__name__.startswith("Peft") else model
    if not hasattr(base, "config") or not callable(getattr(base, "get_output_embeddings", None)):
        raise TypeError(
            f"apply_flce needs a transformers *ForCausalLM model (with .config and get_output_embeddings()), "
            f"got {type(model).__name__}"
        )
    return base


def _output_embeddings(base: nn.Module) -> nn.Module:
    head = base.get_output_embeddings()
    params = getattr(head, "_parameters", None)
    # Looked at, not read: under ZeRO-3 reading head.weight in the model's forward gathers it for the
    # whole forward (DeepSpeed's getter makes it an external parameter of the root); only the head's
    # own call, under its own hooks, should gather it. A partitioned weight's shape is its ds_shape.
    weight = dict.get(params, "weight") if isinstance(params, dict) else getattr(head, "weight", None)
    shape = getattr(weight, "ds_shape", None) or getattr(weight, "shape", ())
    if hasattr(head, "base_layer") or hasattr(head, "modules_to_save"):
        # PEFT's LoRA layer or modules_to_save copy: the head's output is not its base weight's alone
        raise TypeError(
            f"{type(base).__name__}'s lm_head is wrapped by an adapter ({type(head).__name__}: PEFT's LoRA or "
            "modules_to_save on lm_head); apply_flce computes the loss from a plain [V, H] head weight and would "
            "leave the adapter out: keep lm_head out of target_modules and modules_to_save"
        )
    if head is None or not isinstance(weight, torch.Tensor) or len(shape) != 2:
        raise TypeError(
            f"{type(base).__name__}.get_output_embeddings() returned {type(head).__name__}, not a linear LM head "
            "with a [V, H] weight: apply_flce cannot compute this model's loss"
        )
    return head


def _patched_forward(base: nn.Module, patch: _Patch) -> Any:
    @functools.wraps(patch.original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels")
        if labels is None or not _autograd_recording(base, args, kwargs):
            return patch.original_forward(*args, **kwargs)
        if isinstance(labels, torch.Tensor) and labels.device.type == "meta":
            raise ValueError("apply_flce: labels are on the meta device (no values); pass them on the model's device")
        call = {
            "labels": labels,
            "shift_labels": kwargs.get("shift_labels"),
            "num_items_in_batch": kwargs.get("num_items_in_batch"),
        }
        _intercept_head(base, patch)
        patch.pending.append(call)
        try:
            out = patch.original_forward(*args, **kwargs)
        finally:
            patch.pending.pop()
        if "result" not in call:
            raise RuntimeError(
                f"{type(base).__name__}.forward never called its lm_head (get_output_embeddings()), so apply_flce "
                "computed no loss; this model's forward does not have HF's standard shape"
            )
        if not call.get("returned"):
            raise RuntimeError(
                f"{type(base).__name__}.forward never called self.loss_function with the labels, so apply_flce's "
                "loss was not used; this model's forward does not have HF's standard shape"
            )
        return _without_logits(out, call["result"])

    return forward


def _patched_loss_function(base: nn.Module, patch: _Patch) -> Any:
    """HF's loss function, answered from the pending call's fused loss (HF's own when none is pending)."""

    def loss_function(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None, **kwargs: Any) -> Any:
        if not patch.pending:
            return _hf_loss_function(base, patch.original_loss_function)(logits, labels, vocab_size, **kwargs)
        call = patch.pending[-1]
        same = (
            labels is call["labels"]
            and kwargs.get("shift_labels") is call["shift_labels"]
            and kwargs.get("num_items_in_batch") is call["num_items_in_batch"]
            and kwargs.get("ignore_index", -100) == -100
        )
        if "result" not in call or not same or logits.shape[-1] != 0:
            raise RuntimeError(
                f"{type(base).__name__}.forward computed its loss from other labels, options or logits than the ones "
                "its lm_head was given; apply_flce cannot stand in for this model's loss"
            )
        call["returned"] = True
        result = call["result"]
        loss = result.loss if isinstance(result, FLCEOutput) else result
        # exactly 0: routes the backward through the head's output (_EmptyLogits) and what followed it
        return loss + logits.sum() if logits.requires_grad else loss

    return loss_function


def _intercept_head(base: nn.Module, patch: _Patch) -> None:
    """Give the current head (looked up per call: PEFT or wrappers may replace it) the loss-computing forward."""
    head = _output_embeddings(base)
    if head.__dict__.get("_flce_head") is patch:
        return
    # a head patched by an earlier apply_flce keeps its true original, not a chain of patches
    original = head.__dict__.get("_flce_original_forward", head.forward)

    def head_forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not patch.pending:
            return original(hidden_states, *args, **kwargs)
        call = patch.pending[-1]
        if "result" in call:
            raise RuntimeError(
                f"{type(base).__name__}.forward called its lm_head twice in one step; apply_flce supports one call"
            )
        weight, bias = head.weight, getattr(head, "bias", None)
        with gathered_zero3(weight, bias) as gathered:
            if gathered and weight.requires_grad and torch.is_grad_enabled():
                raise RuntimeError(_UNHOOKED_ZERO3)
            call["result"] = causal_lm_loss(
                hidden_states,
                weight,
                call["labels"],
                bias,
                shift_labels=call["shift_labels"],
                num_items_in_batch=call["num_items_in_batch"],
                softcap=patch.transform.softcap,
                logit_scale=patch.transform.scale,
                policy=patch.policy,
                **patch.options,
            )
        result = call["result"]
        loss = result.loss if isinstance(result, FLCEOutput) else result
        # Empty logits: whatever the family does to them next (softcap, slicing) costs nothing.
        return _EmptyLogits.apply(loss, hidden_states)

    head.forward = head_forward
    head._flce_head = patch
    head._flce_original_forward = original


_UNHOOKED_ZERO3 = (
    "lm_head.weight is a ZeRO-3 partitioned parameter that DeepSpeed's hooks did not gather for the head's "
    "forward, so its gradient could not be accumulated into it; train the model as deepspeed.initialize (or "
    "the HF Trainer / accelerate) returned it, whose hooks gather the head for its forward and backward"
)


class _EmptyLogits(torch.autograd.Function):
    """``[..., 0]`` logits that depend on the loss, so that the loss returned can depend on them.

    Module backward hooks are attached to a module's outputs (FSDP2 unshards there, ZeRO-3
    re-gathers the weight before its gradient is accumulated); the loss flows through this output
    (:func:`_with_loss` adds its empty sum) so that they fire before the loss's own backward.
    """

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.loss_dtype = loss.dtype
        return hidden_states.new_empty((*hidden_states.shape[:-1], 0))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return torch.zeros((), dtype=ctx.loss_dtype, device=grad.device), None


def _without_logits(out: Any, result: torch.Tensor | FLCEOutput) -> Any:
    """HF's output of the call (its loss is the fused one, plus the family's router loss) without the logits.

    A tuple (``return_dict=False``) is HF's own, with the empty ``[B, T, 0]`` logits in place.
    """
    if isinstance(out, tuple):
        return out
    # A new output of the family's class: ModelOutput drops a None field only when it is built.
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    new = type(out)(loss=out.loss, **fields)
    if isinstance(result, FLCEOutput):
        for name in FLCE_OUTPUT_FIELDS:
            value = getattr(result, name)
            if value is not None:
                new[name] = value
    return new
