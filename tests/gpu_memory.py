"""What a GPU test needs of the card's memory: it runs where the card holds that, else it skips saying how much.

A test at a fixed shape estimates its own peak from what it holds at once (its inputs, the references it
keeps, the largest step of the largest reference: ``tests/gpu_reference.py``'s ``*_bytes``), so that an
80 GB card runs every test and a smaller one skips those it cannot hold, naming the memory they need.
"""

from __future__ import annotations

import pytest
import torch

GIB = 2**30
#: Beside a test's own tensors: the CUDA context, cuBLAS's and Triton's workspaces, the caching allocator's
#: rounding and fragments
OVERHEAD = 2 * GIB


def require_gpu_memory(need: int, what: str) -> None:
    """Skip the calling test unless the card's memory holds ``need`` bytes plus the overhead."""
    props = torch.cuda.get_device_properties(0)
    wanted = need + OVERHEAD
    if wanted > props.total_memory:
        pytest.skip(
            f"needs about {wanted / GIB:.0f} GiB of GPU memory ({what}); the {props.name} has "
            f"{props.total_memory / GIB:.0f} GiB"
        )
