"""GPU (marker ``gpu``): the OOM fallback against the allocator's real OOM, FreeMemory against real free memory.

Filler tensors take the card's memory until what is left is sized from ``flce_policy.plan.memory``'s
prediction: too little for the geometry the policy asks for, enough for half of it. Skipped
without CUDA; run with ``TRITON_INTERPRET=0 python -m pytest tests/test_gpu_oom.py -m gpu -s``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from gpu_reference import make_inputs

from flce_policy import FLCEPolicy, OOMFallbackWarning, fused_linear_cross_entropy
from flce_policy.engine.probe import device_for_tensor_device
from flce_policy.kernels.driver import observe_chunks
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.memory import held_beside_slab, predict_peak
from flce_policy.plan.memory_now import available_bytes
from flce_policy.plan.problem import Problem
from flce_policy.strategies import FixedChunkSize, FreeMemory, HeuristicC

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GIB, MIB = 2**30, 2**20
# x 64 MiB, W 1 GiB; one chunk of 8192 rows is a 2 GiB slab, and the call's peak ~3.1 GiB.
TOKENS, HIDDEN, VOCAB = 8192, 4096, 131072
PROBLEM = Problem(TOKENS, HIDDEN, VOCAB, dtype="bfloat16")
# Beyond the prediction: the CE workspace, cuBLAS's workspace, the loss scalars, allocator rounding.
SLACK = 512 * MIB


class Filler:
    """Takes the card's memory until a given number of bytes is left free, and none cached; gives it back.

    The allocator's cached blocks are taken first: inside segments still partly in use they cannot
    be released, and whether one can hold a slab depends on the history (on an H200, 0.6 GiB of
    them could not hold a 1 GiB slab in one run, and 2 GiB of them held a 2 GiB slab in another).
    """

    def __init__(self) -> None:
        self.device = device_for_tensor_device(torch.device("cuda"))
        self.tensors: list[torch.Tensor] = []

    def leave(self, left: int) -> int:
        """Allocate until ``left`` bytes are free; returns what is then available (free + cached-unallocated)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._take_cached()
        take = torch.cuda.mem_get_info()[0] - left
        assert take > 0, f"only {torch.cuda.mem_get_info()[0]} bytes are free, less than {left}"
        while take > 0:
            size = min(GIB, take)
            self.tensors.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            take -= size
        return available_bytes(self.device)

    def _take_cached(self) -> None:
        size = GIB
        while size >= 2 * MIB:
            reserved = torch.cuda.memory_reserved()
            if reserved - torch.cuda.memory_allocated() < size:
                size //= 2
                continue
            self.tensors.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            if torch.cuda.memory_reserved() > reserved:  # no cached block held it: it took a new segment
                size //= 2

    def release(self) -> None:
        self.tensors.clear()
        torch.cuda.empty_cache()


@pytest.fixture
def filler():
    filler = Filler()
    yield filler
    filler.release()


@pytest.fixture(scope="module")
def inputs():
    x, w, y = make_inputs(TOKENS, HIDDEN, VOCAB, torch.bfloat16)
    yield x, w, y
    del x, w, y
    torch.cuda.empty_cache()


def leaves(x, w):
    """x and W as leaves needing grad, made before any filler so they do not eat what is left."""
    return x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()


def run(x, w, y, policy):
    """(loss, grad_input, grad_weight) of one fwd+bwd of the leaves ``x``, ``w``, and the chunk events it ran."""
    with observe_chunks() as events:
        loss = fused_linear_cross_entropy(x, w, y, policy=policy)
        loss.backward()
    torch.cuda.synchronize()
    result = (loss.detach(), x.grad, w.grad)
    x.grad = w.grad = None
    return result, events


def run_recording(x, w, y, policy):
    """:func:`run`, plus the OOMFallbackWarnings it raised and its peak above what was allocated before."""
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result, events = run(x, w, y, policy)
    peak = torch.cuda.max_memory_allocated()
    messages = [str(w.message) for w in record if issubclass(w.category, OOMFallbackWarning)]
    return result, events, messages, peak - before


def warm_up(x, w, y, *chunks):
    """Compile the kernels and set up cuBLAS for these chunk sizes while memory is plentiful."""
    for chunk in chunks:
        run(x, w, y, Geometry.for_problem(PROBLEM, chunk))


