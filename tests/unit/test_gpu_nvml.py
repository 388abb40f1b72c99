"""NvmlBackend against a fake pynvml that behaves as NVML documents, and DCGM fakes."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest

from slurm_colloc.gpu import dcgm
from slurm_colloc.gpu.backend import GpuBackendError
from slurm_colloc.gpu.nvml import NvmlBackend

MIB = 1024 * 1024


class NVMLError(Exception):
    """Like pynvml.NVMLError: carries the NVML return code in .value."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {
            3: "Not Supported",
            9: "Driver Not Loaded",
            12: "NVML Shared Library Not Found",
            15: "GPU is lost",
        }.get(self.value, "Unknown Error")


@dataclass
class Memory:  # c_nvmlMemory_t: bytes
    total: int
    free: int
    used: int


@dataclass
class Utilization:  # nvmlUtilization_t: percent
    gpu: int
    memory: int


@dataclass
class Proc:  # c_nvmlProcessInfo_t; usedGpuMemory None when not available
    pid: int
    usedGpuMemory: int | None


def fake_nvml(init_error: int | None = None, power_supported: bool = True, lost: bool = False):
    m = types.SimpleNamespace()
    m.NVMLError = NVMLError
    m.NVML_ERROR_NOT_SUPPORTED = 3
    m.NVML_ERROR_NO_PERMISSION = 4
    m.NVML_ERROR_DRIVER_NOT_LOADED = 9
    m.NVML_ERROR_LIBRARY_NOT_FOUND = 12
    m.NVML_ERROR_GPU_IS_LOST = 15
    m.shutdown_called = False

    def init():
        if init_error is not None:
            raise NVMLError(init_error)

    def mem(h):
        if lost:
            raise NVMLError(15)
        return Memory(total=40960 * MIB, free=30720 * MIB, used=10240 * MIB)

    def power(h):
        if not power_supported:
            raise NVMLError(3)
        return 123456  # mW

    m.nvmlInit = init
    m.nvmlShutdown = lambda: setattr(m, "shutdown_called", True)
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    m.nvmlDeviceGetName = lambda h: b"NVIDIA A100-SXM4-40GB"
    m.nvmlDeviceGetUUID = lambda h: f"GPU-0000-{h}"
    m.nvmlDeviceGetMemoryInfo = mem
    m.nvmlDeviceGetUtilizationRates = lambda h: Utilization(gpu=87, memory=40)
    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetTotalEnergyConsumption = lambda h: 5_000_000  # mJ
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [Proc(101, 8192 * MIB), Proc(102, None)]
    return m


def test_gpus_and_sample_convert_units():
    b = NvmlBackend(nvml=fake_nvml())
    gpus = b.gpus()
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].name == "NVIDIA A100-SXM4-40GB" and gpus[0].memory_total_mib == 40960
    assert gpus[1].uuid == "GPU-0000-h1"
    s = b.sample(0)
    assert s.memory_used_mib == 10240
    assert s.utilization_pct == 87.0
    assert s.power_w == pytest.approx(123.456)
    assert s.energy_j == pytest.approx(5000.0)
    assert s.sm_activity_pct is None  # no DCGM: not measured, not zero
    assert [(p.pid, p.used_mib) for p in s.processes] == [(101, 8192), (102, 0)]


def test_unsupported_reading_is_none_not_error():
    s = NvmlBackend(nvml=fake_nvml(power_supported=False)).sample(0)
    assert s.power_w is None and s.energy_j == pytest.approx(5000.0)


def test_lost_gpu_is_backend_error():
    with pytest.raises(GpuBackendError, match="GPU is lost"):
        NvmlBackend(nvml=fake_nvml(lost=True)).sample(0)


@pytest.mark.parametrize(
    ("code", "hint"), [(12, "driver installed"), (9, "kernel driver is not loaded")]
)
def test_init_failure_is_actionable_and_never_falls_back(code, hint):
    with pytest.raises(GpuBackendError) as ei:
        NvmlBackend(nvml=fake_nvml(init_error=code))
    msg = str(ei.value)
    assert hint in msg and "never falls back" in msg


def test_close_shuts_nvml_down():
    m = fake_nvml()
    NvmlBackend(nvml=m).close()
    assert m.shutdown_called


class FakeReader:
    """DcgmReader.GetLatestGpuValuesAsFieldIdDict: {gpuId: {fieldId: value}}."""

    def __init__(self, fieldIds, updateFrequency):
        self.fields = fieldIds
        self.stopped = False

    def GetLatestGpuValuesAsFieldIdDict(self):
        return {0: {1002: 0.42, 1003: 0.25, 1005: 140737488355328.0, 155: 250.5, 156: 9_000_000}}

    def Shutdown(self):
        self.stopped = True


def test_dcgm_fields_reach_the_sample(monkeypatch):
    monkeypatch.setitem(sys.modules, "DcgmReader", types.SimpleNamespace(DcgmReader=FakeReader))
    prof = dcgm.open_profiler(1.0)
    assert prof is not None and prof.reader.fields == [1002, 1003, 1005, 155, 156]
    s = NvmlBackend(nvml=fake_nvml(), profiler=prof).sample(0)
    assert s.sm_activity_pct == pytest.approx(42.0)
    assert s.sm_occupancy_pct == pytest.approx(25.0)
    assert s.dram_activity_pct is None  # DCGM blank value
    assert prof.read(1) is None  # no data for GPU 1
    f = prof.read(0)
    assert f is not None and f.energy_j == pytest.approx(9000.0) and f.power_w == 250.5


def test_dcgm_absent_gives_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "DcgmReader", None)  # import fails
    assert dcgm.open_profiler() is None


def test_compute_modes_named_as_nvml_defines_them():
    m = fake_nvml()
    m.NVML_COMPUTEMODE_DEFAULT, m.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 0, 3
    m.nvmlDeviceGetComputeMode = lambda h: 3 if h == "h1" else 0
    assert NvmlBackend(nvml=m).compute_modes() == {0: "DEFAULT", 1: "EXCLUSIVE_PROCESS"}


def test_doctor_fails_exclusive_process_gpus(monkeypatch):
    from slurm_colloc.config import CollocConfig
    from slurm_colloc.site import doctor

    m = fake_nvml()
    m.nvmlDeviceGetComputeMode = lambda h: 3 if h == "h1" else 0
    monkeypatch.setattr("slurm_colloc.gpu.select.backend_from_config",
                        lambda cfg, **kw: NvmlBackend(nvml=m))
    findings = doctor.check_gpus(CollocConfig())
    mode = next(f for f in findings if f.what == "GPU compute mode")
    assert mode.level == "fail" and "1: 'EXCLUSIVE_PROCESS'" in mode.detail
