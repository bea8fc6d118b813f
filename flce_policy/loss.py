"""The public loss: ``fused_linear_cross_entropy`` and its ``nn.Module``.

Checks the tensors (plain checks, clear messages), turns the policy into a Geometry once,
and hands both to the autograd Function. Differences from ``F.cross_entropy`` on explicit
logits are documented on :func:`fused_linear_cross_entropy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from flce_policy.call.options import LossOptions, Reduction, SoftcapRounding
from flce_policy.call.resolve import check_tensors, geometry_for
from flce_policy.call.targets import TargetCheck, start_target_check
from flce_policy.distributed.sharded import check_unsharded, is_dtensor
from flce_policy.distributed.vocab_parallel import GradInputMode, prepare_vocab_parallel
from flce_policy.plan.geometry import Geometry

if TYPE_CHECKING:
    from flce_policy.plan.oom import OOMFallback
    from flce_policy.plan.weight_filter import FilterRest

__all__ = ["fused_linear_cross_entropy", "FusedLinearCrossEntropyLoss", "FLCEOutput", "autocast_dtype"]


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


def fused_linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    policy: Any = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    class_weight: torch.Tensor | None = None,
    accum_dtype: torch.dtype | None = None,
    use_token_scaling: bool = False,
    return_predicted_tokens: bool = False,
    tp_group: Any = None,
    tp_grad_input: GradInputMode = "full",
    return_entropy: bool = False,
    softcap_rounding: SoftcapRounding = "fp32",
    grad_weight_filter: float | None = None,
    grad_weight_filter_rescue: int | None = None,
) -> torch.Tensor | FLCEOutput:
    """``cross_entropy(input @ weight.T + bias, target)`` without materialising the logits.

    Args:
        input: ``[..., H]`` activations (leading dims are flattened into BT rows).
        weight: ``[V, H]`` LM head (F.linear convention), same dtype and device as ``input``; under
            ``torch.autocast`` any float dtypes: the loss computes in the autocast dtype, as
            ``F.linear`` would, and returns each gradient in its tensor's dtype (an fp32 master
            weight's accumulated in fp32).
        target: ``[...]`` integer class indices (``input.shape[:-1]``); ``ignore_index`` skips a row.
        bias: optional ``[V]``.
        policy: an :class:`FLCEPolicy` (default: ``FLCEPolicy.default()``, which honours
            ``FLCE_POLICY_CONFIG``), a :class:`Geometry` for this exact problem, or a strategy.
            A slab that runs out of memory is retried at half the rows (``OOMFallbackWarning``);
            a policy sets the floor, may switch it off, and remembers the size that completed.
        softcap: logits become ``softcap * tanh(logits / softcap)`` before the loss.
        softcap_rounding: ``"fp32"`` (default) computes the softcap and its gradient in fp32 on the
            logits; ``"eager"`` rounds each of its three ops (``/ softcap``, ``tanh``, ``* softcap``) and
            each of their gradients to the logits' dtype, as eager PyTorch computes them on bf16/fp16
            logits (HF's Gemma forward): the same numbers as that path, less precise than fp32. No
            effect on fp32 logits or without ``softcap``.
        z_loss_scale: adds ``z_loss_scale * logsumexp(logits)**2`` per non-ignored token, averaged
            over the non-ignored tokens for ``mean`` (not class-weighted).
        class_weight: ``[V]`` per-class weights as ``F.cross_entropy``'s ``weight``: any sign; ``mean``
            divides by the kept targets' weight sum whatever its value (0 or NaN give NaN, as torch).
        accum_dtype: ``torch.float32`` accumulates grad_weight over chunks in fp32. None: what the
            geometry plans (``Fastest(accum="fp32")`` and ``FreeMemory(accum_dtype="float32")``
            plan fp32), else the weight dtype. Asking for another than the planned one is an error.
        use_token_scaling: multiply each token's loss (cross-entropy and z-loss), and so its
            gradient, by the detached predicted probability of its target (TRL's ``dft`` loss).
        return_predicted_tokens: return each token's argmax class (-1 where ignored).
        return_entropy: return each token's entropy (nats, fp32, detached, ``target``'s shape, 0 where
            ignored) of ``softmax(z)``, ``z`` the logits after ``softcap``: independent of label
            smoothing, class weights and token scaling. Computed in the same kernel pass (one more
            online partial sum), whatever the reduction. Not supported for a vocab-parallel head
            (``tp_group`` or a DTensor weight): NotImplementedError.
        tp_group: a ``torch.distributed`` process group over which the head is split along the
            vocabulary (vocab parallel): ``weight``, ``bias`` and ``class_weight`` are this rank's
            contiguous shard (shards in group-rank order, sizes may differ), ``input`` and
            ``target`` (global class ids) the same on every rank. Every rank gets the whole loss
            (and extras); the weight and bias gradients are the shard's. Collective: every rank of
            the group must call it alike. See :mod:`flce_policy.distributed.vocab_parallel`.
            Without ``tp_group``, a ``Shard(0)`` DTensor weight on a 1-D mesh (group from the mesh)
            is vocab parallel only with a DTensor ``input`` (as a ``ColwiseParallel`` module passes);
            with a plain input it is refused as a shard (an FSDP2 parameter outside its forward,
            say), naming the fix.
        grad_weight_filter: eps (e.g. ``2**-12``): grad_weight and grad_bias take only the tiles of
            dL/dlogits (32 rows of a chunk x 128 classes) in which some token's ``|p_c - [c == y]|`` is
            ``>= eps`` or that hold a target; ``p = softmax(z)``, ``z`` after the softcap, before every
            scale (reduction, ``grad_output``, class weight, token scaling, z-loss), so the threshold is
            per token. The loss, every extra and grad_input are bit for bit the unfiltered call's. With
            ``label_smoothing`` the threshold ignores the smoothing too, and a skipped tile drops its
            uniform ``-eps_ls/V`` term. None (default): the policy rule's ``grad_weight_filter`` (none
            unless a rule sets one: the dense path); a number here wins over the policy's, and ``0``
            (nothing skipped) runs the dense path. Given an :class:`FLCEPolicy`, a call whose flags bought
            nothing (so many tiles kept that grad_weight ran the dense GEMM) makes the policy run the
            problem's next filtered calls at that eps or below (``FILTER_REST_CALLS`` of
            :mod:`flce_policy.plan.weight_filter`) dense, without the flags' cost; then one flags again. See
            docs/grad_weight_filter.md.
        grad_weight_filter_rescue: N, a power of two in [2, 65536]: a tile the filter skips whose largest
            per-token ``|p - onehot|`` lies L octaves below eps is multiplied anyway with probability 2^-L (L at
            least 1, at most log2(N); picked by a hash of the tile's rows of ``input`` and its classes: other
            tiles on every step) and counted 2^L times, so grad_weight and grad_bias equal the dense ones in
            expectation: the filter's bias on training goes, for some of the skipped tiles' cost (most for the
            tiles just under eps, which carry most of what is dropped) and some noise in each call's
            grad_weight. None (default): the policy rule's (none unless a rule sets one). Needs
            a filter eps (the call's or the rule's): ValueError without one.
        tp_grad_input: ``"full"`` (default) returns the input gradient summed over the group
            (one all-reduce in backward); ``"partial"`` this rank's share, for a caller whose own
            parallel region all-reduces it.

    Differences from ``F.cross_entropy``: the loss is float32 whatever the input dtype; ``mean``
    over zero non-ignored tokens (all ignored, or empty input) is 0 with zero gradients, not NaN;
    ``V = 0`` is a ValueError; there is no second derivative: a gradient returned under
    ``create_graph=True`` requires grad, and differentiating it raises RuntimeError.
    """
    options = LossOptions(
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        softcap=softcap,
        softcap_rounding=softcap_rounding,
        z_loss_scale=z_loss_scale,
        return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy,
        accum_dtype=accum_dtype,
        use_token_scaling=use_token_scaling,
        return_predicted_tokens=return_predicted_tokens,
        return_entropy=return_entropy,
        grad_weight_filter=grad_weight_filter,
        grad_weight_filter_rescue=grad_weight_filter_rescue,
    )
    compute_dtype = autocast_dtype(input, weight, bias)
    # A Shard(0) DTensor weight is a tensor-parallel head when the input is a (replicated) DTensor
    # too, as inside a ColwiseParallel module's call; with a plain input it is more likely an FSDP2
    # shard handed over outside the forward that unshards it: check_unsharded says so.
    if tp_group is not None or (is_dtensor(weight) and is_dtensor(input)):
        loss, z_loss, accuracy, predicted, entropy = _vocab_parallel_loss(
            input, weight, target, bias, class_weight, options, policy, tp_group, tp_grad_input, compute_dtype
        )
    else:
        check_unsharded(input=input, weight=weight, bias=bias)  # a DTensor or ZeRO-3 shard: a clear error, not torch's
        if tp_grad_input != "full":
            raise ValueError("tp_grad_input applies to a vocab-parallel head only (tp_group or a DTensor weight)")
        x, target_flat, class_weight = check_tensors(input, weight, target, bias, class_weight, compute_dtype)
        if not weight.shape[0]:
            raise ValueError(
                f"weight has no rows: its vocabulary dimension V is 0 (weight is [V, H] = {tuple(weight.shape)}); "
                "cross-entropy needs at least one class"
            )
        if not x.shape[1]:
            x, weight = _one_zero_column(x, weight)
        if torch.compiler.is_compiling():
            # One opaque node (flce_policy/call/custom_op.py): the geometry is resolved and the target
            # range checked inside it, at run time.
            from flce_policy.call.custom_op import compiled_loss

            loss, z_loss, accuracy, predicted, entropy = compiled_loss(
                x, weight, bias, target_flat, class_weight, policy, options, compute_dtype
            )
        else:
            loss, z_loss, accuracy, predicted, entropy = _eager_loss(
                x, weight, bias, target_flat, class_weight, policy, options, compute_dtype
            )
    if reduction == "none":
        loss, z_loss = loss.view(target.shape), z_loss.view(target.shape)
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens or return_entropy):
        return loss
    return FLCEOutput(
        loss,
        z_loss if return_z_loss else None,
        accuracy if return_token_accuracy else None,
        predicted.view(target.shape) if return_predicted_tokens else None,
        entropy.view(target.shape) if return_entropy else None,
    )


def _vocab_parallel_loss(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    options: LossOptions,
    policy: Any,
    group: Any,
    grad_input: GradInputMode,
    compute_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The vocab-parallel path (flce_policy/distributed/vocab_parallel.py), eager only."""
    if isinstance(input, torch.Tensor) and input.dim() and not input.shape[-1]:
        raise NotImplementedError("a vocab-parallel head (tp_group or a DTensor weight) with hidden size H=0")
    if options.return_entropy:
        raise NotImplementedError(
            "return_entropy is not supported for a vocab-parallel head (tp_group or a DTensor weight) yet: "
            "its partial sums are not merged across the ranks"
        )
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "a vocab-parallel head (tp_group or a DTensor weight) is not supported under torch.compile yet: "
            "its per-chunk collectives run in the eager driver; wrap the loss call in torch.compiler.disable"
        )
    # An OOM retry on one rank alone would leave the others waiting in its collectives: no fallback.
    x, weight, bias, target_flat, class_weight, geometry, options, targets, filter_rest = prepare_vocab_parallel(
        input, weight, target, bias, class_weight, options, policy=policy, group=group,
        grad_input=grad_input, compute_dtype=compute_dtype,
    )  # fmt: skip
    return _apply(
        x, weight, bias, target_flat, class_weight, geometry, options, None, compute_dtype, targets, filter_rest
    )


