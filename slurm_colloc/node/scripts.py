"""The three programs slurm.conf points at, as console scripts of the installed package.

``colloc-prolog`` (Prolog, root), ``colloc-task-prolog`` (TaskProlog, the job's user)
and ``colloc-epilog`` (Epilog, root); contracts in docs/node.md. They live in the
package so that a wheel install has them (the ``prolog/`` and ``epilog/`` files of the
source tree are shims over these). Each is the last line of defence: whatever goes
wrong, it exits 0, because a non-zero Prolog or Epilog drains the node and a failing
TaskProlog fails the task, which we never want for an error of our own. (The one
exception is not ours: a site TaskProlog that colloc's runs first, colloc.conf
``chain_task_prolog``, keeps its exit status, :mod:`slurm_colloc.node.chain`.)

The Prolog and the Epilog first offer their run to the node's script server
(:mod:`slurm_colloc.node.script_client`, issue 28): a worker forked from a process that
already holds colloc's imports runs :func:`run_here` for them. Without a server, or
whenever it does not take the run, they call :func:`run_here` themselves; a run that
found no server starts one for the next.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

ON_ERROR = {"prolog": "internal error, job runs without MPS",
            "epilog": "internal error, nothing requeued"}
"""What the last line of defence says a root script's internal error meant for the job."""


def prolog() -> int:
    """Prolog: MPS set-up for the job; failures are logged and the job runs without."""
    return _root_script("prolog")


def epilog() -> int:
    """Epilog: release MPS, scan for GPU OOM, keep evidence, requeue."""
    return _root_script("epilog")


NOT_SERVED = "--not-served"
"""``colloc-prolog --not-served WHY``: the C client (``script_client.c``) already offered
the run to the node's script server, which did not take it (``WHY``, logged); run it
here without asking again. Only root's client passes arguments: slurmd passes none."""


def _root_script(script: str) -> int:
    """The node's script server runs it, or this process does (see the module doc)."""
    started = None
    args = sys.argv[1:]
    try:
        from slurm_colloc import priority
        from slurm_colloc.node import script_client

        priority.raise_process()  # its job waits for it, from its first instruction
        started = script_client.process_start()
        if len(args) == 2 and args[0] == NOT_SERVED:
            why = args[1]
        else:
            out = script_client.call(script, os.environ, started)
            if out.status is not None:
                return out.status
            why = out.why
    except BaseException as e:  # noqa: BLE001 - never in the way: run it here
        why = f"client error {type(e).__name__}"
    return run_here(script, dict(os.environ), started, start_server=why == "absent",
                    not_served=why)


def run_here(script: str, env: Mapping[str, str], started: float | None = None,
             cpu_before: float = 0.0, start_server: bool = False,
             not_served: str | None = None) -> int:
    """Run the Prolog or Epilog body in this process (a script's own, or a server's
    worker); ``started``/``cpu_before``: the script's process start and its client's CPU,
    so its log line counts the whole run. ``not_served``: why the node's script server
    did not run it (on the log line). Always 0 (a non-zero status drains the node)."""
    job = env.get("SLURM_JOB_ID", "?")
    try:
        from slurm_colloc import priority
        from slurm_colloc.node.entry import epilog_main, prolog_main
        from slurm_colloc.node.timing import Stopwatch

        main = prolog_main if script == "prolog" else epilog_main
        watch = Stopwatch.since(started, cpu_before)
        watch.count_start()  # "start": its process and interpreter, or its hand-over
        watch.not_served = not_served
        with priority.boosted(priority.SCRIPT_NICE):  # its job waits for it (issue 28)
            return main(env, watch, start_server)
    except BaseException as e:  # noqa: BLE001 - last line of defence: never drain the node
        sys.stderr.write(f"colloc: {script}: job {job}: {ON_ERROR[script]}: {e!r}\n")
        return 0


def task_prolog() -> int:
    """TaskProlog: the site's chained TaskProlog, then the ``export`` lines the prolog
    prepared (see task_prolog.py and chain.py)."""
    job = os.environ.get("SLURM_JOB_ID", "?")
    try:
        from slurm_colloc.node.task_entry import task_prolog_main

        return task_prolog_main(dict(os.environ))
    except BaseException as e:  # noqa: BLE001 - a TaskProlog error must not fail the task
        sys.stdout.write(f"print colloc: task prolog: job {job}: internal error: {e!r}\n")
        return 0
