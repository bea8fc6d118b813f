"""Probe the GPU the policy plans for: NVML first, torch.cuda as the fallback, the CPU when neither sees one.

CUDA and NVML number GPUs differently (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER), so a CUDA index is
mapped to its NVML device by UUID, never by position when CUDA_VISIBLE_DEVICES is set.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from flce_policy.plan.device import DeviceInfo, family_from_name

__all__ = ["probe_device", "probe_device_verbose", "device_for_tensor_device", "clear_probe_cache"]


class _Fallback(Exception):
    """NVML cannot describe the device; the message says why and becomes a note."""


def probe_device(index: int | None = None) -> DeviceInfo:
    """The device at CUDA index ``index`` (as torch numbers it; None = the current one). Memory in bytes.

    Never raises for a missing GPU (the result is then ``DeviceInfo.cpu()``); raises ValueError
    for an index out of range when GPUs exist.
    """
    return probe_device_verbose(index)[0]


def probe_device_verbose(index: int | None = None) -> tuple[DeviceInfo, list[str]]:
    """Like :func:`probe_device`, plus notes on how the device was found and why any fallback happened."""
    notes: list[str] = []
    cuda = _torch_cuda()
    if cuda is not None:
        index = cuda.current_device() if index is None else index
        _check_index(index, cuda.device_count())
    elif index is None:
        index = 0
    else:
        _check_index(index, None)
    try:
        return _probe_nvml(index, cuda, notes), notes
    except _Fallback as why:
        reason = str(why)
    if cuda is not None:
        notes.append(f"{reason}; used torch.cuda")
        return _probe_torch(cuda, index, notes), notes
    notes.append(f"{reason}; torch.cuda is unavailable too: no GPU, using the CPU")
    return DeviceInfo.cpu(), notes


@functools.cache
def _probe_cached(index: int) -> DeviceInfo:
    return probe_device(index)


def device_for_tensor_device(device: Any) -> DeviceInfo:
    """The probed device behind a torch device (``torch.device``, ``"cuda:1"``, ...), cached per CUDA index.

    Any non-CUDA device gives ``DeviceInfo.cpu()``. The cached free memory is that of the first probe.
    """
    import torch

    device = device if isinstance(device, torch.device) else torch.device(device)
    if device.type != "cuda":
        return DeviceInfo.cpu()
    return _probe_cached(torch.cuda.current_device() if device.index is None else device.index)


def clear_probe_cache() -> None:
    """Forget the devices :func:`device_for_tensor_device` has probed."""
    _probe_cached.cache_clear()


def _torch_cuda() -> Any | None:
    """``torch.cuda`` when torch is installed and sees a GPU, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda if torch.cuda.is_available() else None


def _check_index(index: Any, count: int | None) -> None:
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f"a CUDA device index must be an int, got {index!r}")
    if index < 0 or (count is not None and index >= count):
        visible = "" if count is None else f"; {count} CUDA device(s) visible (0..{count - 1})"
        raise ValueError(f"CUDA device index {index} is out of range{visible}")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _uuid_key(uuid: str) -> str:
    """A UUID without its "GPU-"/"MIG-" prefix, lower case, for comparing torch's and NVML's spellings."""
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith(("gpu-", "mig-")) else uuid


def _is_mig_name(name: str) -> bool:
    return "MIG" in name.split()  # torch names a MIG slice "NVIDIA A100-SXM4-40GB MIG 1g.5gb"


def _torch_uuid(cuda: Any, index: int) -> str | None:
    """torch's UUID of CUDA device ``index`` spelled as NVML does ("GPU-xxxxxxxx-..."), or None."""
    props = cuda.get_device_properties(index)
    raw = getattr(props, "uuid", None)
    text = _text(raw).strip() if raw is not None else ""
    if not text:
        return None
    if text.upper().startswith(("GPU-", "MIG-")):
        return text
    return ("MIG-" if _is_mig_name(str(props.name)) else "GPU-") + text


def _probe_nvml(index: int, cuda: Any | None, notes: list[str]) -> DeviceInfo:
    try:
        import pynvml
    except ImportError:
        raise _Fallback("NVML unavailable: nvidia-ml-py (pynvml) is not installed") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise _Fallback(f"NVML unavailable: {type(err).__name__} ({err})") from None
    try:  # nvmlInit/nvmlShutdown are reference counted, so pairing them per probe is safe
        handle = _nvml_handle(pynvml, index, cuda, notes)
        if _mig_enabled(pynvml, handle):
            raise _Fallback("MIG is enabled on this GPU: NVML's whole-GPU memory is not the slice's")
        name = _text(pynvml.nvmlDeviceGetName(handle))
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
    except pynvml.NVMLError as err:
        raise _Fallback(f"NVML query failed: {type(err).__name__} ({err})") from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return DeviceInfo(
        name=name,
        family=family_from_name(name),
        total_memory_bytes=int(memory.total),
        free_memory_bytes=int(memory.free),
        compute_capability=(int(major), int(minor)),
        uuid=uuid,
        index=index,
        source="nvml",
    )


