#!/usr/bin/env python3
"""Slurm TaskProlog (job user, before each task). Contract: see docs/node.md.

Prints ``export NAME=value`` lines (CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY,
CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) that Slurm sets
in the task's environment. Always exits 0.
"""

import os
import sys


def main() -> int:
    job = os.environ.get("SLURM_JOB_ID", "?")
    try:
        from slurm_colloc.node.entry import task_prolog_main

        return task_prolog_main(dict(os.environ))
    except BaseException as e:  # noqa: BLE001 - a TaskProlog error must not fail the task
        sys.stdout.write(f"print colloc: task prolog: job {job}: internal error: {e!r}\n")
        return 0


if __name__ == "__main__":
    sys.exit(main())
