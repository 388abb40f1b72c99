"""The body of the TaskProlog (the job's user, before each task), apart from the root scripts.

It runs once per task of every job, as the user, at the job's start: a 64-task job
starts 64 at once, and a burst of job starts puts one per job on the node beside the
prologs (issue 28). So it imports only what it uses (the config, the export lines,
the site's chained TaskProlog, the checkpoint directory), not the root scripts' Slurm,
accounting and MPS code (:mod:`slurm_colloc.node.entry`): ~0.05 s less CPU a task.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from slurm_colloc import config as cfgmod

FAULT_KEY = "test_fault_inject"
"""``[extra] test_fault_inject = "prolog,epilog"`` in colloc.conf makes the named
scripts raise an internal error: used by the tests that prove a node never drains."""


class InjectedFault(RuntimeError):
    """Raised on purpose (see FAULT_KEY)."""


def task_prolog_main(env: Mapping[str, str]) -> int:
    """TaskProlog: the site's own first (``chain_task_prolog``), then the export lines
    the prolog prepared, then the job's checkpoint directory (``checkpoint_dir``).

    The exit status is the site's script's (Slurm fails the task on non-zero, as it
    would with the site's script alone); colloc's own errors never fail the task.
    """
    from slurm_colloc.node.chain import run_site_task_prolog
    from slurm_colloc.node.checkpoint_dir import checkpoint_lines
    from slurm_colloc.node.task_prolog import export_lines

    status = 0
    try:
        cfg = cfgmod.load()
        task_env = dict(env)
        if cfg.chain_task_prolog:
            site = run_site_task_prolog(cfg.chain_task_prolog, env)
            sys.stdout.write("".join(f"{ln}\n" for ln in site.lines))
            sys.stdout.flush()
            status = site.status
            task_env.update(site.exported())  # the site's exports count as the user's
        if "task_prolog" in cfg.extra.get(FAULT_KEY, "").split(","):
            raise InjectedFault("task_prolog: injected fault")
        lines = export_lines(cfg.mps_root, int(env["SLURM_JOB_ID"]), task_env)
        lines += checkpoint_lines(cfg.checkpoint_dir, task_env)
        sys.stdout.write("".join(f"{ln}\n" for ln in lines))
    except Exception as e:  # noqa: BLE001 - a TaskProlog error must not fail the task
        sys.stdout.write(f"print colloc: task prolog: internal error, no MPS settings: {e}\n")
    return status