def _eager_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    policy: Any,
    options: LossOptions,
    compute_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The target check started, the geometry resolved, the autograd Function run: its five results.

    The forward pass finishes the check once its kernels are queued (flce_policy/call/targets.py).
    """
    # queued by the driver after its first GEMM (flce_policy/call/targets.py says why), at the latest by finish
    target, targets = start_target_check(
        target, weight.shape[0], options.ignore_index, class_weight, options.reduction == "mean", deferred=True
    )
    if not x.shape[0]:
        return _apply(x, weight, bias, target, class_weight, None, options, None, compute_dtype, targets)
    geometry, fallback, filter_rest = geometry_for(policy, x, weight, compute_dtype or x.dtype)
    return _apply(
        x, weight, bias, target, class_weight, geometry, options, fallback, compute_dtype, targets, filter_rest
    )  # fmt: skip


def _apply(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    geometry: Geometry | None,
    options: LossOptions,
    fallback: OOMFallback | None,
    compute_dtype: torch.dtype | None,
    targets: TargetCheck,
    filter_rest: FilterRest | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The autograd Function on a resolved geometry, with the accumulator it planned; ``target`` is
    ``targets``' safe one."""
    if geometry is not None:
        options = options.following(geometry)

    from flce_policy.call.autograd import FLCEFunction

    return FLCEFunction.apply(
        x, weight, bias, target, class_weight, geometry, options, torch.is_grad_enabled(), fallback, compute_dtype,
        targets, filter_rest,
    )  # fmt: skip


