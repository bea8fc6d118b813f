"""The device probe: NVML first (mapped by UUID), torch.cuda as the fallback, the CPU without a GPU.

NVML and torch.cuda are faked here; one test probes the real machine.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
import torch

from flce_policy.engine.probe import clear_probe_cache, device_for_tensor_device, probe_device, probe_device_verbose

GIB = 2**30
MIB = 2**20


@dataclass
class FakeGPU:
    name: str
    uuid: str  # NVML spelling, "GPU-..."
    total: int
    free: int
    cc: tuple[int, int] = (9, 0)
    mig: bool | None = None  # None: MIG not supported (nvmlDeviceGetMigMode raises)


class FakeCUuuid:
    """Stands in for torch's _CUuuid: str() gives the bare hex UUID, without "GPU-"."""

    def __init__(self, nvml_uuid: str) -> None:
        self._text = nvml_uuid.removeprefix("GPU-").removeprefix("MIG-")

    def __str__(self) -> str:
        return self._text


def make_fake_nvml(gpus: list[FakeGPU], init_error: bool = False, fail_on: str | None = None) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 (pynvml's spelling)
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801
        pass

    nvml.NVMLError = NVMLError
    nvml.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    nvml.NVML_DEVICE_MIG_ENABLE = 1
    nvml.calls = {"init": 0, "shutdown": 0}

    def call(fn_name, fn):
        def wrapped(*args):
            if fail_on == fn_name:
                raise NVMLError(f"{fn_name} failed")
            return fn(*args)

        return wrapped

    def init():
        if init_error:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
        nvml.calls["init"] += 1

    def shutdown():
        nvml.calls["shutdown"] += 1

    def get_handle_by_index(i):
        if not 0 <= i < len(gpus):
            raise NVMLError("Invalid Argument")
        return gpus[i]

    def get_mig_mode(gpu):
        if gpu.mig is None:
            raise NVMLError_NotSupported("Not Supported")
        return [int(gpu.mig), int(gpu.mig)]

    nvml.nvmlInit = init
    nvml.nvmlShutdown = shutdown
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = get_handle_by_index
    nvml.nvmlDeviceGetName = call("name", lambda g: g.name.encode())  # old pynvml returns bytes
    nvml.nvmlDeviceGetUUID = call("uuid", lambda g: g.uuid)
    nvml.nvmlDeviceGetMemoryInfo = call("memory", lambda g: types.SimpleNamespace(total=g.total, free=g.free))
    nvml.nvmlDeviceGetCudaComputeCapability = call("cc", lambda g: g.cc)
    nvml.nvmlDeviceGetMigMode = get_mig_mode
    return nvml


def fake_torch_cuda(
    monkeypatch: pytest.MonkeyPatch,
    visible: list[FakeGPU],
    current: int = 0,
    with_uuid: bool = True,
    name_suffix: str = "",
    total_override: int | None = None,
) -> None:
    """torch.cuda seeing ``visible`` (CUDA index order); torch's memory figures differ from NVML's on purpose."""

    def props(i: int):
        assert 0 <= i < len(visible), "the probe asked torch for an invalid device"
        gpu = visible[i]
        fields = dict(
            name=gpu.name + name_suffix,
            total_memory=total_override if total_override is not None else gpu.total - MIB,
            major=gpu.cc[0],
            minor=gpu.cc[1],
        )
        if with_uuid:
            fields["uuid"] = FakeCUuuid(gpu.uuid)
        return types.SimpleNamespace(**fields)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (3 * GIB, props(i).total_memory))


def no_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


A100 = FakeGPU("NVIDIA A100-SXM4-80GB", "GPU-aaaaaaaa-0000-0000-0000-000000000000", 80 * GIB, 70 * GIB, (8, 0))
H100 = FakeGPU("NVIDIA H100 80GB HBM3", "GPU-bbbbbbbb-1111-1111-1111-111111111111", 81 * GIB, 71 * GIB)
H200 = FakeGPU("NVIDIA H200", "GPU-cccccccc-2222-2222-2222-222222222222", 140 * GIB, 130 * GIB)
NODE = [A100, H100, H200]  # NVML order


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    clear_probe_cache()
    yield
    clear_probe_cache()


def install_nvml(monkeypatch: pytest.MonkeyPatch, nvml: types.ModuleType) -> types.ModuleType:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


# --- NVML path ---------------------------------------------------------------------------------------------------


def test_nvml_maps_cuda_index_by_uuid_under_visible_devices_reordering(monkeypatch):
    nvml = install_nvml(monkeypatch, make_fake_nvml(NODE))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    fake_torch_cuda(monkeypatch, visible=[H200, A100])

    first = probe_device(0)
    assert (first.name, first.family, first.uuid) == ("NVIDIA H200", "H200", H200.uuid)
    assert (first.total_memory_bytes, first.free_memory_bytes) == (140 * GIB, 130 * GIB)
    assert first.compute_capability == (9, 0)
    assert (first.source, first.index) == ("nvml", 0)

    second = probe_device(1)
    assert (second.family, second.uuid, second.compute_capability, second.index) == ("A100", A100.uuid, (8, 0), 1)
    assert nvml.calls["init"] == nvml.calls["shutdown"] == 2


