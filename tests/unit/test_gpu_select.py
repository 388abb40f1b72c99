"""Backend selection is explicit: sim only when configured, nvml never falls back."""

from __future__ import annotations

import importlib.util

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuBackendError
from slurm_colloc.gpu.select import backend_from_config
from slurm_colloc.gpu.sim import SimBackend, init_state


def test_sim_backend_when_configured(tmp_path):
    init_state(tmp_path, gpu_count=2)
    b = backend_from_config(CollocConfig(gpu_backend="sim", sim_state_dir=str(tmp_path)))
    assert isinstance(b, SimBackend) and len(b.gpus()) == 2


def test_sim_backend_without_state_fails_loudly(tmp_path):
    with pytest.raises(GpuBackendError, match="init_state"):
        backend_from_config(CollocConfig(gpu_backend="sim", sim_state_dir=str(tmp_path / "x")))


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is None, reason="nvidia-ml-py missing")
def test_nvml_without_driver_raises_instead_of_simulating(tmp_path):
    # No GPU driver on the development machines: NVML init must fail, loudly.
    init_state(tmp_path)  # a sim state exists, and must not be used
    try:
        b = backend_from_config(CollocConfig(gpu_backend="nvml", sim_state_dir=str(tmp_path)))
    except GpuBackendError as e:
        assert "never falls back" in str(e)
    else:  # a real GPU node: whatever it is, it is not the simulation
        assert not isinstance(b, SimBackend)
        b.close()