def _probe_torch(cuda: Any, index: int, notes: list[str]) -> DeviceInfo:
    props = cuda.get_device_properties(index)
    try:
        free: int | None = int(cuda.mem_get_info(index)[0])
    except RuntimeError as err:
        free = None
        notes.append(f"torch.cuda.mem_get_info failed ({err}); free memory unknown")
    name = str(props.name)
    return DeviceInfo(
        name=name,
        family=family_from_name(name),
        total_memory_bytes=int(props.total_memory),
        free_memory_bytes=free,
        compute_capability=(int(props.major), int(props.minor)),
        uuid=_torch_uuid(cuda, index),
        index=index,
        source="torch",
    )


def _mig_enabled(pynvml: Any, handle: Any) -> bool:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:  # NotSupported: a GPU without MIG
        return False
    return current == pynvml.NVML_DEVICE_MIG_ENABLE


def _nvml_handle(pynvml: Any, index: int, cuda: Any | None, notes: list[str]) -> Any:
    """The NVML handle of CUDA device ``index``: by torch's UUID, else by reading CUDA_VISIBLE_DEVICES."""
    count = pynvml.nvmlDeviceGetCount()
    if count == 0:
        raise _Fallback("NVML sees no GPU")
    uuid = _torch_uuid(cuda, index) if cuda is not None else None
    if uuid is not None:
        if uuid.upper().startswith("MIG-"):
            raise _Fallback(f"CUDA device {index} is a MIG slice ({uuid}): NVML's whole-GPU memory is not the slice's")
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            if _uuid_key(_text(pynvml.nvmlDeviceGetUUID(handle))) == _uuid_key(uuid):
                notes.append(f"CUDA device {index} is NVML device {i} (matched by UUID {uuid})")
                return handle
        raise _Fallback(f"no NVML GPU has CUDA device {index}'s UUID {uuid} (a MIG slice?)")

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        if index >= count:
            if cuda is not None:
                raise _Fallback(f"CUDA device {index} has no UUID from torch and NVML sees only {count} GPU(s)")
            raise ValueError(f"CUDA device index {index} is out of range; NVML sees {count} GPU(s) (0..{count - 1})")
        how = "torch gives no UUID" if cuda is not None else "torch.cuda is unavailable"
        notes.append(f"{how}; CUDA_VISIBLE_DEVICES unset: took NVML device {index}, assuming the same order")
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    entries = _visible_entries(visible)
    if index >= len(entries):
        if cuda is not None or not entries:
            raise _Fallback(f"CUDA_VISIBLE_DEVICES={visible!r} names no GPU for CUDA device {index}")
        raise ValueError(
            f"CUDA device index {index} is out of range; CUDA_VISIBLE_DEVICES={visible!r} "
            f"makes {len(entries)} device(s) visible (0..{len(entries) - 1})"
        )
    entry = entries[index]
    notes.append(f"no UUID from torch: read CUDA_VISIBLE_DEVICES={visible!r}, whose entry {index} is {entry!r}")
    if entry.upper().startswith("MIG-"):
        raise _Fallback(f"CUDA device {index} is a MIG slice ({entry}): NVML's whole-GPU memory is not the slice's")
    if entry.isdigit():
        if int(entry) >= count:
            raise _Fallback(f"CUDA_VISIBLE_DEVICES entry {entry} is not among NVML's {count} GPU(s)")
        notes.append("assumed CUDA orders GPUs as NVML does (PCI bus order, as with CUDA_DEVICE_ORDER=PCI_BUS_ID)")
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    matches = [h for h in handles if _uuid_key(_text(pynvml.nvmlDeviceGetUUID(h))).startswith(_uuid_key(entry))]
    if len(matches) != 1:
        raise _Fallback(f"CUDA_VISIBLE_DEVICES entry {entry!r} matches {len(matches)} NVML GPUs, not one")
    return matches[0]


def _visible_entries(value: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries up to the first invalid one (CUDA ignores the rest)."""
    entries: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not (entry.isdigit() or entry.upper().startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries
