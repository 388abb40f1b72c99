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
    uuid: str
    name: str
    memory_total_mib: int


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU (what NVML calls a compute process)."""

    pid: int
    used_mib: int


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
