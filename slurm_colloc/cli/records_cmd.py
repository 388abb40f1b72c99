"""``colloc admin records [--replay]``: what root's record spool still holds.

Issue 28: while slurmdbd (or MariaDB) is away, every finished attempt's record waits
in root's spool on its node (:mod:`slurm_colloc.accounting.spool`) until accounting
is read back holding it, and a record written and read back is kept *confirming*
until slurmctld has forgotten its job (a restarted slurmctld can re-send the job and
replace it). This lists those entries (job, attempt, age, state, why still there)
and, with ``--replay``, runs the node's writer once, now, in the foreground. Run it
as root on a compute node.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import click

from slurm_colloc import config as config_mod
from slurm_colloc.accounting import spool as spoolmod


def _age(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def listing(spool_dir: Path, now: float | None = None) -> list[str]:
    """One line per entry, the oldest first, and a header; a line saying the spool is
    empty otherwise. STATE is ``pending`` (not yet in accounting) or ``confirming``
    (written and read back, AGE since then; kept until slurmctld forgets the job)."""
    found = spoolmod.entries(spool_dir)
    if not found:
        return [f"no pending records in {spool_dir}"]
    confirming = sum(1 for e in found if e.confirming)
    head = f"{len(found) - confirming} pending record(s) in {spool_dir}"
    if confirming:
        head += (f", {confirming} written and confirming (kept until slurmctld forgets "
                 "the job)")
    lines = [head + ":", f"{'JOB':>10} {'ATTEMPT':>7} {'AGE':>7} {'STATE':<10}  LAST NOTE"]
    for e in found:
        attempt = "?" if e.attempt is None else str(e.attempt)
        why = " ".join(e.last_error().split()) or "-"
        state = "confirming" if e.confirming else "pending"
        lines.append(f"{e.job_id:>10} {attempt:>7} {_age(e.age(now)):>7} {state:<10}  {why}")
    return lines


def replay(spool_dir: Path, adapter: Any, cfg: config_mod.CollocConfig,
           log_for: Any) -> tuple[int, str]:
    """One round of the node's writer, now: (entries confirmed, a note). Refused
    (0 and why) while another writer holds the lock: it is replaying already."""
    from slurm_colloc.node import record_writer

    if not spoolmod.entries(spool_dir, 1):
        return 0, "nothing to replay"
    fd = spoolmod.try_lock(spool_dir)
    if fd is None:
        return 0, "a writer is replaying the spool right now; look again in a minute"
    try:
        n = record_writer.drain(adapter, spool_dir, log_for, field=cfg.record_field,
                                max_bytes=cfg.admin_comment_max_bytes, max_rounds=1)
    finally:
        os.close(fd)
    return n, (f"{n} record(s) read back in accounting (kept confirming until slurmctld "
               "forgets the job)")


@click.command("records")
@click.option("--replay", "do_replay", is_flag=True,
              help="Write pending records to accounting now (one round; root).")
def records(do_replay: bool) -> None:
    """Records waiting in this node's spool for accounting (job, attempt, age, last
    error); --replay writes them now."""
    try:
        cfg = config_mod.load()
    except config_mod.ConfigError as e:
        raise click.ClickException(str(e)) from e
    spool_dir = spoolmod.spool_dir_of(cfg.evidence_dir)
    if do_replay:
        from slurm_colloc.node.prolog import main_env
        from slurm_colloc.slurm.adapter import SlurmCli

        log = logging.getLogger("colloc.admin.records")

        def log_for(job: int) -> logging.LoggerAdapter[Any]:
            return logging.LoggerAdapter(log, {"job": job})

        try:
            _, note = replay(spool_dir, SlurmCli(env=main_env(os.environ), timeout=30), cfg,
                             log_for)
        except OSError as e:
            raise click.ClickException(f"replay: {e}") from e
        click.echo(note)
    for line in listing(spool_dir, time.time()):
        click.echo(line)
