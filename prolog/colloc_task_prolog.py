#!/usr/bin/env python3
"""Slurm TaskProlog (the job's user, before each task).

A shim over ``slurm_colloc.node.scripts.task_prolog``.

Installed sites point slurm.conf at the console script ``colloc-task-prolog``; this file
serves a source checkout. Contract: docs/node.md. Always exits 0.
"""

import sys

if __name__ == "__main__":
    from slurm_colloc.node.scripts import task_prolog

    sys.exit(task_prolog())
