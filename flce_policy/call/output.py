"""What a loss call returns: the loss alone, or :class:`FLCEOutput` with the extras asked for."""

from __future__ import annotations

from typing import NamedTuple

import torch

from flce_policy.call.options import LossOptions

__all__ = ["FLCEOutput", "LossResults", "loss_output"]

#: What a call computes, per row where ``reduction="none"``: ``(loss, z_loss, accuracy, predicted, entropy)``,
#: the last two None when not asked for.
LossResults = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class FLCEOutput(NamedTuple):
    """Returned when any of ``return_z_loss``, ``return_token_accuracy``, ``return_predicted_tokens``,
    ``return_entropy`` is set.

    ``z_loss`` (already included in ``loss``), ``token_accuracy`` (share of non-ignored tokens
    whose argmax logit is the target), ``predicted_tokens`` (int64, ``target``'s shape: each
    token's argmax class, -1 where the target is ignored) and ``entropy`` (fp32 nats, ``target``'s
    shape: each token's entropy of the softmax of its logits, after the softcap; 0 where ignored)
    are detached, for logging; ``None`` when not requested.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor | None
    token_accuracy: torch.Tensor | None
    predicted_tokens: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def loss_output(results: LossResults, shape: torch.Size, options: LossOptions) -> torch.Tensor | FLCEOutput:
    """``results`` in ``shape`` (the target's), as the caller asked for them: the loss alone unless an extra was."""
    loss, z_loss, accuracy, predicted, entropy = results
    if options.reduction == "none":
        loss, z_loss = loss.view(shape), z_loss.view(shape)
    if not (
        options.return_z_loss or options.return_token_accuracy or options.return_predicted_tokens
        or options.return_entropy
    ):  # fmt: skip
        return loss
    return FLCEOutput(
        loss,
        z_loss if options.return_z_loss else None,
        accuracy if options.return_token_accuracy else None,
        predicted.view(shape) if options.return_predicted_tokens else None,
        entropy.view(shape) if options.return_entropy else None,
    )
