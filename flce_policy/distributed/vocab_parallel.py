"""The vocab-parallel loss: an LM head split along the vocabulary across a tensor-parallel group.

``fused_linear_cross_entropy(..., tp_group=group)`` (or a ``Shard(0)`` DTensor weight) lands here
before the autograd Function runs. Each rank holds a contiguous shard of the head's rows, in
group-rank order, of any size (``weight``, ``bias`` and ``class_weight`` are this rank's shard);
``input`` and ``target`` (global class ids) are the same on every rank. The call is collective: every
rank of the group must make it alike. Without ``tp_group``, a ``Shard(0)`` DTensor weight on a 1-D
mesh (the group from the mesh) is vocab parallel only with a DTensor ``input``, as a
``ColwiseParallel`` module passes; with a plain input it is refused as a shard (an FSDP2 parameter
outside its forward, say), naming the fix. This module:

- takes the local tensors out of DTensors (the weight's gradient goes back as a DTensor with the
  same placement: ``to_local`` is differentiable);
- agrees the call across the group with one small all-gather of each rank's shard size, shape,
  options, a checksum of the targets and its chunk size: every rank learns the shards' offsets and
  the global vocabulary, and a rank that disagrees is an error raised on every rank alike (no
  rank is left waiting in a collective);
- resolves this rank's geometry for its shard (``Problem.vocab`` is the shard, ``tp_size`` the
  group), then runs every rank at the smallest chunk size among them, since the row chunks'
  collectives must pair up;
- hands the driver a :class:`~flce_policy.kernels.vocab_shard.VocabShard`, which merges each row
  chunk's CE partials over the group (two all-reduces of ``[chunk]`` vectors);
- sums ``grad_input`` over the group once per call, in backward (``tp_grad_input="partial"``
  leaves this rank's share for a caller whose own parallel region all-reduces it).

The loss, z-loss, accuracy and predicted tokens come out whole on every rank; the weight and bias
gradients are the shard's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
import torch.distributed as dist

from flce_policy.call.plan import CallPlan, LossCall
from flce_policy.call.resolve import check_tensors, geometry_for
from flce_policy.call.targets import TargetCheck
from flce_policy.distributed.sharded import is_dtensor
from flce_policy.plan.geometry import Geometry

__all__ = ["GradInputMode", "is_vocab_parallel", "vocab_parallel_plan"]

GradInputMode = Literal["full", "partial"]
_GRAD_INPUT_MODES = ("full", "partial")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_REDUCTION_CODES = {"mean": 0, "sum": 1, "none": 2}


def is_vocab_parallel(input: Any, weight: Any, group: Any) -> bool:
    """Whether a call is a vocab-parallel head's: a ``tp_group``, or a ``Shard(0)`` DTensor weight with a
    (replicated) DTensor input, as inside a ColwiseParallel module's call. A DTensor weight with a plain input
    is more likely an FSDP2 shard handed over outside the forward that unshards it: not this path's."""
    return group is not None or (is_dtensor(weight) and is_dtensor(input))


