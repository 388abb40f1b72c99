"""Simulated GPUs and MPS for the devcluster, tests and demos (``gpu_backend = "sim"``).

One concept per module: :mod:`.state` (the node-local state directory),
:mod:`.backend` (``SimBackend``), :mod:`.power`, :mod:`.interference`, :mod:`.sizes`,
:mod:`.mps_control` (``nvidia-cuda-mps-control`` stand-in) and :mod:`.simjob` (a
stand-in training job). Nothing here is used when ``gpu_backend = "nvml"``.
"""

from slurm_colloc.gpu.sim.backend import SimBackend
from slurm_colloc.gpu.sim.state import SimSpec, init_state, load_spec

__all__ = ["SimBackend", "SimSpec", "init_state", "load_spec"]
