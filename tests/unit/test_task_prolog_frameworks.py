"""TaskProlog: framework memory variables per the job's limit (JAX/XLA, TensorFlow),
never overriding what the user set, nothing for a job without a limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node.task_prolog import XLA_FRACTION, export_lines, framework_lines

LIMITED = {"CUDA_MPS_PIPE_DIRECTORY": "/run/x/pipe", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=5632M",
           "COLLOC_LIMIT_MIB": "6144", "COLLOC_PINNED_MIB": "5632"}


def _exports(lines: list[str]) -> dict[str, str]:
    return dict(ln.removeprefix("export ").split("=", 1) for ln in lines)


def test_limited_job_gets_on_demand_allocation_for_jax_and_tensorflow(tmp_path: Path) -> None:
    Tenancy(tmp_path / "mps").write_job_env(5, LIMITED)
    ex = _exports(export_lines(str(tmp_path / "mps"), 5, env={}))
    assert ex["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert ex["XLA_PYTHON_CLIENT_MEM_FRACTION"] == XLA_FRACTION
    assert ex["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in ex  # PyTorch allocates on demand already
    assert ex["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=5632M"  # MPS lines unchanged


@pytest.mark.parametrize("user_var", ["XLA_PYTHON_CLIENT_PREALLOCATE",
                                      "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                      "XLA_PYTHON_CLIENT_ALLOCATOR"])
def test_a_users_xla_setting_is_never_overridden(user_var: str) -> None:
    ex = _exports(framework_lines(LIMITED, {user_var: "x"}))
    assert not any(k.startswith("XLA_") for k in ex)
    assert ex["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"


def test_a_users_tensorflow_setting_is_never_overridden() -> None:
    ex = _exports(framework_lines(LIMITED, {"TF_FORCE_GPU_ALLOW_GROWTH": "false"}))
    assert "TF_FORCE_GPU_ALLOW_GROWTH" not in ex and "XLA_PYTHON_CLIENT_PREALLOCATE" in ex


def test_no_limit_no_framework_variables(tmp_path: Path) -> None:
    assert framework_lines({"CUDA_MPS_PIPE_DIRECTORY": "/x"}, {}) == []
    assert framework_lines({"COLLOC_LIMIT_MIB": "6G; rm"}, {}) == []
    assert export_lines(str(tmp_path / "mps"), 6, env={}) == []  # not collocated: nothing


def test_default_env_is_the_task_environment(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    Tenancy(tmp_path / "mps").write_job_env(7, LIMITED)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    ex = _exports(export_lines(str(tmp_path / "mps"), 7))
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in ex and ex["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
