"""Pick the GPU backend the configuration names: explicitly, never by fallback.

A production node whose driver is broken must fail loudly (``GpuBackendError``) so
the node scripts take their safe path; silently reporting simulated GPUs would make
every collocation decision on fiction.
"""

from __future__ import annotations

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuBackend, GpuBackendError, GpuInfo

BACKEND_MODULES: dict[str, tuple[str, ...]] = {
    "nvml": ("slurm_colloc.gpu.dcgm", "slurm_colloc.gpu.nvml"),
    "sim": ("slurm_colloc.gpu.sim.backend",),
}
"""The modules each backend's code lives in (imported when it is chosen): the node's
script server loads the configured one's before it forks workers."""


def backend_from_config(cfg: CollocConfig, *, with_dcgm: bool = True) -> GpuBackend:
    """The backend ``cfg.gpu_backend`` names (``nvml`` or ``sim``)."""
    if cfg.gpu_backend == "nvml":
        from slurm_colloc.gpu.dcgm import open_profiler
        from slurm_colloc.gpu.nvml import NvmlBackend

        return NvmlBackend(profiler=open_profiler(cfg.sample_interval_s) if with_dcgm else None)
    if cfg.gpu_backend == "sim":
        from slurm_colloc.gpu.sim.backend import SimBackend

        return SimBackend(cfg.sim_state_dir)
    raise GpuBackendError(f"unknown gpu_backend {cfg.gpu_backend!r} (expected nvml or sim)")


def gpus_from_config(cfg: CollocConfig, *, with_dcgm: bool = False) -> list[GpuInfo]:
    """The GPUs the configured backend reports; the backend is closed again."""
    backend = backend_from_config(cfg, with_dcgm=with_dcgm)
    try:
        return backend.gpus()
    finally:
        backend.close()
