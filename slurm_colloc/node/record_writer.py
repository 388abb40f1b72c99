"""Write a finished job's accounting record once Slurm lets us.

Why a detached helper: from inside the Epilog the job is still COMPLETING, when
``scontrol update AdminComment`` is refused ("Job has already finished"), and
``sacctmgr modify job`` only sticks once the controller has sent the job's final
record to slurmdbd (slurm-facts.md). So the epilog leaves the encoded text in a
root-owned spool file and starts this helper, which waits until slurmdbd has the
job's end (``sacct``: slurmdbd, not slurmctld, so no load on the controller; Slurm
advises against controller calls from node scripts), writes with sacctmgr (the
encoding survives its lowercasing), reads it back, and retries a few times. The
spool file is removed only after a verified write, so ``colloc admin`` tooling can
replay leftovers after a crash.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from slurm_colloc.node.detach import spawn_module
from slurm_colloc.node.logging_setup import node_logger
from slurm_colloc.slurm.adapter import TERMINAL_STATES, SlurmAdapter, SlurmError, by_start

TRIES = 8


def spool_path(spool_dir: str, job_id: int) -> Path:
    """Where the epilog leaves the text for job ``job_id``."""
    return Path(spool_dir) / f"{job_id}.adminc"


def write_when_finished(
    adapter: SlurmAdapter, job_id: int, text: str, *, wait: float = 120, pause: float = 1.0
) -> str:
    """Wait until slurmdbd records the job's end, then set and verify AdminComment.

    Asks slurmdbd only (sacct/sacctmgr), never the controller.
    """
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            recs = by_start(adapter.accounting([job_id]))
        except SlurmError:
            recs = []
        # the end time too: slurmdbd that was down gets the job-end record queued by
        # slurmctld after the state already reads final, and that late record rewrote
        # an AdminComment written in between (seen killing slurmdbd mid-run)
        state = (recs[-1].state.split() or [""])[0] if recs else ""  # "" when not recorded
        if (state in TERMINAL_STATES
                and recs[-1].fields.get("End", "Unknown") != "Unknown"):
            break
        time.sleep(pause)
    want = text.lower()
    for attempt in range(TRIES):
        try:
            adapter.set_admin_comment_finished(job_id, text)
            recs = adapter.accounting([job_id])
        except SlurmError as e:  # sacctmgr or the read-back: both worth another try
            last = str(e)
        else:
            if any(r.fields.get("AdminComment", "").lower() == want for r in recs):
                return f"written ({len(text)} bytes, try {attempt + 1})"
            last = "read back a different value"
        time.sleep(pause * (attempt + 1))
    raise SlurmError(f"AdminComment not written after {TRIES} tries: {last}")


def spawn(job_id: int, spool_file: Path, env: dict[str, str]) -> None:
    """Start the writer detached (slurmd does not wait for it)."""
    spawn_module("slurm_colloc.node.record_writer", (str(job_id), str(spool_file)), env)


def main() -> int:
    """Entry: ``python -m slurm_colloc.node.record_writer JOBID SPOOLFILE`` (root)."""
    from slurm_colloc import config as cfgmod
    from slurm_colloc.node.prolog import main_env
    from slurm_colloc.slurm.adapter import SlurmCli

    job_id, spool = int(sys.argv[1]), Path(sys.argv[2])
    log_file = None
    with contextlib.suppress(cfgmod.ConfigError):
        log_file = cfgmod.load().log_file
    log = node_logger("record-writer", job_id, log_file)
    try:
        text = spool.read_text()[:65536].strip()
        outcome = write_when_finished(SlurmCli(env=main_env(os.environ), timeout=30), job_id, text)
        spool.unlink()
        log.info("%s", outcome)
    except Exception as e:  # noqa: BLE001 - detached: nothing above us to report to
        log.error("record not written, left in %s: %s", spool, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
