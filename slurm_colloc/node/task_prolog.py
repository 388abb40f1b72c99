"""TaskProlog (runs as the job's user before each task): export the MPS settings.

Slurm reads the TaskProlog's stdout; ``export NAME=value`` lines set variables in
the task. The values were decided by the root prolog and left in a root-owned file;
this side only reads it (bounded) and validates each line, so a job without a file
(not collocated, or the prolog fell back) simply runs without MPS settings.
"""

from __future__ import annotations

import re
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


def export_lines(mps_root: str, job_id: int) -> list[str]:
    """The ``export`` lines for the job's tasks (empty when the job is not under MPS)."""
    path = Tenancy(Path(mps_root)).job_env_file(job_id)
    try:
        with path.open("rb") as f:
            text = f.read(8192).decode("ascii", errors="replace")
    except OSError:
        return []
    lines = []
    for raw in text.splitlines():
        key, _, value = raw.partition("=")
        if key in ALLOWED and _VALUE.match(value):
            lines.append(f"export {key}={value}")
    return lines
