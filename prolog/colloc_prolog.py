#!/usr/bin/env python3
"""Slurm Prolog (root, compute node). Contract: see docs/node.md.

Environment: SLURM_JOB_ID, SLURM_JOB_UID, SLURM_JOB_USER, SLURM_JOB_GPUS,
SLURMD_NODENAME from slurmd; COLLOC_CONF and SLURM_CONF from the wrapper.
Exit status: always 0. A non-zero Prolog exit drains the node and holds the job,
which we never want for an error of our own; failures are logged and the job runs
without MPS.
"""

import os
import sys


def main() -> int:
    job = os.environ.get("SLURM_JOB_ID", "?")
    try:
        from slurm_colloc.node.entry import prolog_main

        return prolog_main(dict(os.environ))
    except BaseException as e:  # noqa: BLE001 - last line of defence: never drain the node
        sys.stderr.write(
            f"colloc: prolog: job {job}: internal error, job runs without MPS: {e!r}\n"
        )
        return 0


if __name__ == "__main__":
    sys.exit(main())