def test_index_none_uses_torch_current_device(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    fake_torch_cuda(monkeypatch, visible=[H100, H200], current=1)
    info = probe_device()
    assert (info.family, info.index, info.source) == ("H200", 1, "nvml")


def test_verbose_notes_say_how_the_device_was_matched(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    fake_torch_cuda(monkeypatch, visible=[H200])
    info, notes = probe_device_verbose(0)
    assert info.source == "nvml"
    assert any("NVML device 2" in note and "UUID" in note for note in notes), notes


def test_uuid_from_torch_that_no_nvml_gpu_has_is_never_matched_by_position(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    stranger = FakeGPU("NVIDIA B200", "GPU-dddddddd-3333-3333-3333-333333333333", 180 * GIB, 170 * GIB, (10, 0))
    fake_torch_cuda(monkeypatch, visible=[stranger])
    info, notes = probe_device_verbose(0)
    assert (info.source, info.family) == ("torch", "B200")  # not NVML device 0 (an A100)
    assert any("UUID" in note for note in notes), notes


def test_without_torch_uuid_visible_devices_ordinals_are_read(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    fake_torch_cuda(monkeypatch, visible=[H200, A100], with_uuid=False)
    info, notes = probe_device_verbose(0)
    assert (info.family, info.uuid, info.source) == ("H200", H200.uuid, "nvml")
    assert any("CUDA_VISIBLE_DEVICES" in note for note in notes), notes
    assert probe_device(1).family == "A100"


def test_without_torch_uuid_visible_devices_uuid_prefix_is_read(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbbbbbb,GPU-cccccccc-2222")
    fake_torch_cuda(monkeypatch, visible=[H100, H200], with_uuid=False)
    assert probe_device(0).uuid == H100.uuid
    assert probe_device(1).uuid == H200.uuid


def test_nvml_without_torch_cuda_still_reports_the_gpu(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    no_torch_cuda(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    info = probe_device()
    assert (info.family, info.source, info.index) == ("H100", "nvml", 0)


# --- fallbacks -----------------------------------------------------------------------------------------------------


def test_nvml_init_error_falls_back_to_torch(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE, init_error=True))
    fake_torch_cuda(monkeypatch, visible=[H100])
    info, notes = probe_device_verbose(0)
    assert info.source == "torch"
    assert (info.name, info.family) == ("NVIDIA H100 80GB HBM3", "H100")
    assert info.total_memory_bytes == 81 * GIB - MIB  # torch's figure, not NVML's
    assert info.free_memory_bytes == 3 * GIB
    assert info.compute_capability == (9, 0)
    assert info.uuid == H100.uuid  # torch's UUID spelled as NVML does
    assert any("NVMLError_LibraryNotFound" in note and "torch" in note for note in notes), notes


def test_nvml_query_error_falls_back_to_torch_and_shuts_nvml_down(monkeypatch):
    nvml = install_nvml(monkeypatch, make_fake_nvml(NODE, fail_on="memory"))
    fake_torch_cuda(monkeypatch, visible=[A100])
    assert probe_device(0).source == "torch"
    assert nvml.calls["init"] == nvml.calls["shutdown"] == 1


def test_pynvml_missing_falls_back_to_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    fake_torch_cuda(monkeypatch, visible=[H200])
    info, notes = probe_device_verbose(0)
    assert (info.source, info.family, info.free_memory_bytes) == ("torch", "H200", 3 * GIB)
    assert any("pynvml" in note for note in notes), notes


def test_mig_enabled_gpu_falls_back_to_torch_slice_memory(monkeypatch):
    mig_a100 = FakeGPU(A100.name, A100.uuid, 80 * GIB, 79 * GIB, (8, 0), mig=True)
    install_nvml(monkeypatch, make_fake_nvml([mig_a100]))
    fake_torch_cuda(monkeypatch, visible=[mig_a100], total_override=10 * GIB)
    info, notes = probe_device_verbose(0)
    assert (info.source, info.family, info.total_memory_bytes) == ("torch", "A100", 10 * GIB)
    assert any("MIG" in note for note in notes), notes


def test_mig_slice_seen_by_torch_falls_back_to_torch(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    slice_ = FakeGPU(A100.name, "MIG-eeeeeeee-4444-4444-4444-444444444444", 10 * GIB + MIB, 9 * GIB, (8, 0))
    fake_torch_cuda(monkeypatch, visible=[slice_], name_suffix=" MIG 1g.10gb")
    info, notes = probe_device_verbose(0)
    assert (info.source, info.family, info.total_memory_bytes) == ("torch", "A100", 10 * GIB)
    assert info.uuid == slice_.uuid
    assert any("MIG" in note for note in notes), notes


def test_mig_uuid_in_visible_devices_without_torch_uuid_falls_back_to_torch(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-eeeeeeee-4444-4444-4444-444444444444")
    fake_torch_cuda(monkeypatch, visible=[A100], with_uuid=False, total_override=10 * GIB)
    info = probe_device(0)
    assert (info.source, info.total_memory_bytes) == ("torch", 10 * GIB)


def test_no_cuda_at_all_gives_the_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    no_torch_cuda(monkeypatch)
    info, notes = probe_device_verbose()
    assert (info.family, info.source, info.total_memory_bytes) == ("cpu", "none", 0)
    assert notes


def test_nvml_init_error_and_no_torch_cuda_gives_the_cpu(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE, init_error=True))
    no_torch_cuda(monkeypatch)
    assert probe_device(3).source == "none"  # no GPU: the index is not checked


def test_visible_devices_hiding_every_gpu_gives_the_cpu(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    no_torch_cuda(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert probe_device().family == "cpu"


# --- index checks --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [2, 7, -1])
def test_out_of_range_index_with_torch_gpus_is_a_value_error(monkeypatch, index):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    fake_torch_cuda(monkeypatch, visible=[H200, A100])
    with pytest.raises(ValueError, match=rf"index {index} is out of range.*2 CUDA device"):
        probe_device(index)


def test_out_of_range_index_with_nvml_only_is_a_value_error(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    no_torch_cuda(monkeypatch)
    with pytest.raises(ValueError, match="out of range"):
        probe_device(3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match="out of range"):
        probe_device(2)


@pytest.mark.parametrize("index", [True, 1.0, "0"])
def test_non_integer_index_is_a_value_error(monkeypatch, index):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    fake_torch_cuda(monkeypatch, visible=NODE)
    with pytest.raises(ValueError, match="must be an int"):
        probe_device(index)


# --- names -> families ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA B300 SXM6 AC", "B300"),
        ("NVIDIA GB200", "GB200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA H20", "H20"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("Tesla V100-SXM2-32GB", "V100"),
        ("NVIDIA Quadro P5000", "unknown"),
        ("Some Accelerator 9000", "unknown"),
    ],
)
def test_probed_names_normalise_to_families(monkeypatch, name, family):
    gpu = FakeGPU(name, "GPU-ffffffff-5555-5555-5555-555555555555", 40 * GIB, 39 * GIB)
    install_nvml(monkeypatch, make_fake_nvml([gpu]))
    fake_torch_cuda(monkeypatch, visible=[gpu])
    info = probe_device(0)
    assert (info.name, info.family, info.source) == (name, family, "nvml")


# --- the cached helper for the loss ------------------------------------------------------------------------------


def test_device_for_tensor_device_caches_per_index(monkeypatch):
    nvml = install_nvml(monkeypatch, make_fake_nvml(NODE))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    fake_torch_cuda(monkeypatch, visible=[H200, A100])

    assert device_for_tensor_device(torch.device("cuda", 0)).family == "H200"
    assert device_for_tensor_device("cuda:0").family == "H200"
    assert nvml.calls["init"] == 1  # second call came from the cache
    assert device_for_tensor_device(torch.device("cuda", 1)).family == "A100"
    assert nvml.calls["init"] == 2

    clear_probe_cache()
    assert device_for_tensor_device(torch.device("cuda", 0)).family == "H200"
    assert nvml.calls["init"] == 3


def test_device_for_tensor_device_cuda_without_index_uses_current_device(monkeypatch):
    install_nvml(monkeypatch, make_fake_nvml(NODE))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    fake_torch_cuda(monkeypatch, visible=[H200, A100], current=1)
    assert device_for_tensor_device("cuda").family == "A100"


def test_device_for_tensor_device_cpu_is_the_cpu_without_probing(monkeypatch):
    nvml = install_nvml(monkeypatch, make_fake_nvml(NODE))
    fake_torch_cuda(monkeypatch, visible=NODE)
    info = device_for_tensor_device(torch.device("cpu"))
    assert (info.family, info.source) == ("cpu", "none")
    assert nvml.calls["init"] == 0


# --- the real machine ----------------------------------------------------------------------------------------------


def _real_nvml_sees_a_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.skipif(torch.cuda.is_available() or _real_nvml_sees_a_gpu(), reason="this machine has a GPU")
def test_real_probe_without_gpu_is_the_cpu():
    info, notes = probe_device_verbose()
    assert (info.family, info.source) == ("cpu", "none")
    assert notes and "CPU" in notes[-1]
    assert probe_device().family == "cpu"