def vocab_parallel_plan(call: LossCall) -> CallPlan:
    """Check and agree a vocab-parallel call over its group (see the module docstring); collective.

    Eager only, and with no OOM fallback: a retry on one rank alone would leave the others waiting in its
    collectives. The policy's grad_weight filter rest is this rank's shard problem's: a rank's flags and
    their dense fallback are its own (no collective), so ranks may rest apart.
    """
    _refuse_unsupported(call)
    # Imported here: the kernels pick interpreter or compiler at import (TRITON_INTERPRET), as call/run.py defers them.
    from flce_policy.kernels.vocab_shard import VocabShard

    options, grad_input, compute_dtype = call.options, call.tp_grad_input, call.compute_dtype
    if grad_input not in _GRAD_INPUT_MODES:
        raise ValueError(f"tp_grad_input must be 'full' or 'partial', got {grad_input!r}")
    input, weight, bias, class_weight, group = _local_tensors(
        call.input, call.weight, call.bias, call.class_weight, call.tp_group
    )
    rank, world = _rank_in(group)
    x, target_flat, class_weight = check_tensors(input, weight, call.target, bias, class_weight, compute_dtype)
    if weight.shape[0] == 0:
        raise ValueError(f"rank {rank} of tp_group holds an empty vocab shard (weight {tuple(weight.shape)})")
    dtype = compute_dtype or x.dtype
    resolved = geometry_for(call.policy, x, weight, dtype, tp_size=world) if x.shape[0] else (None,) * 3
    geometry, filter_rest = resolved[0], resolved[2]
    needs_input_grad = torch.is_grad_enabled() and input.requires_grad
    fields = _call_fields(x, target_flat, bias, class_weight, options, dtype, grad_input, needs_input_grad)
    sizes, chunk_sizes = _agree(fields, weight.shape[0], geometry, group, world, x.device)

    vocab, start = sum(sizes), sum(sizes[:rank])
    if class_weight is not None:
        class_weight = _whole_vocab(class_weight, start, vocab, group)
    # Waited for now, before the chunks' collectives: a bad target on every rank is the same error at once.
    targets = TargetCheck(target_flat, vocab, options.ignore_index, class_weight, options.reduction == "mean")
    try:
        targets.finish()
    except ValueError as err:
        raise ValueError(f"{err}: tp_group's {world} shard(s) hold {sizes} classes, V={vocab} in all") from None
    if geometry is not None and geometry.chunk_size != min(chunk_sizes):
        geometry = _with_rows(geometry, min(chunk_sizes), chunk_sizes)
    shard = VocabShard(group=group, start=start, stop=start + weight.shape[0], vocab=vocab)
    if grad_input == "full" and needs_input_grad and world > 1:
        x = _SumGradOverGroup.apply(x, group)
    options = dataclasses.replace(options, vocab_shard=shard)
    if geometry is not None:
        options = options.following(geometry)
    return CallPlan(
        x, weight, bias, targets.safe_target(), class_weight, options, compute_dtype, geometry, None, targets,
        filter_rest,
    )  # fmt: skip


def _refuse_unsupported(call: LossCall) -> None:
    """NotImplementedError for what a vocab-parallel head does not do yet, before any collective."""
    input = call.input
    if isinstance(input, torch.Tensor) and input.dim() and not input.shape[-1]:
        raise NotImplementedError("a vocab-parallel head (tp_group or a DTensor weight) with hidden size H=0")
    if call.options.return_entropy:
        raise NotImplementedError(
            "return_entropy is not supported for a vocab-parallel head (tp_group or a DTensor weight) yet: "
            "its partial sums are not merged across the ranks"
        )
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "a vocab-parallel head (tp_group or a DTensor weight) is not supported under torch.compile yet: "
            "its per-chunk collectives run in the eager driver; wrap the loss call in torch.compiler.disable"
        )


# --- DTensors and the group ---------------------------------------------------------------------------


def _local_tensors(input, weight, bias, class_weight, group):
    """The local shards of DTensor arguments, and the group (the weight's mesh unless given)."""
    if not is_dtensor(weight):
        for name, tensor in (("input", input), ("bias", bias), ("class_weight", class_weight)):
            if is_dtensor(tensor):
                raise TypeError(f"{name} is a DTensor but weight is not: pass the local shards, or all as DTensors")
        return input, weight, bias, class_weight, group
    from torch.distributed.tensor import Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"a DTensor weight must be sharded on dim 0 (the vocabulary) over a 1-D mesh, got placements "
            f"{tuple(weight.placements)} on a {mesh.ndim}-D mesh"
        )
    mesh_group = mesh.get_group()
    if group is not None and dist.get_process_group_ranks(group) != dist.get_process_group_ranks(mesh_group):
        raise ValueError(
            f"tp_group holds ranks {dist.get_process_group_ranks(group)} but the weight's mesh "
            f"{dist.get_process_group_ranks(mesh_group)}: pass the mesh's group, or none"
        )
    local = []
    for name, tensor, placement in (("bias", bias, Shard(0)), ("class_weight", class_weight, Shard(0))):
        if is_dtensor(tensor) and (tensor.device_mesh != mesh or tuple(tensor.placements) != (placement,)):
            raise ValueError(f"{name} must be sharded like the weight (Shard(0) on its mesh)")
        local.append(tensor.to_local() if is_dtensor(tensor) else tensor)
    if is_dtensor(input):
        if tuple(input.placements) != (Replicate(),):
            raise ValueError(f"a DTensor input must be replicated over the mesh, got {tuple(input.placements)}")
        input = input.to_local()
    return input, weight.to_local(), local[0], local[1], mesh_group


