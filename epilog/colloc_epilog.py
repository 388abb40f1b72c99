#!/usr/bin/env python3
"""Slurm Epilog (root, compute node). Contract: see docs/node.md.

Releases the job's MPS registration, scans its output for GPU out-of-memory,
keeps the evidence and requeues a collocated job on a GPU of its own.
Exit status: always 0 (a non-zero Epilog drains the node).
"""

import os
import sys


def main() -> int:
    job = os.environ.get("SLURM_JOB_ID", "?")
    try:
        from slurm_colloc.node.entry import epilog_main

        return epilog_main(dict(os.environ))
    except BaseException as e:  # noqa: BLE001 - last line of defence: never drain the node
        sys.stderr.write(f"colloc: epilog: job {job}: internal error, nothing requeued: {e!r}\n")
        return 0


if __name__ == "__main__":
    sys.exit(main())
