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


# --- MPS clients: NVML's MPS process list ------------------------------------------


def test_mps_clients_are_marked_and_lists_are_merged():
    m = fake_nvml()
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [Proc(900, 300 * MIB), Proc(101, 0)]
    m.nvmlDeviceGetMPSComputeRunningProcesses = lambda h: [Proc(101, 8192 * MIB),
                                                           Proc(103, 1024 * MIB)]
    s = NvmlBackend(nvml=m).sample(0)
    got = {p.pid: (p.used_mib, p.mps_client) for p in s.processes}
    # 900: in the compute list only (an MPS server, or a process that bypassed MPS)
    assert got == {900: (300, False), 101: (8192, True), 103: (1024, True)}


def test_mps_list_not_supported_means_unknown_and_is_not_asked_again():
    m = fake_nvml()
    calls = []

    def mps(h):
        calls.append(h)
        raise NVMLError(3)  # NVML_ERROR_NOT_SUPPORTED

    m.nvmlDeviceGetMPSComputeRunningProcesses = mps
    b = NvmlBackend(nvml=m)
    for _ in range(3):
        s = b.sample(0)
        assert [p.mps_client for p in s.processes] == [None, None]
    assert calls == ["h0"]


def test_bindings_without_mps_list_mean_unknown():
    s = NvmlBackend(nvml=fake_nvml()).sample(0)  # the fake has no MPS list function
    assert all(p.mps_client is None for p in s.processes)


def test_mps_client_only_in_the_mps_list_is_reported_with_its_memory():
    # The failure mode: the compute list does not repeat MPS clients.
    m = fake_nvml()
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: []
    m.nvmlDeviceGetMPSComputeRunningProcesses = lambda h: [Proc(4242, 6144 * MIB)]
    s = NvmlBackend(nvml=m).sample(0)
    assert [(p.pid, p.used_mib, p.mps_client) for p in s.processes] == [(4242, 6144, True)]


@pytest.mark.parametrize(("compute_mib", "mps_mib"), [(2048, 512), (512, 2048)])
def test_process_in_both_lists_is_reported_once_with_the_larger_memory(compute_mib, mps_mib):
    m = fake_nvml()
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [Proc(101, compute_mib * MIB)]
    m.nvmlDeviceGetMPSComputeRunningProcesses = lambda h: [Proc(101, mps_mib * MIB)]
    s = NvmlBackend(nvml=m).sample(0)
    assert [(p.pid, p.used_mib, p.mps_client) for p in s.processes] == [(101, 2048, True)]


def test_unavailable_process_memory_is_zero_not_an_error():
    import ctypes

    m = fake_nvml()
    m.NVML_VALUE_NOT_AVAILABLE_ulonglong = ctypes.c_ulonglong(-1)
    sentinel = ctypes.c_ulonglong(-1).value  # what a binding that passes it through gives
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [Proc(7, None), Proc(8, sentinel)]
    m.nvmlDeviceGetMPSComputeRunningProcesses = lambda h: [Proc(8, sentinel), Proc(9, None)]
    s = NvmlBackend(nvml=m).sample(0)
    assert {p.pid: (p.used_mib, p.mps_client) for p in s.processes} == {
        7: (0, False), 8: (0, True), 9: (0, True)}


def test_sentinel_is_recognised_even_without_the_bindings_constant():
    m = fake_nvml()  # no NVML_VALUE_NOT_AVAILABLE_ulonglong attribute
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [Proc(8, 0xFFFFFFFFFFFFFFFF)]
    assert NvmlBackend(nvml=m).sample(0).processes[0].used_mib == 0


def test_mps_list_not_supported_is_remembered_per_gpu():
    m = fake_nvml()
    calls = []

    def mps(h):
        calls.append(h)
        if h == "h0":
            raise NVMLError(3)  # this GPU cannot list MPS clients; GPU 1 can
        return [Proc(101, 8192 * MIB)]

    m.nvmlDeviceGetMPSComputeRunningProcesses = mps
    b = NvmlBackend(nvml=m)
    for _ in range(2):
        assert {p.mps_client for p in b.sample(0).processes} == {None}
        assert {p.pid: p.mps_client for p in b.sample(1).processes} == {
            101: True, 102: False}
    assert calls == ["h0", "h1", "h1"]