def autocast_dtype(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype | None:
    """The dtype the loss computes in under ``torch.autocast`` when it differs from a tensor's; else None.

    ``F.linear`` under autocast runs in the autocast dtype whatever its operands' dtypes; the loss
    does the same (an fp32 master weight and fp32 or bf16 hidden states compute in bf16).
    """
    if not isinstance(input, torch.Tensor) or input.device.type not in ("cuda", "cpu"):
        return None  # check_tensors names the problem
    device_type = input.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    tensors = (input, weight) if bias is None else (input, weight, bias)
    if all(t.dtype == dtype for t in tensors if isinstance(t, torch.Tensor)):
        return None
    return dtype


class FusedLinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`; options are fixed at construction."""

    def __init__(self, policy: Any = None, **options: Any) -> None:
        super().__init__()
        self.policy = policy
        self.options = options
        # fail early on bad options (the tensor and group ones are checked at the call)
        LossOptions(**{k: v for k, v in options.items() if k not in ("class_weight", "tp_group", "tp_grad_input")})

    def forward(
        self, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | FLCEOutput:
        return fused_linear_cross_entropy(input, weight, target, bias, policy=self.policy, **self.options)

    def extra_repr(self) -> str:
        return ", ".join([f"policy={self.policy!r}"] + [f"{k}={v!r}" for k, v in self.options.items()])


def _one_zero_column(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [BT, 0]`` and ``weight [V, 0]`` with one zero column each: the same logits (zeros, plus the bias),
    so the kernels run an H=0 call as torch does (``mean`` is log V without a bias); autograd slices the
    gradients back to H=0. Only for that degenerate size: no copy on any other call."""
    return torch.nn.functional.pad(x, (0, 1)), torch.nn.functional.pad(weight, (0, 1))
