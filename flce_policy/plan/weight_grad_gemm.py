"""Which GEMM runs a row chunk's grad_weight update: cuBLAS, or the overlapped Gluon kernel where measured faster.

A chunk of n rows updates the whole ``[V, H]`` gradient with a GEMM of depth n. cuBLAS's beta=1 GEMM reads and
writes the gradient after its main loop; at a few hundred rows that read-modify-write is a third of its time. The
Gluon kernel (:mod:`flce_policy.kernels.weight_grad_gemm`) fetches each block of the gradient while the tensor cores
work, but its main loop (128x128 tiles) runs slower than cuBLAS's once n grows. Per chunk after the first, on an
H100 80GB HBM3 against cuBLAS: 0.77x at 128 rows, 0.74-0.81x at 256, 0.79x at 384, 0.96-0.98x at 512, 1.15x at
640, 1.39-1.42x at 1024 (V x H = 262144 x 5376; 0.74-0.96x from 128 to 512 rows and 1.16x at 640 at 128256 x 4096).
In the loss it pays up to 384 rows (8-13% faster at 384-row chunks of 8192x5376x262144 and 32768x4096x128256); at 512
its gain per chunk is lost (-1.0% to +1.4% against cuBLAS in four runs): reading stops at 384.
The first chunk, with nothing to read, stays on cuBLAS (0.86-1.19x either way up to 512 rows). The chunk's geometry
is the same either way: this picks an implementation of one GEMM, not the rows or the memory. Raw output:
results/2026-12-05-h100/README.md (``weight_grad_gemm_bench``).

Past 384 rows, up to 640, the Gluon kernel adds its update to the gradient in memory instead, by TMA's bulk reduce
(the SMs never read the gradient; cuBLAS where this Triton lacks it). On an H100, two runs, per chunk against cuBLAS:
1.05x at 256 rows, 0.98x at 384, 0.91-0.92x at 512, 0.94x at 640, 1.00-1.07x at 768, 1.14x at 1024 (262144 x 5376;
0.96-0.97x at 512-640 rows at 128256 x 4096); in the loss at 512- and 640-row chunks of 8192x5376x262144 and
32768x4096x128256 0.5-3.7% faster than cuBLAS on both slabs (eight pairs, one run).
The kernel's main loop alone (writing, as for a first chunk) runs 0.88x cuBLAS's beta=0 GEMM at 256 rows, 1.08x at
512 and 1.11x at 640 (one run): at 256 rows the bulk reduce limits the add (2.97 ms against 1.26 ms written), at 640
the main loop does (2.97 against 2.94). 64x256 tiles ran 1.2-1.7x cuBLAS's beta=0 time, 5 stages no faster.

``FLCE_POLICY_WEIGHT_GRAD_GEMM=cublas`` keeps every chunk on cuBLAS (``auto``, the default: this rule);
``reduce`` adds in memory at every chunk after the first, at any rows, on any Hopper GPU whose Triton has the bulk
reduce.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from flce_policy.plan.device import KNOWN_GPUS, WGMMA_COMPUTE_CAPABILITY

if TYPE_CHECKING:  # the annotation only: geometry imports nothing of this module either
    from flce_policy.plan.geometry import Geometry

__all__ = [
    "GLUON_WEIGHT_GRAD_FAMILIES",
    "GLUON_WEIGHT_GRAD_MAX_ROWS",
    "IN_MEMORY_WEIGHT_GRAD_MAX_ROWS",
    "WEIGHT_GRAD_GEMM_ENV_VAR",
    "planned_weight_grad_gemm",
    "weight_grad_gemm_for",
    "weight_grad_gemm_setting",
]

#: The GPU families the Gluon kernel was measured on (others keep cuBLAS until measured).
GLUON_WEIGHT_GRAD_FAMILIES = frozenset({"H100"})
#: The most rows a chunk after the first may have for its grad_weight to run on the Gluon kernel reading the old block.
GLUON_WEIGHT_GRAD_MAX_ROWS = 384
#: The most rows (past GLUON_WEIGHT_GRAD_MAX_ROWS) for the Gluon kernel adding its update in memory instead.
IN_MEMORY_WEIGHT_GRAD_MAX_ROWS = 640
#: The environment variable that pins grad_weight's GEMM: "auto" (this rule), "cublas" or "reduce".
WEIGHT_GRAD_GEMM_ENV_VAR = "FLCE_POLICY_WEIGHT_GRAD_GEMM"
_SETTINGS = ("auto", "cublas", "reduce")
_HOPPER_FAMILIES = frozenset(gpu.family for gpu in KNOWN_GPUS if gpu.compute_capability == WGMMA_COMPUTE_CAPABILITY)


def weight_grad_gemm_setting() -> str:
    """:data:`WEIGHT_GRAD_GEMM_ENV_VAR`'s value ("auto" when unset); ValueError naming the variable for any other."""
    value = os.environ.get(WEIGHT_GRAD_GEMM_ENV_VAR, "").strip().lower() or "auto"
    if value not in _SETTINGS:
        given = os.environ[WEIGHT_GRAD_GEMM_ENV_VAR]
        raise ValueError(f"{WEIGHT_GRAD_GEMM_ENV_VAR}={given!r}: expected one of {', '.join(_SETTINGS)}")
    return value


def weight_grad_gemm_for(family: str, rows: int, *, first: bool, in_memory_available: bool = True) -> str:
    """Which GEMM updates grad_weight for a chunk of ``rows`` rows on a GPU of ``family``: "cublas", "gluon" (the
    Gluon kernel reading the old block) or "gluon_in_memory" (the Gluon kernel adding its update in memory).

    cuBLAS for the first chunk (``first``, the gradient unread), on unmeasured GPUs and wherever the setting is
    "cublas"; the setting "reduce" adds in memory at any rows on a Hopper GPU. Under "auto" the in-memory rows need
    ``in_memory_available`` (the TMA bulk reduce in this Triton), else they stay on cuBLAS."""
    setting = weight_grad_gemm_setting()
    if first or setting == "cublas" or rows < 1:
        return "cublas"
    if setting == "reduce":
        return "gluon_in_memory" if family in _HOPPER_FAMILIES else "cublas"
    if family not in GLUON_WEIGHT_GRAD_FAMILIES:
        return "cublas"
    if rows <= GLUON_WEIGHT_GRAD_MAX_ROWS:
        return "gluon"
    if rows <= IN_MEMORY_WEIGHT_GRAD_MAX_ROWS and in_memory_available:
        return "gluon_in_memory"
    return "cublas"


def planned_weight_grad_gemm(geometry: Geometry, family: str, master_dtype: str | None = None) -> str:
    """Which GEMM a call of ``geometry`` on a GPU of ``family`` runs its chunks after the first on: as
    :func:`weight_grad_gemm_for` says for its chunk rows (row chunks, a bf16 gradient accumulated in bf16; Triton's
    Gluon and its bulk reduce present at run time), else "cublas";
    ``master_dtype`` as :meth:`Geometry.accumulator_dtype` takes it. With a grad_weight filter "cublas": its chunks
    run the filter's kernel (those a policy's rest runs dense take this rule)."""
    runs = (
        geometry.is_row_only
        and geometry.num_chunks > 1
        and geometry.grad_weight_filter is None
        and geometry.problem.dtype == "bfloat16"
        and geometry.accumulator_dtype(None, master_dtype) == "bfloat16"
    )
    return weight_grad_gemm_for(family, geometry.chunk_size, first=False) if runs else "cublas"