@pytest.mark.parametrize("fn", ["nvmlDeviceGetComputeRunningProcesses",
                                "nvmlDeviceGetMPSComputeRunningProcesses",
                                "nvmlDeviceGetMemoryInfo"])
def test_gpu_lost_on_any_process_or_memory_read_is_a_backend_error(fn):
    m = fake_nvml()
    m.nvmlDeviceGetMPSComputeRunningProcesses = lambda h: []

    def lost(*a, **kw):
        raise NVMLError(15)  # NVML_ERROR_GPU_IS_LOST

    setattr(m, fn, lost)
    with pytest.raises(GpuBackendError, match="GPU is lost"):
        NvmlBackend(nvml=m).sample(0)


def test_newest_process_list_version_is_preferred():
    m = fake_nvml()

    def unversioned(h):
        raise AssertionError("the _v3 function exists and must be used")

    m.nvmlDeviceGetComputeRunningProcesses = unversioned
    m.nvmlDeviceGetMPSComputeRunningProcesses = unversioned
    m.nvmlDeviceGetComputeRunningProcesses_v3 = lambda h: [Proc(900, 300 * MIB)]
    m.nvmlDeviceGetMPSComputeRunningProcesses_v3 = lambda h: [Proc(101, 8192 * MIB)]
    s = NvmlBackend(nvml=m).sample(0)
    assert {p.pid: (p.used_mib, p.mps_client) for p in s.processes} == {
        900: (300, False), 101: (8192, True)}


def test_driver_without_v3_falls_back_to_v2_and_remembers():
    m = fake_nvml()
    m.NVML_ERROR_FUNCTION_NOT_FOUND = 13
    v3_calls = []

    def v3(h):
        v3_calls.append(h)
        raise NVMLError(13)  # the binding has _v3, the driver does not

    m.nvmlDeviceGetMPSComputeRunningProcesses_v3 = v3
    m.nvmlDeviceGetMPSComputeRunningProcesses_v2 = lambda h: [Proc(101, 1024 * MIB)]
    b = NvmlBackend(nvml=m)
    for i in (0, 1, 0):
        assert {p.pid: p.mps_client for p in b.sample(i).processes}[101] is True
    assert v3_calls == ["h0"]


def test_library_mismatch_from_an_unversioned_name_is_not_a_crash():
    class NVMLLibraryMismatchError(Exception):  # pynvml's: not an NVMLError subclass
        pass

    def mismatch(h):
        raise NVMLLibraryMismatchError("Unversioned function called ...")

    m = fake_nvml()
    m.NVMLLibraryMismatchError = NVMLLibraryMismatchError
    m.nvmlDeviceGetMPSComputeRunningProcesses = mismatch
    m.nvmlDeviceGetComputeRunningProcesses = mismatch
    s = NvmlBackend(nvml=m).sample(0)
    assert s.processes == () and s.memory_used_mib == 10240


def test_installed_bindings_name_the_process_lists_as_used():
    import pynvml

    for name in ("nvmlDeviceGetComputeRunningProcesses_v3",
                 "nvmlDeviceGetMPSComputeRunningProcesses_v3",
                 "nvmlDeviceGetMPSComputeRunningProcesses"):
        assert callable(getattr(pynvml, name)), name
    assert not issubclass(pynvml.NVMLLibraryMismatchError, pynvml.NVMLError)
    assert pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value == 0xFFFFFFFFFFFFFFFF


def test_mps_list_failure_other_than_unsupported_is_an_error():
    m = fake_nvml()

    def lost(h):
        raise NVMLError(15)

    m.nvmlDeviceGetMPSComputeRunningProcesses = lost
    with pytest.raises(GpuBackendError, match="GPU is lost"):
        NvmlBackend(nvml=m).sample(0)


# --- static facts: minor number, PCI bus id, reserved memory; driver versions -------


@dataclass
class MemoryV2:  # c_nvmlMemory_v2_t: bytes; version must be nvmlMemory_v2
    version: int
    total: int
    reserved: int
    free: int
    used: int


@dataclass
class PciInfo:  # nvmlPciInfo_t; the binding may hand back bytes or str
    busId: bytes | str
    busIdLegacy: bytes | str = b""


NVML_MEMORY_V2 = 0x02000028


