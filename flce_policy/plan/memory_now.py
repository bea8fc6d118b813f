"""How much memory a new allocation on a GPU can get right now: the one place live memory is read.

Tests replace :func:`available_bytes` to size slabs against synthetic numbers.
"""

from __future__ import annotations

from flce_policy.plan.device import DeviceInfo

__all__ = ["available_bytes"]


def available_bytes(device: DeviceInfo) -> int:
    """Free device memory plus what torch's caching allocator holds reserved but unallocated.

    Both are memory the next allocation can have: the allocator reuses its cached blocks first
    and, when none is large enough, frees them and asks the driver again. It is an upper bound
    (a cached block inside a segment still partly in use cannot be handed back whole), which is
    why :class:`~flce_policy.strategies.FreeMemory` takes only a fraction of it.
    Raises ValueError for a device that is not a live CUDA device (a planning device, the CPU).
    """
    if not device.is_gpu or device.index is None:
        raise ValueError(
            f"{device.name} is not a live CUDA device (no CUDA index: a planned GPU or the CPU); "
            "free memory is only known on the GPU the loss runs on"
        )
    import torch  # deferred: planning without a GPU never needs torch

    try:
        free, _total = torch.cuda.mem_get_info(device.index)
        cached = torch.cuda.memory_reserved(device.index) - torch.cuda.memory_allocated(device.index)
    except (RuntimeError, AssertionError) as err:  # no CUDA build, or no such device
        raise ValueError(f"cannot read free memory of CUDA device {device.index} ({device.name}): {err}") from None
    return int(free) + int(cached)
