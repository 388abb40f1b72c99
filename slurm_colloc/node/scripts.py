"""The three programs slurm.conf points at, as console scripts of the installed package.

``colloc-prolog`` (Prolog, root), ``colloc-task-prolog`` (TaskProlog, the job's user)
and ``colloc-epilog`` (Epilog, root); contracts in docs/node.md. They live in the
package so that a wheel install has them (the ``prolog/`` and ``epilog/`` files of the
source tree are shims over these). Each is the last line of defence: whatever goes
wrong, it exits 0, because a non-zero Prolog or Epilog drains the node and a failing
TaskProlog fails the task, which we never want for an error of our own. (The one
exception is not ours: a site TaskProlog that colloc's runs first, colloc.conf
``chain_task_prolog``, keeps its exit status, :mod:`slurm_colloc.node.chain`.)
"""

from __future__ import annotations

import os
import sys


def prolog() -> int:
    """Prolog: MPS set-up for the job; failures are logged and the job runs without."""
    job = os.environ.get("SLURM_JOB_ID", "?")
    try:
        from slurm_colloc.node.entry import prolog_main

        return prolog_main(dict(os.environ))
    except BaseException as e:  # noqa: BLE001 - last line of defence: never drain the node
        sys.stderr.write(
            f"colloc: prolog: job {job}: internal error, job runs without MPS: {e!r}\n"
        )
        return 0


def task_prolog() -> int:
    """TaskProlog: the site's chained TaskProlog, then the ``export`` lines the prolog
    prepared (see task_prolog.py and chain.py)."""
    job = os.environ.get("SLURM_JOB_ID", "?")
    try:
        from slurm_colloc.node.entry import task_prolog_main

        return task_prolog_main(dict(os.environ))
    except BaseException as e:  # noqa: BLE001 - a TaskProlog error must not fail the task
        sys.stdout.write(f"print colloc: task prolog: job {job}: internal error: {e!r}\n")
        return 0


def epilog() -> int:
    """Epilog: release MPS, scan for GPU OOM, keep evidence, requeue."""
    job = os.environ.get("SLURM_JOB_ID", "?")
    try:
        from slurm_colloc.node.entry import epilog_main

        return epilog_main(dict(os.environ))
    except BaseException as e:  # noqa: BLE001 - last line of defence: never drain the node
        sys.stderr.write(f"colloc: epilog: job {job}: internal error, nothing requeued: {e!r}\n")
        return 0