def identity_nvml(minors=(2, 0), bus_ids=(b"00000000:3B:00.0", b"00000000:86:00.0"),
                  v2_error: int | None = None):
    """The fake plus the identity calls, as nvidia-ml-py 12/13 exposes them."""
    m = fake_nvml()
    m.NVML_ERROR_FUNCTION_NOT_FOUND = 13
    m.NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
    m.nvmlMemory_v2 = NVML_MEMORY_V2
    m.v1_calls = 0

    def mem(h, version=None):
        if not version:
            m.v1_calls += 1
            return Memory(total=40960 * MIB, free=30720 * MIB, used=10240 * MIB)
        assert version == NVML_MEMORY_V2
        if v2_error is not None:
            raise NVMLError(v2_error)
        return MemoryV2(version, total=40960 * MIB, reserved=543 * MIB,
                        free=30720 * MIB, used=10240 * MIB)

    def minor(h):
        value = minors[int(h[1:])]
        if value is None:
            raise NVMLError(3)
        return value

    m.nvmlDeviceGetMemoryInfo = mem
    m.nvmlDeviceGetMinorNumber = minor
    m.nvmlDeviceGetPciInfo = lambda h: PciInfo(bus_ids[int(h[1:])])
    return m


def test_gpus_report_minor_number_pci_bus_id_and_reserved_memory():
    m = identity_nvml()
    gpus = NvmlBackend(nvml=m).gpus()
    assert [(g.index, g.minor_number, g.pci_bus_id, g.reserved_mib, g.memory_total_mib)
            for g in gpus] == [(0, 2, "00000000:3b:00.0", 543, 40960),
                               (1, 0, "00000000:86:00.0", 543, 40960)]
    assert m.v1_calls == 0  # v2 gave the total too


def test_pci_bus_id_as_str_or_only_in_the_legacy_field():
    m = identity_nvml(bus_ids=("0000:AF:00.0", ""))
    m.nvmlDeviceGetPciInfo = lambda h: (PciInfo("00000000:AF:00.0") if h == "h0"
                                        else PciInfo(b"", busIdLegacy=b"0000:D8:00.0"))
    assert [g.pci_bus_id for g in NvmlBackend(nvml=m).gpus()] == [
        "00000000:af:00.0", "0000:d8:00.0"]


def test_minor_number_not_supported_is_none_for_that_gpu_only():
    gpus = NvmlBackend(nvml=identity_nvml(minors=(None, 1))).gpus()
    assert [g.minor_number for g in gpus] == [None, 1]


@pytest.mark.parametrize("code", [13, 3, 25])  # FUNCTION_NOT_FOUND, NOT_SUPPORTED, VERSION
def test_driver_without_memory_info_v2_gives_reserved_zero_and_v1_total(code):
    m = identity_nvml(v2_error=code)
    gpus = NvmlBackend(nvml=m).gpus()
    assert [(g.reserved_mib, g.memory_total_mib) for g in gpus] == [(0, 40960)] * 2
    assert m.v1_calls == 2


def test_bindings_without_memory_v2_never_pass_a_version():
    # fake_nvml's memory function takes no version keyword: passing one would fail
    gpus = NvmlBackend(nvml=fake_nvml()).gpus()
    assert [(g.reserved_mib, g.minor_number, g.pci_bus_id) for g in gpus] == [(0, None, "")] * 2


def test_lost_gpu_while_reading_static_facts_is_an_error():
    with pytest.raises(GpuBackendError, match="GPU is lost"):
        NvmlBackend(nvml=identity_nvml(v2_error=15)).gpus()
    m = identity_nvml()

    def lost(h):
        raise NVMLError(15)

    m.nvmlDeviceGetMinorNumber = lost
    with pytest.raises(GpuBackendError, match="GPU is lost"):
        NvmlBackend(nvml=m).gpus()


def test_sample_memory_stays_v1_and_sample_all_skips_static_reads():
    m = identity_nvml()
    m.nvmlDeviceGetUUID = lambda h: pytest.fail("sample_all must not re-read static facts")
    samples = NvmlBackend(nvml=m).sample_all()
    assert [(s.index, s.memory_used_mib) for s in samples] == [(0, 10240), (1, 10240)]
    assert m.v1_calls == 2


