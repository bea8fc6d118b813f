"""What the policy knows about a GPU: the probe's result, and a table of known GPU families."""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from flce_policy.plan.units import format_bytes

__all__ = [
    "DeviceInfo",
    "KnownGPU",
    "KNOWN_GPUS",
    "TMA_COMPUTE_CAPABILITY",
    "WGMMA_COMPUTE_CAPABILITY",
    "family_from_name",
    "DeviceSource",
]

DeviceSource = Literal["nvml", "torch", "none", "override"]
#: The first GPUs with TMA (tensor memory accelerator) loads, which the grad_weight filter's and the scaled-exp
#: slab's kernels use: Hopper.
TMA_COMPUTE_CAPABILITY = (9, 0)
#: The GPUs whose warpgroup MMA (wgmma) the Gluon GEMMs are written for: Hopper only (sm_100 has none).
WGMMA_COMPUTE_CAPABILITY = (9, 0)

_MIB = 2**20


class KnownGPU(NamedTuple):
    """A GPU family: how its NVML name reads, and nominal figures for planning without one."""

    family: str
    name_pattern: str  # regex searched in the NVML/torch device name, case-insensitive
    example_name: str  # the NVML name of the common (SXM) part
    total_memory_bytes: int  # nominal, as NVML reports it for example_name
    compute_capability: tuple[int, int]


# Order matters: the first pattern that matches a name wins, so more specific names come first
# (GB200 before B200, H200 and H20 before H100's neighbours). Memory figures are nominal: what
# NVML reports for the common part (MiB as nvidia-smi shows them), or the datasheet where unseen.
KNOWN_GPUS: tuple[KnownGPU, ...] = (
    KnownGPU("GB300", r"\bGB300\b", "NVIDIA GB300", 288 * 10**9, (10, 3)),
    KnownGPU("GB200", r"\bGB200\b", "NVIDIA GB200", 186 * 10**9, (10, 0)),
    KnownGPU("GH200", r"\bGH200\b", "NVIDIA GH200 480GB", 97871 * _MIB, (9, 0)),
    KnownGPU("B300", r"\bB300\b", "NVIDIA B300 SXM6 AC", 288 * 10**9, (10, 3)),
    KnownGPU("B200", r"\bB200\b", "NVIDIA B200", 183359 * _MIB, (10, 0)),
    KnownGPU("H200", r"\bH200\b", "NVIDIA H200", 143771 * _MIB, (9, 0)),
    KnownGPU("H100", r"\bH100\b", "NVIDIA H100 80GB HBM3", 81559 * _MIB, (9, 0)),
    KnownGPU("H800", r"\bH800\b", "NVIDIA H800", 81559 * _MIB, (9, 0)),
    KnownGPU("H20", r"\bH20\b", "NVIDIA H20", 97871 * _MIB, (9, 0)),
    KnownGPU("A100", r"\bA100\b", "NVIDIA A100-SXM4-80GB", 81920 * _MIB, (8, 0)),
    KnownGPU("A800", r"\bA800\b", "NVIDIA A800-SXM4-80GB", 81920 * _MIB, (8, 0)),
    KnownGPU("L40S", r"\bL40S\b", "NVIDIA L40S", 46068 * _MIB, (8, 9)),
    KnownGPU("L40", r"\bL40\b", "NVIDIA L40", 46068 * _MIB, (8, 9)),
    KnownGPU("L4", r"\bL4\b", "NVIDIA L4", 23034 * _MIB, (8, 9)),
    KnownGPU("A10G", r"\bA10G\b", "NVIDIA A10G", 23028 * _MIB, (8, 6)),
    KnownGPU("A10", r"\bA10\b", "NVIDIA A10", 23028 * _MIB, (8, 6)),
    KnownGPU("RTX 5090", r"RTX\s*5090", "NVIDIA GeForce RTX 5090", 32607 * _MIB, (12, 0)),
    KnownGPU("RTX 4090", r"RTX\s*4090", "NVIDIA GeForce RTX 4090", 24564 * _MIB, (8, 9)),
    KnownGPU("RTX 3090", r"RTX\s*3090", "NVIDIA GeForce RTX 3090", 24576 * _MIB, (8, 6)),
    KnownGPU("V100", r"\bV100\b", "Tesla V100-SXM2-32GB", 32768 * _MIB, (7, 0)),
    KnownGPU("T4", r"\bT4\b", "Tesla T4", 15360 * _MIB, (7, 5)),
)
_BY_FAMILY = {gpu.family.lower(): gpu for gpu in KNOWN_GPUS}


def family_from_name(name: str) -> str:
    """Normalise a raw device name ("NVIDIA H100 80GB HBM3") to its family ("H100"), else "unknown"."""
    for gpu in KNOWN_GPUS:
        if re.search(gpu.name_pattern, name, flags=re.IGNORECASE):
            return gpu.family
    return "unknown"


class DeviceInfo(BaseModel):
    """One device as the policy sees it. Memory in bytes; ``source`` says who reported it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="raw device name (NVML's, or torch's)")
    family: str = Field(description='normalised family: "H100", "H200", "B300", ..., "cpu" or "unknown"')
    total_memory_bytes: int = Field(ge=0)
    free_memory_bytes: int | None = Field(default=None, ge=0, description="free at probe time, if known")
    compute_capability: tuple[int, int] | None = None
    uuid: str | None = None
    index: int | None = Field(default=None, description="CUDA device index (as torch numbers it)")
    source: DeviceSource

    @classmethod
    def synthetic(cls, family: str) -> DeviceInfo:
        """A known GPU (nominal figures) for planning on a machine without it: ``synthetic("H100")``."""
        if not isinstance(family, str):
            raise TypeError(
                f"DeviceInfo.synthetic(family): family must be a GPU family name such as 'H100', got {family!r}"
            )
        gpu = _BY_FAMILY.get(family.strip().lower())
        if gpu is None:
            known = ", ".join(g.family for g in KNOWN_GPUS)
            raise ValueError(f"unknown GPU family {family!r}; known families: {known}")
        return cls(
            name=gpu.example_name,
            family=gpu.family,
            total_memory_bytes=gpu.total_memory_bytes,
            compute_capability=gpu.compute_capability,
            source="override",
        )

    @classmethod
    def known(cls) -> list[DeviceInfo]:
        """Every known GPU family as :meth:`synthetic` plans for it, the largest memory first."""
        return [cls.synthetic(gpu.family) for gpu in sorted(KNOWN_GPUS, key=lambda g: -g.total_memory_bytes)]

    @classmethod
    def cpu(cls) -> DeviceInfo:
        """The device of a machine with no usable GPU."""
        return cls(name="cpu", family="cpu", total_memory_bytes=0, source="none")

    @property
    def is_gpu(self) -> bool:
        return self.family != "cpu"

    def describe(self) -> str:
        memory = f"{format_bytes(self.total_memory_bytes)} total"
        if self.free_memory_bytes is not None:
            memory += f", {format_bytes(self.free_memory_bytes)} free"
        cc = f", sm_{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else ""
        return f"{self.name} [family {self.family}] ({memory}{cc}; via {self.source})"
