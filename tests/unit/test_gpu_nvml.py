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


def test_mps_list_failure_other_than_unsupported_is_an_error():
    m = fake_nvml()

    def lost(h):
        raise NVMLError(15)

    m.nvmlDeviceGetMPSComputeRunningProcesses = lost
    with pytest.raises(GpuBackendError, match="GPU is lost"):
        NvmlBackend(nvml=m).sample(0)


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