def test_installed_bindings_spell_memory_info_v2_as_used():
    import inspect

    import pynvml

    assert pynvml.nvmlMemory_v2 == NVML_MEMORY_V2
    assert "version" in inspect.signature(pynvml.nvmlDeviceGetMemoryInfo).parameters
    assert [f[0] for f in pynvml.c_nvmlMemory_v2_t._fields_] == [
        "version", "total", "reserved", "free", "used"]
    assert "busId" in [f[0] for f in pynvml.nvmlPciInfo_t._fields_]
    assert pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH == 25
    assert pynvml.NVML_ERROR_FUNCTION_NOT_FOUND == 13


def test_driver_and_cuda_versions():
    from slurm_colloc.gpu.nvml import format_cuda_version

    m = fake_nvml()
    b = NvmlBackend(nvml=m)
    assert b.driver_version() is None and b.cuda_driver_version() is None  # not in binding
    m.nvmlSystemGetDriverVersion = lambda: b"590.48.01"
    m.nvmlSystemGetCudaDriverVersion_v2 = lambda: 13040
    m.nvmlSystemGetCudaDriverVersion = lambda: pytest.fail("v2 exists: v1 must not be asked")
    assert b.driver_version() == "590.48.01" and b.cuda_driver_version() == 13040
    assert format_cuda_version(13040) == "13.4" and format_cuda_version(12020) == "12.2"


def test_cuda_version_without_libcuda_is_none_not_v1s_guess():
    m = fake_nvml()
    m.NVML_ERROR_FUNCTION_NOT_FOUND = 13

    def raising(code: int):
        def f():
            raise NVMLError(code)
        return f

    m.nvmlSystemGetCudaDriverVersion = lambda: 12020
    m.nvmlSystemGetCudaDriverVersion_v2 = raising(12)  # NVML_ERROR_LIBRARY_NOT_FOUND
    assert NvmlBackend(nvml=m).cuda_driver_version() is None
    m.nvmlSystemGetCudaDriverVersion_v2 = raising(13)  # library too old for v2: v1 is all
    assert NvmlBackend(nvml=m).cuda_driver_version() == 12020
    del m.nvmlSystemGetCudaDriverVersion_v2
    assert NvmlBackend(nvml=m).cuda_driver_version() == 12020
    m.nvmlSystemGetDriverVersion = raising(9)
    assert NvmlBackend(nvml=m).driver_version() is None


# --- hard per-cgroup memory limits (r615+, nvmlDeviceSetMemoryLimits_v1) -------------


def limits_nvml(set_error: int | None = None, get_error: int | None = None,
                readback_mib: int | None = None):
    """A fake with NVML's memory-limit API, using the installed bindings' structs."""
    import pynvml

    m = fake_nvml()
    m.NVML_ERROR_FUNCTION_NOT_FOUND = 13
    m.c_nvmlSetMemoryLimits_v1_t = pynvml.c_nvmlSetMemoryLimits_v1_t
    m.c_nvmlGetMemoryLimits_v1_t = pynvml.c_nvmlGetMemoryLimits_v1_t
    m.set_calls = []
    m.limits = {}

    def set_limits(h, req):
        if set_error is not None:
            raise NVMLError(set_error)
        m.set_calls.append((h, req.nameSpace, req.softLimit, req.hardLimit))
        m.limits[req.nameSpace] = (req.softLimit, req.hardLimit)

    def get_limits(h, q):
        if get_error is not None:
            raise NVMLError(get_error)
        soft, hard = m.limits.get(q.nameSpace, (0, 0xFFFFFFFFFFFFFFFF))
        q.softLimit = soft
        q.hardLimit = hard if readback_mib is None else readback_mib * MIB
        q.currentUsed = 0

    m.nvmlDeviceSetMemoryLimits_v1 = set_limits
    m.nvmlDeviceGetMemoryLimits_v1 = get_limits
    return m


@pytest.fixture
def cgroot(tmp_path):
    root = tmp_path / "cgroup"
    (root / "system.slice" / "slurmstepd.scope" / "job_42").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory dmem\n")
    return root


def backend_at(m, root) -> NvmlBackend:
    b = NvmlBackend(nvml=m)
    b.cgroup_root = str(root)
    return b


def test_installed_bindings_have_the_documented_struct_fields():
    import pynvml

    fields = [f[0] for f in pynvml.c_nvmlSetMemoryLimits_v1_t._fields_]
    assert fields == ["nameSpace", "softLimit", "hardLimit"]
    assert hasattr(pynvml, "nvmlDeviceSetMemoryLimits_v1")
    assert pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX == 0xFFFFFFFFFFFFFFFF


