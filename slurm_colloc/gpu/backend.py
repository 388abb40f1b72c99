"""The GPU backend interface: every part of colloc that reads GPU state goes through it.

Two implementations: :mod:`slurm_colloc.gpu.nvml` (nvidia-ml-py, real nodes) and
:mod:`slurm_colloc.gpu.sim` (simulated GPUs for the devcluster, tests and demos).
Which one is used is a configuration decision (``gpu_backend``), never a fallback:
a production node without a working driver must fail loudly, not report fake GPUs.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass


class GpuBackendError(RuntimeError):
    """The backend cannot answer (driver missing, GPU lost, state unreadable)."""


@dataclass(frozen=True)
class GpuInfo:
    """Static facts about one GPU."""

    index: int
    """The backend's index (NVML enumerates by PCI bus id). Not Slurm's GPU index, and
    not CUDA's device number: see :mod:`slurm_colloc.gpu.identity`."""
    uuid: str
    """``GPU-...``: the one identity NVIDIA tools, CUDA_VISIBLE_DEVICES and MPS agree on."""
    name: str
    memory_total_mib: int
    minor_number: int | None = None
    """N of ``/dev/nvidiaN`` (``nvmlDeviceGetMinorNumber``); Slurm orders a node's GPUs
    by their device files, so this links Slurm's index to the GPU. None: unknown."""
    pci_bus_id: str = ""
    reserved_mib: int = 0
    """Memory the driver and firmware keep for themselves (``nvmlDeviceGetMemoryInfo_v2``
    ``reserved``); no process can allocate it. 0 where the backend cannot tell."""


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU (what NVML calls a compute process)."""

    pid: int
    used_mib: int
    mps_client: bool | None = None
    """True: the process reaches the GPU through an MPS server (a client of it);
    False: it holds a CUDA context of its own, outside MPS; None: the backend cannot
    tell (NVML without ``nvmlDeviceGetMPSComputeRunningProcesses``)."""


@dataclass(frozen=True)
class GpuSample:
    """One reading of a GPU's dynamic state.

    Fields that a backend cannot measure are ``None`` (e.g. SM activity without DCGM
    profiling or Hopper GPM): the report must say "not measured", not show zero.
    """

    index: int
    timestamp: float
    memory_used_mib: int
    utilization_pct: float | None
    power_w: float | None
    energy_j: float | None
    """Monotonic energy counter since an arbitrary origin (NVML: since driver load)."""
    sm_activity_pct: float | None = None
    sm_occupancy_pct: float | None = None
    dram_activity_pct: float | None = None
    processes: tuple[GpuProcess, ...] = ()


class GpuBackend(abc.ABC):
    """Read-only access to the node's GPUs."""

    name: str = "abstract"

    @abc.abstractmethod
    def gpus(self) -> list[GpuInfo]:
        """All GPUs of the node, by index."""

    @abc.abstractmethod
    def sample(self, index: int) -> GpuSample:
        """Current dynamic state of one GPU."""

    def sample_all(self) -> list[GpuSample]:
        """Sample every GPU; backends may override to batch the reads."""
        return [self.sample(g.index) for g in self.gpus()]

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release driver handles."""

    # --- optional capabilities (safe defaults: "not supported") -------------------

    def hard_memory_limit_supported(self, index: int) -> HardLimitSupport:
        """Can a hard GPU memory limit be put on a cgroup for GPU ``index``?

        NVIDIA driver r615+ (CUDA 13.4, MPS v3 memory partitioning) enforces a hard
        per-cgroup limit (cgroup v2 ``dmem.max`` or the driver's fallback), which holds
        even for a process that never talks to MPS. The default answer is "no".
        """
        return HardLimitSupport(False, f"the {self.name} backend has no hard memory limits")

    def set_job_memory_limit(
        self, index: int, cgroup_path: str, hard_mib: int, soft_mib: int = 0
    ) -> LimitResult:
        """Put a hard (and optional soft) memory limit for GPU ``index`` on a cgroup.

        ``cgroup_path`` is the full sysfs path of the job's cgroup v2 directory
        (``/sys/fs/cgroup/.../job_<id>``). Never raises for "not supported": the
        result says whether the limit is in force, and why not.
        """
        return LimitResult(False, "unsupported", f"the {self.name} backend cannot set limits")


@dataclass(frozen=True)
class HardLimitSupport:
    """Answer of :meth:`GpuBackend.hard_memory_limit_supported`."""

    supported: bool
    reason: str


@dataclass(frozen=True)
class LimitResult:
    """Outcome of :meth:`GpuBackend.set_job_memory_limit`.

    ``status``: ``set`` (in force), ``unsupported`` (driver/NVML/GPU cannot; use the
    MPS + collector fallback), ``denied`` (not root), ``error`` (anything else).
    """

    applied: bool
    status: str
    detail: str