def test_a_slab_the_card_cannot_hold_falls_back_to_one_it_can(inputs, filler):
    x, w, y = inputs
    x, w = leaves(x, w)
    big, half = Geometry.for_problem(PROBLEM, 8192), Geometry.for_problem(PROBLEM, 4096)
    warm_up(x, w, y, 8192, 4096, 2048)
    left = predict_peak(half).total_bytes + SLACK
    assert left < predict_peak(big).total_bytes  # the slab of 8192 rows cannot fit in what is left

    available = filler.leave(left)
    result, events, messages, call_peak = run_recording(
        x, w, y, FLCEPolicy(default=FixedChunkSize(8192), slab_form="logits")
    )

    completed = events[-1].slab_shape[0]  # the chunk size of the attempt that completed
    print(
        f"fell back from 8192 to {completed} rows with {left / GIB:.2f} GiB free ({available / GIB:.2f} GiB "
        f"available); call peak {call_peak / GIB:.2f} GiB"
    )
    assert completed == 4096  # what is left was sized for it: halving once is enough
    assert len(messages) == 1, messages
    assert "at 8192 rows" in messages[0] and f"completed at {completed} rows" in messages[0]
    assert call_peak <= available, "the call used more than was available"
    assert torch.cuda.max_memory_allocated() < torch.cuda.get_device_properties(0).total_memory

    filler.release()
    clean, clean_events = run(x, w, y, Geometry.for_problem(PROBLEM, completed))
    assert [e.rows for e in clean_events] == [e.rows for e in events[-len(clean_events) :]]
    for got, want in zip(result, clean, strict=True):
        assert torch.equal(got, want)


def test_the_next_step_starts_from_the_remembered_geometry(inputs, filler):
    x, w, y = inputs
    x, w = leaves(x, w)
    warm_up(x, w, y, 8192, 4096, 2048)
    policy = FLCEPolicy(default=FixedChunkSize(8192), slab_form="logits")  # the form its references run
    filler.leave(predict_peak(Geometry.for_problem(PROBLEM, 4096)).total_bytes + SLACK)
    _, first_events, first_messages, _ = run_recording(x, w, y, policy)
    _, second_events, second_messages, _ = run_recording(x, w, y, policy)
    completed = first_events[-1].slab_shape[0]
    assert len(first_messages) == 1 and second_messages == []
    assert {e.slab_shape[0] for e in second_events} == {completed}  # no attempt at 8192 rows
    device = device_for_tensor_device(x.device)
    assert policy.resolve(PROBLEM, device).chunk_size == completed


@pytest.mark.parametrize(
    ("cap", "chunk"),
    [
        # (free + cached - reserve - held) * 0.5 = (2.5 GiB + cached) * 0.5: 1.25 GiB (5120 rows of 256 KiB)
        # to 2 GiB (8192 rows) with up to 1.5 GiB cached -> 4096
        (None, 4096),
        # Liger's C=1: cdiv(131072, 4096) = 32; 8192 / 32 = 256 rows, under what fits
        (HeuristicC(c=1), 256),
    ],
)
def test_free_memory_sizes_a_slab_that_fits_what_is_left(inputs, filler, cap, chunk):
    x, w, y = inputs
    x, w = leaves(x, w)
    warm_up(x, w, y, chunk)
    strategy = FreeMemory(fraction=0.5, reserve="512MiB", cap=cap)
    left = filler.leave(held_beside_slab(PROBLEM) + 512 * MIB + 5 * GIB // 2)
    device = device_for_tensor_device(x.device)
    geometry = strategy.geometry(PROBLEM, device)
    assert geometry.chunk_size == chunk
    assert predict_peak(geometry).total_bytes + 512 * MIB <= left

    result, events, messages, call_peak = run_recording(x, w, y, FLCEPolicy(default=strategy))
    print(
        f"free_memory (cap {cap!r}) picked {chunk} rows with {left / GIB:.2f} GiB left; peak {call_peak / GIB:.2f} GiB"
    )
    assert messages == []  # no OOM, no fallback
    assert {e.slab_shape[0] for e in events} == {chunk}
    assert call_peak <= left
    assert torch.isfinite(result[0])