def _rank_in(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tp_group needs torch.distributed initialised (init_process_group) on every rank")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"tp_group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of tp_group")
    return rank, dist.get_world_size(group)


# --- agreeing the call ---------------------------------------------------------------------------------


def _call_fields(x, target, bias, class_weight, options, dtype, grad_input, needs_input_grad) -> dict[str, float]:
    """What every rank must have alike, as exact float64 values (the target checksum is one host sync)."""
    positions = torch.arange(target.numel(), device=target.device) % 7919 + 1
    return {
        "tokens (input rows)": x.shape[0],
        "hidden size": x.shape[1],
        "logits dtype": _DTYPE_CODES[dtype],
        "targets (checksum)": float((target * positions).sum().item()) if target.numel() else 0.0,
        "ignore_index": options.ignore_index,
        "reduction": _REDUCTION_CODES[options.reduction],
        "label_smoothing": options.label_smoothing,
        "softcap": -1.0 if options.softcap is None else options.softcap,
        "z_loss_scale": options.z_loss_scale,
        "use_token_scaling": options.use_token_scaling,
        "returned extras (z-loss, accuracy, predicted tokens)": 4 * options.return_z_loss
        + 2 * options.return_token_accuracy
        + options.return_predicted_tokens,
        "bias given": bias is not None,
        "class_weight given": class_weight is not None,
        "tp_grad_input": _GRAD_INPUT_MODES.index(grad_input),
        "input needs grad": needs_input_grad,
    }


def _agree(
    fields: dict[str, float], shard_rows: int, geometry: Geometry | None, group: Any, world: int, device: torch.device
) -> tuple[list[int], list[int]]:
    """All-gather every rank's fields, shard size and chunk size; ValueError (on every rank) where ranks differ."""
    chunk = 0 if geometry is None else geometry.chunk_size
    mine = torch.tensor([shard_rows, chunk, *fields.values()], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu().tolist()
    for column, name in enumerate(fields, start=2):
        values = [row[column] for row in table]
        if any(value != values[0] for value in values):
            by_rank = ", ".join(f"rank {r}: {v:g}" for r, v in enumerate(values))
            raise ValueError(f"the ranks of tp_group disagree on {name} ({by_rank}); every rank must pass the same")
    return [int(row[0]) for row in table], [int(row[1]) for row in table]


def _with_rows(geometry: Geometry, rows: int, chunk_sizes: list[int]) -> Geometry:
    """This rank's geometry at the group's row chunk (its vocab tile kept): the chunks' collectives pair up."""
    return Geometry.for_problem(
        geometry.problem,
        rows,
        vocab_chunk=geometry.vocab_chunk,
        accum_dtype=geometry.accum_dtype,
        overlap_weight_grad=geometry.overlap_weight_grad,
        strategy=f"{geometry.strategy}, at the smallest chunk among the TP ranks' {chunk_sizes}",
        rule=geometry.rule,
    )


def _whole_vocab(class_weight: torch.Tensor, start: int, vocab: int, group: Any) -> torch.Tensor:
    """Every shard's class weights in one ``[V]`` vector (the kernels index them by global class id)."""
    whole = torch.zeros(vocab, dtype=torch.float32, device=class_weight.device)
    whole[start : start + class_weight.shape[0]] = class_weight
    dist.all_reduce(whole, group=group)
    return whole


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over the group (once per call)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # The loss's own gradient buffer, summed in place: no second [BT, H] tensor.
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
