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
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from slurm_colloc.gpu.backend import GpuBackend, GpuBackendError, GpuInfo, GpuProcess, GpuSample
from slurm_colloc.gpu.dcgm import DcgmProfiler

MIB = 1024 * 1024
T = TypeVar("T")

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

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._call(self.nvml.nvmlDeviceGetHandleByIndex, index)
        return self._handles[index]

    def gpus(self) -> list[GpuInfo]:
        """Every GPU NVML sees, by NVML index."""
        count = self._call(self.nvml.nvmlDeviceGetCount)
        out = []
        for i in range(count):
            h = self._handle(i)
            mem = self._call(self.nvml.nvmlDeviceGetMemoryInfo, h)
            out.append(
                GpuInfo(
                    index=i,
                    uuid=_decode(self._call(self.nvml.nvmlDeviceGetUUID, h)),
                    name=_decode(self._call(self.nvml.nvmlDeviceGetName, h)),
                    memory_total_mib=int(mem.total) // MIB,
                )
            )
        return out

    def sample(self, index: int) -> GpuSample:
        """One reading of GPU ``index`` (plus DCGM profiling fields when available)."""
        h = self._handle(index)
        now = time.time()
        mem = self._call(self.nvml.nvmlDeviceGetMemoryInfo, h)
        util = self._optional(self.nvml.nvmlDeviceGetUtilizationRates, h)
        power_mw = self._optional(self.nvml.nvmlDeviceGetPowerUsage, h)
        energy_mj = self._optional(self.nvml.nvmlDeviceGetTotalEnergyConsumption, h)
        procs = self._optional(self.nvml.nvmlDeviceGetComputeRunningProcesses, h) or []
        prof = self.profiler.read(index) if self.profiler is not None else None
        return GpuSample(
            index=index,
            timestamp=now,
            memory_used_mib=int(mem.used) // MIB,
            utilization_pct=None if util is None else float(util.gpu),
            power_w=None if power_mw is None else power_mw / 1000.0,
            energy_j=None if energy_mj is None else energy_mj / 1000.0,
            sm_activity_pct=prof.sm_active_pct if prof else None,
            sm_occupancy_pct=prof.sm_occupancy_pct if prof else None,
            dram_activity_pct=prof.dram_active_pct if prof else None,
            processes=tuple(self._process(p) for p in procs),
        )

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
        not_avail = getattr(self.nvml, "NVML_VALUE_NOT_AVAILABLE_ulonglong", None)
        if not_avail is not None and used == getattr(not_avail, "value", not_avail):
            used = None  # older bindings pass the sentinel through
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
