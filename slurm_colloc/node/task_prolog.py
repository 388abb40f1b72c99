"""TaskProlog (runs as the job's user before each task): export the MPS settings.

Slurm reads the TaskProlog's stdout; ``export NAME=value`` lines set variables in
the task. The values were decided by the root prolog and left in a root-owned file;
this side only reads it (bounded) and validates each line, so a job without a file
(not collocated, or the prolog fell back) simply runs without MPS settings.

**Framework memory behaviour under a limit** (:func:`framework_lines`). A job with a
memory limit (``COLLOC_LIMIT_MIB`` in its file) also gets the variables that make the
common frameworks allocate on demand instead of grabbing the GPU, unless the task's
environment (which Slurm runs the TaskProlog with) already sets them: the user's
value always wins.

- JAX/XLA preallocates 75 % of the GPU at start: under an MPS limit that is an
  immediate out-of-memory, or a "peak" that is the preallocation, not the need (and
  would feed history and advice). ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` makes it
  allocate as it goes. XLA still caps its pool at ``XLA_PYTHON_CLIENT_MEM_FRACTION``
  (default 0.75) of the total memory CUDA reports; under MPS that total may be the
  GPU's or the client's limit, so the fraction is set to :data:`XLA_FRACTION`: the
  MPS limit, not XLA, is then the cap in both cases. A user who sets either XLA
  variable (or ``XLA_PYTHON_CLIENT_ALLOCATOR``) keeps all three as they are.
- TensorFlow maps all GPU memory unless memory growth is on:
  ``TF_FORCE_GPU_ALLOW_GROWTH=true``.
- PyTorch's caching allocator already allocates on demand; ``PYTORCH_CUDA_ALLOC_CONF``
  is left alone (``expandable_segments`` relies on CUDA virtual memory calls whose
  accounting under an MPS memory limit colloc has not verified).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from slurm_colloc.mps.tenancy import Tenancy

ALLOWED = frozenset(
    {
        "CUDA_MPS_PIPE_DIRECTORY",
        "CUDA_MPS_LOG_DIRECTORY",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_VISIBLE_DEVICES",
        "COLLOC_GPU",
        "COLLOC_GPU_UUID",
        "COLLOC_LIMIT_MIB",
        "COLLOC_PINNED_MIB",
        "COLLOC_MPS_PROTOCOL",
    }
)
_VALUE = re.compile(r"^[A-Za-z0-9_./=,:-]{1,512}$")

XLA_FRACTION = "0.95"
"""``XLA_PYTHON_CLIENT_MEM_FRACTION`` under a limit (see the module docstring)."""
XLA_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_ALLOCATOR")


def framework_lines(values: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """``export`` lines for JAX and TensorFlow of a job with a memory limit.

    ``values``: the job's validated MPS settings; ``env``: the task's environment
    (a variable the user set there is never overridden). Nothing without a limit.
    """
    if not values.get("COLLOC_LIMIT_MIB", "").isdigit():
        return []
    out = []
    if not any(k in env for k in XLA_VARS):
        out += ["export XLA_PYTHON_CLIENT_PREALLOCATE=false",
                f"export XLA_PYTHON_CLIENT_MEM_FRACTION={XLA_FRACTION}"]
    if "TF_FORCE_GPU_ALLOW_GROWTH" not in env:
        out.append("export TF_FORCE_GPU_ALLOW_GROWTH=true")
    return out


def export_lines(mps_root: str, job_id: int, env: Mapping[str, str] | None = None) -> list[str]:
    """The ``export`` lines for the job's tasks (empty when the job is not under MPS).

    ``env``: the task's environment (default: this process's, which is the task's
    when Slurm runs the TaskProlog), to keep the user's own framework settings.
    """
    path = Tenancy(Path(mps_root)).job_env_file(job_id)
    try:
        with path.open("rb") as f:
            text = f.read(8192).decode("ascii", errors="replace")
    except OSError:
        return []
    lines = []
    values: dict[str, str] = {}
    for raw in text.splitlines():
        key, _, value = raw.partition("=")
        if key in ALLOWED and _VALUE.match(value):
            lines.append(f"export {key}={value}")
            values[key] = value
    return lines + framework_lines(values, os.environ if env is None else env)
