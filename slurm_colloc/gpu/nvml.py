"""``NvmlBackend``: real GPUs through NVML (nvidia-ml-py, imported as ``pynvml``).

What NVML gives us per GPU: memory (``nvmlDeviceGetMemoryInfo``, bytes), per-process
memory (``nvmlDeviceGetComputeRunningProcesses``; ``usedGpuMemory`` is ``None`` where
the driver cannot attribute it), utilisation (``nvmlDeviceGetUtilizationRates``:
% of time a kernel ran), power (``nvmlDeviceGetPowerUsage``, mW) and the energy
counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ since driver load, Volta+).
A reading the GPU does not support (``NVML_ERROR_NOT_SUPPORTED``) becomes ``None``
so reports say "not measured"; a lost GPU or a dead driver is a
:class:`GpuBackendError`. SM activity / occupancy / DRAM activity need DCGM
profiling fields: pass a :class:`~slurm_colloc.gpu.dcgm.DcgmProfiler` to add them.

Static facts per GPU (:meth:`NvmlBackend.gpus`): the minor number
(``nvmlDeviceGetMinorNumber``: N of ``/dev/nvidiaN``, which is how Slurm orders GPUs,
see :mod:`slurm_colloc.gpu.identity`), the PCI bus id (``nvmlDeviceGetPciInfo``
``busId``, lower-cased) and the memory the driver and firmware reserve
(``nvmlDeviceGetMemoryInfo_v2`` ``reserved``; nvidia-ml-py spells the call
``nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)``). Bindings without
``nvmlMemory_v2`` and drivers that answer FUNCTION_NOT_FOUND, NOT_SUPPORTED or
ARGUMENT_VERSION_MISMATCH give ``reserved_mib`` 0 (the v1 struct has no such field).

Memory "used" in a sample is v1's ``used``, which NVML documents (``nvmlMemory_t``)
as reserved plus allocated memory: an idle GPU shows the driver's reservation as used,
and the per-process figures never add up to it.

MPS clients. NVML documents ``nvmlDeviceGetComputeRunningProcesses`` as "processes
with a compute context on a device" and ``nvmlDeviceGetMPSComputeRunningProcesses``
(``_v3`` in nvidia-ml-py 13) as "processes with a Multi-Process Service (MPS) compute
context"; the MPS docs add that client activity is accounted to the MPS server by
monitoring tools. Whether the first list also repeats MPS clients is not documented,
so a sample is the union of both lists by pid (the larger memory figure kept), and a
process is an MPS client exactly when the MPS list names it
(:attr:`GpuProcess.mps_client`). Where the MPS list cannot be read (NOT_SUPPORTED,
or a library without the symbol) ``mps_client`` is ``None``: unknown, never guessed.

Both process lists exist in versions (nvidia-ml-py 13 has ``_v3``, ``_v2`` and an
unversioned name that calls ``_v3``). On a driver without ``_v3`` the unversioned name
raises ``NVMLLibraryMismatchError``, which is *not* an ``NVMLError`` and would escape
every handler; so the newest version the binding has is called, the next older one
where the driver answers FUNCTION_NOT_FOUND, and the choice is remembered.

Hard per-cgroup limits (driver r615+, CUDA 13.4, MPS v3 memory partitioning):
``nvmlDeviceSetMemoryLimits_v1(device, nvmlSetMemoryLimits_v1_t)`` with ``nameSpace``
= full sysfs path of the cgroup, ``softLimit``/``hardLimit`` in bytes (NVIDIA's NVML
reference); root only, not for MIG handles; "no limit" is soft 0 and hard
``NVML_DEVICE_MEMORY_LIMIT_MAX``; removing the cgroup clears it. The hard limit is
enforced at allocation (``dmem.max`` of the kernel's dmem controller, Linux 6.14+, or
the driver's fallback), for MPS clients and non-MPS processes alike. Used only when
the installed nvidia-ml-py has the function (13.615+) and the driver answers the
probe; anything else is reported as "unsupported", never raised.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import stat
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from slurm_colloc import procfs
from slurm_colloc.gpu.backend import (
    GpuBackend,
    GpuBackendError,
    GpuInfo,
    GpuProcess,
    GpuSample,
    HardLimitSupport,
    LimitResult,
)
from slurm_colloc.gpu.dcgm import DcgmProfiler

MIB = 1024 * 1024
T = TypeVar("T")
CGROUP_ROOT = "/sys/fs/cgroup"
MEMORY_LIMIT_MAX = 0xFFFFFFFFFFFFFFFF
"""``NVML_DEVICE_MEMORY_LIMIT_MAX``: the hard limit that means "none"."""
NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF
"""``NVML_VALUE_NOT_AVAILABLE`` as an unsigned long long: "no figure", not 16 EiB."""
_COMPUTE_PROCS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses",
)
_MPS_PROCS = (
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    "nvmlDeviceGetMPSComputeRunningProcesses",
)
_SET_LIMITS = "nvmlDeviceSetMemoryLimits_v1"
_GET_LIMITS = "nvmlDeviceGetMemoryLimits_v1"

_INIT_HINTS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": "libnvidia-ml.so.1 was not found: is the NVIDIA driver "
    "installed on this node?",
    "NVML_ERROR_DRIVER_NOT_LOADED": "the NVIDIA kernel driver is not loaded (nvidia-smi "
    "should fail the same way): load it or fix the node",
    "NVML_ERROR_NO_PERMISSION": "no permission to open /dev/nvidia*: run as root or fix "
    "the device permissions",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": "the NVML library and the kernel driver are "
    "different versions (driver upgraded without reboot?)",
}


def _import_pynvml() -> ModuleType:
    try:
        module = importlib.import_module("pynvml")
    except ImportError as e:
        raise GpuBackendError(
            "gpu_backend = nvml but the nvidia-ml-py package (module pynvml) is not "
            "installed: pip install nvidia-ml-py"
        ) from e
    return module


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def format_cuda_version(version: int) -> str:
    """``12040`` -> ``"12.4"`` (NVML_CUDA_DRIVER_VERSION_MAJOR/MINOR: v/1000, v%1000/10)."""
    return f"{version // 1000}.{version % 1000 // 10}"


class NvmlBackend(GpuBackend):
    """All GPUs of the node via NVML; ``nvml`` is injectable so tests can fake NVML."""

    name = "nvml"

    def __init__(
        self, nvml: ModuleType | None = None, profiler: DcgmProfiler | None = None
    ) -> None:
        """Initialise NVML; failure is a GpuBackendError that says what to fix."""
        self.nvml = nvml if nvml is not None else _import_pynvml()
        self.profiler = profiler
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as e:
            raise GpuBackendError(self._init_message(e)) from e
        self._handles: dict[int, Any] = {}
        self._mps_list_ok: dict[int, bool] = {}
        self._list_fns: dict[tuple[str, ...], list[str]] = {}
        self._hard_support: dict[int, HardLimitSupport] = {}
        self.cgroup_root = CGROUP_ROOT

    def _code(self, name: str) -> object:
        """An NVML return code constant, or a sentinel that matches nothing."""
        return getattr(self.nvml, name, object())

    def _init_message(self, err: Any) -> str:
        code = getattr(err, "value", None)
        hint = "check that nvidia-smi works on this node"
        for const, text in _INIT_HINTS.items():
            if code is not None and code == getattr(self.nvml, const, object()):
                hint = text
        return (
            f"NVML initialisation failed ({err}): {hint}. colloc never falls back to "
            'simulated GPUs; gpu_backend = "sim" is for the devcluster and tests only.'
        )

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Call NVML; errors other than 'not supported' mean the GPU cannot be read."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as e:
            raise GpuBackendError(f"NVML {getattr(fn, '__name__', 'call')} failed: {e}") from e

    def _optional(self, fn: Callable[..., T], *args: Any) -> T | None:
        """Like :meth:`_call` but a reading the GPU does not support is ``None``."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as e:
            if getattr(e, "value", None) in (
                self.nvml.NVML_ERROR_NOT_SUPPORTED,
                getattr(self.nvml, "NVML_ERROR_NO_PERMISSION", None),
            ):
                return None
            raise GpuBackendError(f"NVML {getattr(fn, '__name__', 'call')} failed: {e}") from e

    def _is_code(self, err: Any, *names: str) -> bool:
        code = getattr(err, "value", None)
        return code is not None and any(code == self._code(n) for n in names)

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._call(self.nvml.nvmlDeviceGetHandleByIndex, index)
        return self._handles[index]

    def gpus(self) -> list[GpuInfo]:
        """Every GPU NVML sees, by NVML index, with what ties it to Slurm's index."""
        count = self._call(self.nvml.nvmlDeviceGetCount)
        out = []
        for i in range(count):
            h = self._handle(i)
            total, reserved = self._memory_total_reserved(h)
            out.append(
                GpuInfo(
                    index=i,
                    uuid=_decode(self._call(self.nvml.nvmlDeviceGetUUID, h)),
                    name=_decode(self._call(self.nvml.nvmlDeviceGetName, h)),
                    memory_total_mib=total // MIB,
                    minor_number=self._minor_number(h),
                    pci_bus_id=self._pci_bus_id(h),
                    reserved_mib=reserved // MIB,
                )
            )
        return out

    def sample_all(self) -> list[GpuSample]:
        """Every GPU's sample without re-reading the static facts :meth:`gpus` gathers."""
        return [self.sample(i) for i in range(self._call(self.nvml.nvmlDeviceGetCount))]

    def _minor_number(self, handle: Any) -> int | None:
        fn = getattr(self.nvml, "nvmlDeviceGetMinorNumber", None)
        if fn is None:
            return None
        minor = self._optional(fn, handle)
        return None if minor is None else int(minor)

    def _pci_bus_id(self, handle: Any) -> str:
        """``domain:bus:device.function`` in lower case, as lspci and sysfs write it."""
        fn = getattr(self.nvml, "nvmlDeviceGetPciInfo", None)
        info = None if fn is None else self._optional(fn, handle)
        if info is None:
            return ""
        # nvmlPciInfo_t moved the bus id to ``busId`` (NVML 9.0); old structs only
        # have the 16-byte one, which newer bindings call ``busIdLegacy``.
        raw = getattr(info, "busId", "") or getattr(info, "busIdLegacy", "")
        return _decode(raw).strip("\x00").strip().lower()

    def _memory_total_reserved(self, handle: Any) -> tuple[int, int]:
        """(total, reserved) in bytes; reserved 0 where only the v1 struct is available."""
        version = getattr(self.nvml, "nvmlMemory_v2", None)
        if version is not None:
            try:
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            except TypeError:
                pass  # a binding with the constant but not the keyword: use v1
            except self.nvml.NVMLError as e:
                if not self._is_code(
                    e,
                    "NVML_ERROR_FUNCTION_NOT_FOUND",
                    "NVML_ERROR_NOT_SUPPORTED",
                    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
                ):
                    raise GpuBackendError(f"NVML nvmlDeviceGetMemoryInfo_v2 failed: {e}") from e
            else:
                return int(mem.total), int(getattr(mem, "reserved", 0) or 0)
        mem = self._call(self.nvml.nvmlDeviceGetMemoryInfo, handle)
        return int(mem.total), 0

    def driver_version(self) -> str | None:
        """The kernel driver's version (``"590.48.01"``); None where NVML cannot say."""
        fn = getattr(self.nvml, "nvmlSystemGetDriverVersion", None)
        if fn is None:
            return None
        try:
            return _decode(fn()).strip() or None
        except self.nvml.NVMLError:
            return None

    def cuda_driver_version(self) -> int | None:
        """libcuda's version as CUDA encodes it (``13040`` = 13.4); None if unknown.

        ``nvmlSystemGetCudaDriverVersion_v2`` reads the installed libcuda and fails
        (LIBRARY_NOT_FOUND) without one; the v1 call instead returns "a known supported
        version" in that case, so it is only asked where v2 does not exist, and a
        missing libcuda is None rather than a made-up number.
        """
        for name in ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"):
            fn = getattr(self.nvml, name, None)
            if fn is None:
                continue
            try:
                version = int(fn())
            except self.nvml.NVMLError as e:
                if self._is_code(e, "NVML_ERROR_FUNCTION_NOT_FOUND"):
                    continue
                return None
            return version if version > 0 else None
        return None

    def sample(self, index: int) -> GpuSample:
        """One reading of GPU ``index`` (plus DCGM profiling fields when available)."""
        h = self._handle(index)
        now = time.time()
        mem = self._call(self.nvml.nvmlDeviceGetMemoryInfo, h)
        util = self._optional(self.nvml.nvmlDeviceGetUtilizationRates, h)
        power_mw = self._optional(self.nvml.nvmlDeviceGetPowerUsage, h)
        energy_mj = self._optional(self.nvml.nvmlDeviceGetTotalEnergyConsumption, h)
        procs = self._compute_processes(h)
        mps = self._mps_processes(index, h)  # after the compute list: see _merge
        prof = self.profiler.read(index) if self.profiler is not None else None
        return GpuSample(
            index=index,
            timestamp=now,
            memory_used_mib=int(mem.used) // MIB,  # v1: reserved + allocated (module doc)
            utilization_pct=None if util is None else float(util.gpu),
            power_w=None if power_mw is None else power_mw / 1000.0,
            energy_j=None if energy_mj is None else energy_mj / 1000.0,
            sm_activity_pct=prof.sm_active_pct if prof else None,
            sm_occupancy_pct=prof.sm_occupancy_pct if prof else None,
            dram_activity_pct=prof.dram_active_pct if prof else None,
            processes=self._merge(procs, mps),
        )

    def _list_call(self, names: tuple[str, ...], handle: Any) -> list[Any]:
        """Call the newest of ``names`` the binding and driver both have.

        A version the driver lacks (FUNCTION_NOT_FOUND, or nvidia-ml-py's
        ``NVMLLibraryMismatchError`` from an unversioned name) is dropped for the rest
        of the session and the next one tried. None left: NVML_ERROR_NOT_SUPPORTED, so
        callers treat it as a reading the GPU does not support.
        """
        if names not in self._list_fns:
            self._list_fns[names] = [n for n in names if hasattr(self.nvml, n)]
        candidates = self._list_fns[names]
        mismatch = getattr(self.nvml, "NVMLLibraryMismatchError", None)
        mismatch_types: tuple[type[BaseException], ...] = (
            (mismatch,) if isinstance(mismatch, type) and issubclass(mismatch, Exception) else ()
        )
        while candidates:
            fn = getattr(self.nvml, candidates[0])
            try:
                return list(fn(handle) or [])
            except self.nvml.NVMLError as e:
                if not self._is_code(e, "NVML_ERROR_FUNCTION_NOT_FOUND"):
                    raise
            except mismatch_types:
                pass
            candidates.pop(0)
        raise self.nvml.NVMLError(getattr(self.nvml, "NVML_ERROR_NOT_SUPPORTED", 3))

    def _compute_processes(self, handle: Any) -> list[Any]:
        """Processes with a compute context; [] where the GPU cannot list them."""
        try:
            return self._list_call(_COMPUTE_PROCS, handle)
        except self.nvml.NVMLError as e:
            if self._is_code(e, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION"):
                return []
            raise GpuBackendError(
                f"NVML nvmlDeviceGetComputeRunningProcesses failed: {e}"
            ) from e

    def _mps_processes(self, index: int, handle: Any) -> list[Any] | None:
        """MPS clients on the GPU; None when NVML cannot list them (remembered per GPU)."""
        if self._mps_list_ok.get(index) is False:
            return None
        try:
            out = self._list_call(_MPS_PROCS, handle)
        except self.nvml.NVMLError as e:
            if self._is_code(
                e,
                "NVML_ERROR_NOT_SUPPORTED",
                "NVML_ERROR_FUNCTION_NOT_FOUND",
                "NVML_ERROR_NO_PERMISSION",
            ):
                self._mps_list_ok[index] = False
                return None
            raise GpuBackendError(
                f"NVML nvmlDeviceGetMPSComputeRunningProcesses failed: {e}"
            ) from e
        self._mps_list_ok[index] = True
        return out

    def _merge(self, compute: list[Any], mps: list[Any] | None) -> tuple[GpuProcess, ...]:
        """Union of both lists by pid; ``mps_client`` from membership of the MPS list.

        The MPS list is read after the compute list, so a client that starts between
        the two calls is still seen as a client; one that exits in between can look
        like a non-MPS process for one sample (enforcement needs several samples).
        """
        mps_pids = None if mps is None else {int(p.pid) for p in mps}
        merged: dict[int, int] = {}
        for p in list(compute) + list(mps or []):
            gp = self._process(p)
            merged[gp.pid] = max(merged.get(gp.pid, 0), gp.used_mib)
        return tuple(
            GpuProcess(pid, mib, None if mps_pids is None else pid in mps_pids)
            for pid, mib in merged.items()
        )

    # --- hard per-cgroup memory limits (r615+) ------------------------------------

    def hard_memory_limit_supported(self, index: int) -> HardLimitSupport:
        """Probe once per GPU: bindings, cgroup v2, not MIG, and the driver's answer."""
        if index in self._hard_support:
            return self._hard_support[index]
        ans = self._probe_hard_limit(index)
        self._hard_support[index] = ans
        return ans

    def _probe_hard_limit(self, index: int) -> HardLimitSupport:
        for name in (_SET_LIMITS, _GET_LIMITS, "c_nvmlSetMemoryLimits_v1_t",
                     "c_nvmlGetMemoryLimits_v1_t"):
            if not hasattr(self.nvml, name):
                return HardLimitSupport(
                    False, f"nvidia-ml-py has no {name} (needs 13.615+, driver r615+)"
                )
        if not os.path.exists(os.path.join(self.cgroup_root, "cgroup.controllers")):
            return HardLimitSupport(False, f"no cgroup v2 hierarchy at {self.cgroup_root}")
        try:
            h = self._handle(index)
        except GpuBackendError as e:
            return HardLimitSupport(False, str(e))
        mig = getattr(self.nvml, "nvmlDeviceGetMigMode", None)
        if mig is not None:
            with contextlib.suppress(self.nvml.NVMLError):
                current = mig(h)
                current = current[0] if isinstance(current, list | tuple) else current
                if int(current) == int(getattr(self.nvml, "NVML_DEVICE_MIG_ENABLE", 1)):
                    return HardLimitSupport(False, f"GPU {index} is in MIG mode (not supported)")
        q = self.nvml.c_nvmlGetMemoryLimits_v1_t()
        q.nameSpace = self.cgroup_root.encode()
        try:
            getattr(self.nvml, _GET_LIMITS)(h, q)
        except self.nvml.NVMLError as e:
            return HardLimitSupport(False, f"GPU {index}: {_GET_LIMITS}: {e}")
        return HardLimitSupport(True, f"GPU {index}: per-cgroup hard limits available")

    def set_job_memory_limit(
        self, index: int, cgroup_path: str, hard_mib: int, soft_mib: int = 0
    ) -> LimitResult:
        """Set, then read back, the cgroup's limits on GPU ``index`` (see module doc)."""
        if hard_mib <= 0 or soft_mib < 0 or soft_mib > hard_mib:
            return LimitResult(False, "error", f"bad limits hard={hard_mib} soft={soft_mib} MiB")
        support = self.hard_memory_limit_supported(index)
        if not support.supported:
            return LimitResult(False, "unsupported", support.reason)
        bad = self._bad_cgroup(cgroup_path)
        if bad:
            return LimitResult(False, "error", bad)
        h = self._handle(index)
        req = self.nvml.c_nvmlSetMemoryLimits_v1_t()
        req.nameSpace = cgroup_path.encode()
        req.softLimit = soft_mib * MIB
        req.hardLimit = hard_mib * MIB
        try:
            getattr(self.nvml, _SET_LIMITS)(h, req)
        except self.nvml.NVMLError as e:
            code = getattr(e, "value", None)
            if code in (self._code("NVML_ERROR_NOT_SUPPORTED"),
                        self._code("NVML_ERROR_FUNCTION_NOT_FOUND")):
                return LimitResult(False, "unsupported", f"{_SET_LIMITS}: {e}")
            if code == self._code("NVML_ERROR_NO_PERMISSION"):
                return LimitResult(False, "denied", f"{_SET_LIMITS}: {e} (needs root)")
            return LimitResult(False, "error", f"{_SET_LIMITS}: {e}")
        q = self.nvml.c_nvmlGetMemoryLimits_v1_t()
        q.nameSpace = cgroup_path.encode()
        try:
            getattr(self.nvml, _GET_LIMITS)(h, q)
        except self.nvml.NVMLError as e:
            return LimitResult(
                True, "set", f"hard {hard_mib} MiB on {cgroup_path} (not read back: {e})"
            )
        if int(q.hardLimit) != hard_mib * MIB:
            return LimitResult(
                False, "error",
                f"read back hard limit {int(q.hardLimit)} B, asked {hard_mib * MIB} B",
            )
        return LimitResult(True, "set", f"hard {hard_mib} MiB on {cgroup_path} (verified)")

    def _bad_cgroup(self, path: str) -> str | None:
        """Why ``path`` is not a cgroup directory we may name (None if it is fine)."""
        root = self.cgroup_root.rstrip("/") + "/"
        if not path.startswith(root) or "/../" in path + "/" or "\0" in path:
            return f"{path!r} is not a cgroup under {root}"
        try:
            st = os.lstat(path)
        except OSError as e:
            return f"{path}: {e.strerror}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{path}: not a directory (symlink?)"
        return None

    def compute_modes(self) -> dict[int, str]:
        """NVML compute mode per GPU: ``DEFAULT``, ``EXCLUSIVE_PROCESS`` or ``PROHIBITED``.

        colloc runs one MPS server per (GPU, user); several servers on one GPU need
        the DEFAULT mode (EXCLUSIVE_PROCESS admits a single context).
        """
        names = {
            getattr(self.nvml, "NVML_COMPUTEMODE_DEFAULT", 0): "DEFAULT",
            getattr(self.nvml, "NVML_COMPUTEMODE_EXCLUSIVE_THREAD", 1): "EXCLUSIVE_THREAD",
            getattr(self.nvml, "NVML_COMPUTEMODE_PROHIBITED", 2): "PROHIBITED",
            getattr(self.nvml, "NVML_COMPUTEMODE_EXCLUSIVE_PROCESS", 3): "EXCLUSIVE_PROCESS",
        }
        out = {}
        for g in self.gpus():
            mode = self._call(self.nvml.nvmlDeviceGetComputeMode, self._handle(g.index))
            out[g.index] = names.get(int(mode), str(mode))
        return out

    def _process(self, p: Any) -> GpuProcess:
        used = getattr(p, "usedGpuMemory", None)
        if used is not None and int(used) >= NOT_AVAILABLE:
            used = None  # bindings that do not turn the sentinel into None
        # Unattributable memory counts as 0 here: the GPU total stays right, and the
        # sidecar flags jobs whose processes report no memory rather than guessing.
        return GpuProcess(pid=int(p.pid), used_mib=0 if used is None else int(used) // MIB)

    def close(self) -> None:
        """Shut NVML down; errors at shutdown are not worth failing a job for."""
        self._handles.clear()
        if self.profiler is not None:
            self.profiler.close()
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()


def slurm_job_cgroup(
    job_id: int | str, root: str = CGROUP_ROOT, sluid: str | None = None
) -> str | None:
    """The job's cgroup v2 directory as Slurm's ``cgroup/v2`` plugin lays it out.

    ``<root>/system.slice/slurmstepd.scope/job_<id>`` (or ``<node>_slurmstepd.scope``
    when several slurmd run on one host); Slurm 26.05 names it by the job's SLUID
    instead (``.../slurmstepd.scope/sEKNKTV3WPV500``) unless cgroup.conf says
    ``CgroupJobIdPaths=yes``, so with ``sluid`` (slurmd's ``SLURM_JOB_SLUID``) that
    name is looked for too. A malformed SLUID is ignored, never joined into a path.
    None when there is none (cgroup v1, ``proctrack/linuxproc``, or slurmstepd has not
    created it yet). Symlinks are never followed.
    """
    jid = str(job_id)
    if not jid.isdigit() or len(jid) > 12:
        return None
    names = [f"job_{jid}"]
    good_sluid = procfs.sluid(sluid)
    if good_sluid is not None:
        names.append(good_sluid)
    base = os.path.join(root, "system.slice")
    try:
        scopes = sorted(n for n in os.listdir(base) if n.endswith("slurmstepd.scope"))
    except OSError:
        return None
    for scope in scopes:
        if not _real_dir(os.path.join(base, scope)):
            continue
        for name in names:
            path = os.path.join(base, scope, name)
            if _real_dir(path):
                return path
    return None


def _real_dir(path: str) -> bool:
    """A directory itself, not a symlink to one (root writes limits under it)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
