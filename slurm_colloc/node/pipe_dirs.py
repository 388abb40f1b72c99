"""Which GPUs a job's epilog sweeps for idle MPS daemons and pipe directories.

The epilog stops each (GPU, user) daemon left without jobs and retires its pipe
directory (:meth:`~slurm_colloc.mps.tenancy.Tenancy.retire_pipe_dir`). It used to
look only at the GPUs the job's MPS markers named, so a job whose marker was already
gone (MPS withdrawn by the prolog when the server cap failed, a prolog that failed
after it made the pipe directory, a registration reaped early) left its GPU's empty
pipe directory (and an idle daemon) behind until some later job's prolog came by:
after a burst, none does (issue 28). The job's GPUs are also in the context its
prolog saved (root's ``ctx/<jobid>.json``, from Slurm's JSON), read here before the
epilog consumes it.
"""

from __future__ import annotations

import contextlib
import json

from slurm_colloc.mps.tenancy import Tenancy

MAX_GPUS = 64


def saved_gpus(tenancy: Tenancy, job_id: int) -> set[int]:
    """The GPUs (Slurm's indices) in the job's saved context; empty when none is
    readable."""
    text = tenancy.read_job_context(job_id)
    if text is None:
        return set()
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        gpus = json.loads(text).get("gpus")
        if isinstance(gpus, list) and len(gpus) <= MAX_GPUS:
            return {g for g in gpus if isinstance(g, int) and not isinstance(g, bool)
                    and 0 <= g < 1 << 16}
    return set()


def gpus_to_sweep(tenancy: Tenancy, job_id: int) -> list[int]:
    """The GPUs the job's markers name, and those of its saved context."""
    return sorted({g for g, _ in tenancy.all_jobs().get(job_id, [])}
                  | saved_gpus(tenancy, job_id))
