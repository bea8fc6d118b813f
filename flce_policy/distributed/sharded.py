"""Sharded parameters (FSDP2 DTensors, DeepSpeed ZeRO-3 partitions): recognised, named, and gathered.

The loss needs the whole ``[V, H]`` head on this rank. Under FSDP2 the head is a sharded
``DTensor`` outside the forward that unsharded it; under DeepSpeed ZeRO-3 it is a partitioned
parameter (``ds_id`` set, an empty local tensor) outside the forward that gathered it. Handed to
the loss there, torch fails on mixed tensors or, worse, backward fails on a shape; here it is a
``TypeError`` that says what was passed and how to fix it. DeepSpeed is duck-typed (never
imported) unless a partitioned parameter is really to be gathered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["check_unsharded", "describe_sharded", "gathered_zero3", "is_dtensor", "is_zero3_partitioned"]

_FIX = (
    "call the loss through the model's forward (flce_policy.integrations.transformers.apply_flce computes it "
    "inside the lm_head module's own call, where FSDP2 and ZeRO-3 have gathered the weight and route its "
    "gradient), or gather it first (FSDP2: the FSDP module's unshard(), then reshard(); ZeRO-3: "
    "deepspeed.zero.GatheredParameters([weight]) inside the engine's forward); for a tensor-parallel "
    "(vocab-parallel) head, pass tp_group=... (or the input as a replicated DTensor, as a ColwiseParallel "
    "module call does)"
)


def is_zero3_partitioned(tensor: Any) -> bool:
    """Whether ``tensor`` is a DeepSpeed ZeRO-3 parameter whose full value is not on this rank now."""
    if not hasattr(tensor, "ds_id"):
        return False
    status = getattr(getattr(tensor, "ds_status", None), "name", None)
    return status != "AVAILABLE" or tensor.numel() == 0


def is_dtensor(tensor: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (checked without importing the DTensor package)."""
    return isinstance(tensor, torch.Tensor) and type(tensor).__name__ == "DTensor"


def describe_sharded(tensor: Any) -> str | None:
    """What makes ``tensor`` a shard rather than the whole tensor (None for an ordinary tensor)."""
    if is_dtensor(tensor):
        mesh = tensor.device_mesh
        return (
            f"a DTensor (placements {tuple(tensor.placements)}, mesh {tuple(mesh.mesh_dim_names or ())}"
            f"{tuple(mesh.shape)} on {mesh.device_type}, global shape {tuple(tensor.shape)}, "
            f"local shape {tuple(tensor.to_local().shape)})"
        )
    if is_zero3_partitioned(tensor):
        status = getattr(getattr(tensor, "ds_status", None), "name", "?")
        return (
            f"a DeepSpeed ZeRO-3 partitioned parameter (ds_id {tensor.ds_id}, ds_status {status}, "
            f"full shape {tuple(getattr(tensor, 'ds_shape', ()))}, local shape {tuple(tensor.shape)})"
        )
    return None


def check_unsharded(**tensors: Any) -> None:
    """TypeError naming the first of ``tensors`` (by keyword) that is a shard, and the fix."""
    for name, tensor in tensors.items():
        what = describe_sharded(tensor)
        if what is not None:
            raise TypeError(
                f"fused_linear_cross_entropy got {name} as {what}; it needs the whole tensor on this rank: {_FIX}"
            )


@contextlib.contextmanager
def gathered_zero3(*params: Any) -> Iterator[bool]:
    """Gather the ZeRO-3-partitioned ones among ``params`` for the block (``GatheredParameters``).

    Yields whether anything had to be gathered. Parameters that are not DeepSpeed's, or are
    already available (DeepSpeed's module hooks gathered them), are left alone and DeepSpeed is not
    imported.
    """
    partitioned = [p for p in params if p is not None and is_zero3_partitioned(p)]
    if not partitioned:
        yield False
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield True
