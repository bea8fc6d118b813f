"""Problem, Geometry and DeviceInfo: validation, derived fields, immutability."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from flce_policy.plan.device import KNOWN_GPUS, DeviceInfo, family_from_name
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.problem import Problem

MIB = 2**20
GIB = 2**30

# --- Problem -------------------------------------------------------------------------------------------------------


def test_problem_fields_and_default_dtype():
    problem = Problem(8192, 5376, 262144)
    assert (problem.tokens, problem.hidden, problem.vocab, problem.dtype) == (8192, 5376, 262144, "bfloat16")
    assert problem.itemsize == 2
    assert Problem(tokens=1, hidden=1, vocab=1) == Problem(1, 1, 1, "bf16")


@pytest.mark.parametrize("field", ["tokens", "hidden", "vocab"])
@pytest.mark.parametrize("bad", [0, -1, 2.5, "many", None])
def test_problem_sizes_must_be_positive_integers(field, bad):
    sizes = {"tokens": 8, "hidden": 8, "vocab": 8, field: bad}
    with pytest.raises(ValidationError, match=field):
        Problem(**sizes)


@pytest.mark.parametrize(
    ("dtype", "name", "itemsize"),
    [
        ("bf16", "bfloat16", 2),
        ("BF16", "bfloat16", 2),
        ("bfloat16", "bfloat16", 2),
        ("fp16", "float16", 2),
        ("half", "float16", 2),
        ("float16", "float16", 2),
        ("fp32", "float32", 4),
        ("float", "float32", 4),
        ("float32", "float32", 4),
        (torch.bfloat16, "bfloat16", 2),
        (torch.float16, "float16", 2),
        (torch.half, "float16", 2),
        (torch.float32, "float32", 4),
        (torch.float, "float32", 4),
    ],
)
def test_problem_dtype_aliases(dtype, name, itemsize):
    problem = Problem(8, 8, 8, dtype)
    assert (problem.dtype, problem.itemsize) == (name, itemsize)


@pytest.mark.parametrize("dtype", ["int8", "float64", "fp8", "", torch.float64, torch.int32, 2, None])
def test_problem_rejects_unsupported_dtypes(dtype):
    with pytest.raises(ValidationError, match="dtype"):
        Problem(8, 8, 8, dtype)


def test_problem_is_frozen_and_rejects_extra_fields():
    problem = Problem(8, 8, 8)
    with pytest.raises(ValidationError):
        problem.tokens = 16  # type: ignore[misc]
    with pytest.raises(ValidationError, match="batch"):
        Problem(8, 8, 8, batch=2)


def test_problem_from_tensors_flattens_leading_dims():
    x = torch.empty(4, 3, 64, dtype=torch.bfloat16)
    w = torch.empty(1000, 64, dtype=torch.bfloat16)
    assert Problem.from_tensors(x, w) == Problem(12, 64, 1000, "bfloat16")
    assert Problem.from_tensors(torch.empty(5, 32), torch.empty(7, 32)) == Problem(5, 32, 7, "float32")
    assert Problem.from_tensors(torch.empty(2, 2, 2, 16, dtype=torch.float16), torch.empty(9, 16)).tokens == 8


def test_problem_from_tensors_rejects_bad_shapes():
    with pytest.raises(ValueError, match="hidden size 64"):
        Problem.from_tensors(torch.empty(4, 3, 32), torch.empty(1000, 64))
    with pytest.raises(ValueError, match="2-D"):
        Problem.from_tensors(torch.empty(4, 64), torch.empty(1000, 64, 1))
    with pytest.raises(ValueError):
        Problem.from_tensors(torch.empty(0, 64), torch.empty(1000, 64))  # no tokens
    with pytest.raises(ValueError, match="dtype"):
        Problem.from_tensors(torch.empty(4, 64, dtype=torch.float64), torch.empty(1000, 64))


# --- Geometry ------------------------------------------------------------------------------------------------------


def test_geometry_for_problem_row_only():
    problem = Problem(1000, 64, 5000, "bf16")
    geometry = Geometry.for_problem(problem, 256)
    assert geometry.chunk_size == 256
    assert geometry.num_chunks == 4  # ceil(1000 / 256)
    assert geometry.last_chunk_size == 232  # 1000 - 3 * 256
    assert geometry.vocab_chunk == 5000
    assert geometry.num_vocab_chunks == 1
    assert geometry.slab_bytes == 256 * 5000 * 2
    assert geometry.is_row_only
    assert (geometry.strategy, geometry.rule) == ("manual", None)


def test_geometry_for_problem_with_vocab_tiles_and_fp32():
    problem = Problem(4096, 64, 5000, "fp32")
    geometry = Geometry.for_problem(problem, 1024, vocab_chunk=2048, strategy="S", rule="r1")
    assert (geometry.num_chunks, geometry.last_chunk_size) == (4, 1024)
    assert geometry.num_vocab_chunks == 3  # ceil(5000 / 2048)
    assert geometry.slab_bytes == 1024 * 2048 * 4
    assert not geometry.is_row_only
    assert (geometry.strategy, geometry.rule) == ("S", "r1")


@pytest.mark.parametrize(("tokens", "chunk", "num", "last"), [(1, 1, 1, 1), (7, 2, 4, 1), (8, 8, 1, 8), (9, 8, 2, 1)])
def test_geometry_chunk_counts(tokens, chunk, num, last):
    geometry = Geometry.for_problem(Problem(tokens, 4, 4), chunk)
    assert (geometry.num_chunks, geometry.last_chunk_size) == (num, last)


@pytest.mark.parametrize(
    ("chunk_size", "vocab_chunk", "match"),
    [(0, None, "chunk_size"), (1001, None, "chunk_size"), (2.0, None, "chunk_size"), (8, 5001, "vocab_chunk")],
)
def test_geometry_for_problem_rejects_bad_extents(chunk_size, vocab_chunk, match):
    with pytest.raises(ValueError, match=match):
        Geometry.for_problem(Problem(1000, 64, 5000), chunk_size, vocab_chunk=vocab_chunk)


def _fields(**overrides):
    """Consistent fields of a direct construction (BT=1000, V=5000, bf16, 256 rows), then overrides."""
    fields = dict(
        problem=Problem(1000, 64, 5000),
        chunk_size=256,
        num_chunks=4,
        vocab_chunk=5000,
        num_vocab_chunks=1,
        slab_bytes=256 * 5000 * 2,
    )
    return fields | overrides


def test_geometry_direct_construction_when_consistent():
    assert Geometry(**_fields()) == Geometry.for_problem(Problem(1000, 64, 5000), 256)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_chunks": 5}, "num_chunks"),
        ({"num_chunks": 3}, "num_chunks"),
        ({"slab_bytes": 256 * 5000 * 4}, "slab_bytes"),
        ({"num_vocab_chunks": 2}, "num_vocab_chunks"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 1024, "num_chunks": 1, "slab_bytes": 1024 * 5000 * 2}, "chunk_size"),
        ({"vocab_chunk": 5001, "slab_bytes": 256 * 5001 * 2}, "vocab_chunk"),
        ({"vocab_chunk": 0}, "vocab_chunk"),
        ({"extra": 1}, "extra"),
    ],
)
def test_geometry_direct_construction_rejects_inconsistent_fields(overrides, field):
    with pytest.raises(ValidationError, match=field):
        Geometry(**_fields(**overrides))


def test_geometry_is_frozen_and_with_origin_copies():
    geometry = Geometry.for_problem(Problem(1000, 64, 5000), 256)
    with pytest.raises(ValidationError):
        geometry.chunk_size = 128  # type: ignore[misc]
    relabelled = geometry.with_origin(strategy="FixedChunkSize(chunk_size=256)", rule="default")
    assert (relabelled.strategy, relabelled.rule) == ("FixedChunkSize(chunk_size=256)", "default")
    assert (relabelled.chunk_size, relabelled.slab_bytes) == (256, 2_560_000)
    assert geometry.strategy == "manual"


# --- DeviceInfo ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "name", "low", "high", "cc"),
    [
        # NVML reports 81559 MiB for an H100 SXM (80 GB) and 143771 MiB for an H200 (141 GB).
        ("H100", "NVIDIA H100 80GB HBM3", 81559 * MIB, 81559 * MIB, (9, 0)),
        ("H200", "NVIDIA H200", 143771 * MIB, 143771 * MIB, (9, 0)),
        ("B300", "NVIDIA B300 SXM6 AC", 260 * GIB, 290 * GIB, (10, 3)),  # 288 GB of HBM3e
    ],
)
def test_synthetic_devices(family, name, low, high, cc):
    device = DeviceInfo.synthetic(family)
    assert (device.family, device.name, device.compute_capability) == (family, name, cc)
    assert low <= device.total_memory_bytes <= high
    assert (device.source, device.free_memory_bytes, device.is_gpu) == ("override", None, True)


def test_synthetic_is_case_and_space_insensitive():
    assert DeviceInfo.synthetic(" h200 ") == DeviceInfo.synthetic("H200")


def test_synthetic_memory_grows_h100_h200_b300():
    sizes = [DeviceInfo.synthetic(f).total_memory_bytes for f in ("H100", "H200", "B300")]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3


def test_synthetic_unknown_family_lists_known_ones():
    with pytest.raises(ValueError, match="Z9000") as err:
        DeviceInfo.synthetic("Z9000")
    for family in ("H100", "H200", "B300", "GB200", "A100", "RTX 4090"):
        assert family in str(err.value)


def test_every_known_family_has_a_synthetic_device_whose_name_maps_back():
    for gpu in KNOWN_GPUS:
        device = DeviceInfo.synthetic(gpu.family)
        assert family_from_name(device.name) == device.family == gpu.family


def test_cpu_device_and_frozen():
    cpu = DeviceInfo.cpu()
    assert (cpu.family, cpu.source, cpu.total_memory_bytes, cpu.is_gpu) == ("cpu", "none", 0, False)
    with pytest.raises(ValidationError):
        cpu.family = "H100"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="source"):
        DeviceInfo(name="x", family="x", total_memory_bytes=1, source="guess")
    with pytest.raises(ValidationError, match="total_memory_bytes"):
        DeviceInfo(name="x", family="x", total_memory_bytes=-1, source="none")
