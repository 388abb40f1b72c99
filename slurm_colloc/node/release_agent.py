"""Release a job the epilog requeued on hold, once Slurm has finished completing it.

Why a detached helper: on Slurm 22.05 a requeued batch job gets a BeginTime about two
minutes ahead (credential lifetime), and an update of StartTime made while the job is
still COMPLETING (i.e. from inside the Epilog) is overwritten. So the epilog requeues
with a hold and raises the request, and this helper, detached from slurmd, waits
until the job is PENDING, sets StartTime=now and releases it. If it cannot, it
releases without the StartTime change: the job then starts after the delay; it is
never left held.
"""

from __future__ import annotations

import os
import sys
import time

from slurm_colloc.node.logging_setup import node_logger
from slurm_colloc.slurm.adapter import SlurmAdapter, SlurmError

WAIT_S = 180.0


def release_when_pending(adapter: SlurmAdapter, job_id: int, timeout: float = WAIT_S) -> str:
    """Wait for the job to leave COMPLETING, then StartTime=now and release."""
    deadline = time.monotonic() + timeout
    state = "UNKNOWN"
    while time.monotonic() < deadline:
        info = adapter.show_job(job_id) or {}
        state = info.get("JobState", "UNKNOWN")
        if state == "PENDING" and "COMPLETING" not in info.get("Reason", ""):
            try:
                adapter.update_job(job_id, StartTime="now")
            except SlurmError:
                pass
            adapter.release(job_id)
            return "released"
        if state not in ("PENDING", "COMPLETING", "UNKNOWN"):
            return f"not released: job is {state}"
        time.sleep(0.5)
    adapter.release(job_id)
    return f"released after timeout (state {state})"


def spawn(job_id: int, env: dict[str, str]) -> None:
    """Start the agent fully detached (own session; slurmd does not wait for it)."""
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.execve(
            sys.executable, [sys.executable, "-m", "slurm_colloc.node.release_agent", str(job_id)],
            env,
        )
    finally:
        os._exit(0)


def main() -> int:
    """Entry: ``python -m slurm_colloc.node.release_agent JOBID`` (root)."""
    from slurm_colloc import config as cfgmod
    from slurm_colloc.node.prolog import main_env
    from slurm_colloc.slurm.adapter import SlurmCli

    job_id = int(sys.argv[1])
    log_file = None
    try:
        log_file = cfgmod.load().log_file
    except cfgmod.ConfigError:
        pass
    log = node_logger("release-agent", job_id, log_file)
    try:
        outcome = release_when_pending(SlurmCli(env=main_env(os.environ), timeout=20), job_id)
        log.info("%s", outcome)
    except Exception as e:  # noqa: BLE001 - last resort: try a plain release
        log.error("failed (%s); releasing without StartTime", e)
        SlurmCli(env=main_env(os.environ)).run("scontrol", "release", str(job_id), check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