def test_hard_limit_is_set_in_bytes_on_the_cgroup_and_read_back(cgroot):
    from slurm_colloc.gpu.nvml import slurm_job_cgroup

    m = limits_nvml()
    b = backend_at(m, cgroot)
    assert b.hard_memory_limit_supported(0).supported
    cg = slurm_job_cgroup(42, str(cgroot))
    assert cg == str(cgroot / "system.slice" / "slurmstepd.scope" / "job_42")
    r = b.set_job_memory_limit(0, cg, 8192)
    assert (r.applied, r.status) == (True, "set") and "verified" in r.detail
    # pynvml's structures decode char* fields on reading: the path went in as bytes
    assert m.set_calls == [("h0", cg, 0, 8192 * MIB)]


def test_hard_limit_read_back_mismatch_is_not_applied(cgroot):
    b = backend_at(limits_nvml(readback_mib=4096), cgroot)
    cg = str(cgroot / "system.slice" / "slurmstepd.scope" / "job_42")
    r = b.set_job_memory_limit(0, cg, 8192)
    assert (r.applied, r.status) == (False, "error")


@pytest.mark.parametrize(("code", "status"), [(3, "unsupported"), (13, "unsupported"),
                                               (4, "denied"), (2, "error")])
def test_hard_limit_errors_are_reported_not_raised(cgroot, code, status):
    b = backend_at(limits_nvml(set_error=code), cgroot)
    r = b.set_job_memory_limit(0, str(cgroot / "system.slice" / "slurmstepd.scope" / "job_42"),
                               8192)
    assert (r.applied, r.status) == (False, status)


def test_old_driver_probe_says_unsupported_and_set_never_calls_nvml(cgroot):
    m = limits_nvml(get_error=3)  # NOT_SUPPORTED: driver before r615
    b = backend_at(m, cgroot)
    sup = b.hard_memory_limit_supported(0)
    assert not sup.supported and "Not Supported" in sup.reason
    r = b.set_job_memory_limit(0, str(cgroot / "system.slice" / "slurmstepd.scope" / "job_42"),
                               8192)
    assert r.status == "unsupported" and m.set_calls == []


def test_bindings_without_the_function_are_unsupported(cgroot):
    b = backend_at(fake_nvml(), cgroot)  # no nvmlDeviceSetMemoryLimits_v1 at all
    sup = b.hard_memory_limit_supported(0)
    assert not sup.supported and "13.615" in sup.reason
    assert b.set_job_memory_limit(0, str(cgroot), 1024).status == "unsupported"


def test_no_cgroup_v2_or_mig_is_unsupported(tmp_path, cgroot):
    b = backend_at(limits_nvml(), tmp_path)  # no cgroup.controllers: cgroup v1
    assert not b.hard_memory_limit_supported(0).supported
    m = limits_nvml()
    m.NVML_DEVICE_MIG_ENABLE = 1
    m.nvmlDeviceGetMigMode = lambda h: [1, 1]
    sup = backend_at(m, cgroot).hard_memory_limit_supported(0)
    assert not sup.supported and "MIG" in sup.reason


def test_hard_limit_refuses_paths_outside_the_cgroup_tree(tmp_path, cgroot):
    m = limits_nvml()
    b = backend_at(m, cgroot)
    link = cgroot / "system.slice" / "evil"
    link.symlink_to(tmp_path)
    for bad in ("/etc", str(cgroot / "system.slice" / ".." / ".." / "x"), str(link),
                str(cgroot / "missing")):
        assert b.set_job_memory_limit(0, bad, 1024).status == "error", bad
    assert b.set_job_memory_limit(0, str(cgroot), 0).status == "error"  # no 0 MiB limit
    assert m.set_calls == []


def test_base_backend_defaults_to_unsupported(tmp_path):
    from slurm_colloc.gpu.sim import SimBackend, init_state

    init_state(tmp_path / "s", gpu_count=1)
    b = SimBackend(tmp_path / "s")
    assert not b.hard_memory_limit_supported(0).supported
    r = b.set_job_memory_limit(0, "/sys/fs/cgroup/x", 1024)
    assert (r.applied, r.status) == (False, "unsupported")
