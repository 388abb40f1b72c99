"""Simulated GPUs and MPS for the devcluster, tests and demos (``gpu_backend = "sim"``).

One concept per module: :mod:`.state` (the node-local state directory),
:mod:`.backend` (``SimBackend``), :mod:`.power`, :mod:`.interference`, :mod:`.sizes`,
:mod:`.mps_control` (``nvidia-cuda-mps-control`` stand-in) and :mod:`.simjob` (a
stand-in training job). Nothing here is used when ``gpu_backend = "nvml"``.

The names below are imported on first use, not with the package: the prolog runs the
``mps-control`` stand-in 3-5 times under its GPU lock, and NVIDIA's binary starts in
milliseconds, so the stand-in must not pay for the backend and its models on every call
(that cost was part of the replay's start lag, an artefact of the simulation).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurm_colloc.gpu.sim.backend import SimBackend
    from slurm_colloc.gpu.sim.state import SimSpec, init_state, load_spec

__all__ = ["SimBackend", "SimSpec", "init_state", "load_spec"]
_HOME = {"SimBackend": "backend", "SimSpec": "state", "init_state": "state",
         "load_spec": "state"}


def __getattr__(name: str) -> Any:
    """PEP 562: the public names, imported from their module when first asked for."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
