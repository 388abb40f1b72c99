"""Jobs a restarted slurmd left in their prolog: requeued (issue 28).

When slurmd is killed while a Prolog runs (a site line ahead of colloc's, or colloc's
own), the slurmd started next never finishes that prolog and never tells slurmctld it
is over. Slurm (seen on 26.05 and 24.11) then keeps the job ``RUNNING`` with ``Reason=Prolog``
for good: slurmctld waits for a prolog-complete message no slurmd will send, and the
node's registration does not clear a job still in its prolog. The job holds its
shards and never runs; colloc's prolog may never have run for it.

``scontrol requeue`` unsticks such a job without losing it and without draining the
node (measured: the job is pending again at once and reruns ~15 s later, as any
requeue; the node stays up). This module decides and does that:

* :func:`decide` (pure): a job allocated on this node, ``RUNNING`` (``CONFIGURING``
  included) with ``Reason=Prolog``, whose ``start_time`` is before this node's
  ``slurmd_start_time``, while ``now`` is at least ``stuck_prolog_grace_s`` past that
  slurmd start. Every fact is Slurm's ``--json`` output (squeue for the jobs, scontrol
  for the node); a user writes none of them (``state_reason`` and ``start_time`` are
  slurmctld's), so no user can make root requeue a job or keep it from requeuing.
* :func:`run` (one round): asks Slurm twice (``scontrol --json show node NAME``,
  ``squeue --json --states=RUNNING,CONFIGURING --nodelist=NAME``; each bounded by
  :data:`SLURM_TIMEOUT_S`), requeues at most :data:`MAX_REQUEUES` jobs, logs one
  ``stuck-prolog: job N: ...`` line per job in ``log_file``. For an attempt colloc's
  prolog never saw (no saved context in root's MPS state) it spools the attempt's
  record itself ("requeued: slurmd restarted during its prolog"), since the epilog
  that follows the requeue has nothing of it to record.
* :func:`~slurm_colloc.slurmd_watch.kick` (the trigger, no Slurm call, in
  :mod:`slurm_colloc.slurmd_watch` so that the collector can call it): the node's
  collector calls it every ``LOOK_EVERY_S``; it starts this module detached (at most
  every ``ROUND_EVERY_S``) (``python -I -m
  slurm_colloc.node.stuck_prologs``) only while a slurmd of this host (a root process
  named ``slurmd`` in ``/proc``) started between ``stuck_prolog_grace_s`` and
  ``stuck_prolog_grace_s`` + ``WINDOW_S`` ago. So slurmctld is asked only in the
  minutes after a slurmd restart, at most once a minute per node, never on every loop.

Optional trigger without a collector: slurmd's ``HealthCheckProgram`` (runs as root)
may run ``python -I -m slurm_colloc.node.stuck_prologs``; the same /proc gate applies
(``--force`` skips it), so a health check every few minutes costs nothing outside the
window (docs/admin.md 3.10).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm_colloc import config as cfgmod
from slurm_colloc import root_lock
from slurm_colloc.slurm.adapter import SlurmAdapter, SlurmError
from slurm_colloc.slurm.squeue_json import SlurmJob
from slurm_colloc.slurmd_watch import (  # the trigger, below the metrics layer
    check_due,
    slurmd_starts,
)

MAX_REQUEUES = 32
"""At most this many requeues per round (the rest wait for the next round)."""
SLURM_TIMEOUT_S = 20.0
"""Each Slurm call's bound."""
PROLOG_REASON = "Prolog"
"""``state_reason`` while slurmctld waits for the job's prolog (``WAIT_PROLOG``)."""
LOG_COMPONENT = "stuck-prolog"


@dataclass(frozen=True)
class Stuck:
    """A job to requeue and why (the log line's text)."""

    job_id: int
    restarts: int
    why: str


def stuck_in_prolog(job: SlurmJob) -> bool:
    """RUNNING (CONFIGURING included) and still waiting for its prolog."""
    return job.job_state.base == "RUNNING" and job.reason == PROLOG_REASON


def decide(jobs: Iterable[SlurmJob], slurmd_start: int | None, now: float,
           grace_s: float) -> list[Stuck]:
    """The jobs of ``jobs`` (this node's, from Slurm) a restarted slurmd left in their
    prolog: each started before ``slurmd_start`` (Slurm's ``slurmd_start_time`` of
    this node) and still waits for its prolog ``grace_s`` after it. Nothing when
    Slurm gave no slurmd start time or the grace has not passed."""
    if not slurmd_start or slurmd_start <= 0 or now < slurmd_start + grace_s:
        return []
    out = []
    for job in sorted(jobs, key=lambda j: j.job_id):
        if stuck_in_prolog(job) and 0 < job.start_time < slurmd_start:
            out.append(Stuck(job.job_id, job.restarts,
                             f"allocated at {_when(job.start_time)}, before slurmd "
                             f"restarted at {_when(slurmd_start)}; Slurm still waits for "
                             f"its prolog {now - slurmd_start:.0f} s later (Reason=Prolog)"))
    return out


def _when(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


# ------------------------------------------------------------------ one round
def node_name(env: Mapping[str, str]) -> str:
    """This node's Slurm name: slurmd's ``SLURMD_NODENAME`` (the collector was started
    by a prolog with slurmd's environment), else the short host name."""
    import socket

    name = env.get("SLURMD_NODENAME", "")
    return name if name else socket.gethostname().split(".")[0]


def run(cfg: cfgmod.CollocConfig, adapter: SlurmAdapter, node: str,
        now: float | None = None) -> list[Stuck]:
    """One round: ask Slurm, requeue what :func:`decide` says. Returns the jobs
    requeued. SlurmError when Slurm did not answer (nothing done then)."""
    log = _log(cfg, "-")
    slurmd_start = adapter.slurmd_start_time(node)
    jobs = adapter.jobs_on_node(node)
    now = time.time() if now is None else now
    done: list[Stuck] = []
    for s in decide(jobs.values(), slurmd_start, now, cfg.stuck_prolog_grace_s)[:MAX_REQUEUES]:
        jlog = _log(cfg, s.job_id)
        try:
            adapter.requeue(s.job_id)
        except SlurmError as e:
            jlog.warning("still in its prolog after slurmd's restart (%s); requeue refused, "
                         "the admin must act (scontrol requeue or scancel): %s", s.why,
                         str(e)[:300])
            continue
        done.append(s)
        recorded = _record_lost_attempt(cfg, jobs[s.job_id], node, now)
        jlog.info("%s: requeued%s", s.why, f"; {recorded}" if recorded else "")
    if not done:
        log.debug("nothing stuck in a prolog on %s", node)
    return done


def _prolog_saw(cfg: cfgmod.CollocConfig, job: SlurmJob) -> bool:
    """Whether colloc's prolog saved this attempt's context on the node (root's MPS
    state): then the epilog that follows the requeue records the attempt."""
    from slurm_colloc.mps.tenancy import Tenancy

    text = Tenancy(Path(cfg.mps_root)).read_job_context(job.job_id)
    if text is None:
        return False
    try:
        d = json.loads(text)
        return int(d["job_id"]) == job.job_id and int(d["restarts"]) == job.restarts
    except (ValueError, KeyError, TypeError):
        return False


def _record_lost_attempt(cfg: cfgmod.CollocConfig, job: SlurmJob, node: str,
                         now: float) -> str:
    """Spool the record of an attempt colloc's prolog never saw (what the epilog would
    have written had it known it); '' when the epilog will. Never raises."""
    from slurm_colloc.accounting import spool as spoolmod
    from slurm_colloc.accounting.codec import append_attempt, find_token
    from slurm_colloc.accounting.record import Attempt, Requeue
    from slurm_colloc.mps.tenancy import ensure_root_dir
    from slurm_colloc.node.prolog import main_env

    try:
        if _prolog_saw(cfg, job):
            return ""
        mine, other = ((job.system_comment, job.admin_comment)
                       if cfg.record_field == "system_comment"
                       else (job.admin_comment, job.system_comment))
        existing = mine
        if find_token(mine) is None and (m := find_token(other)) is not None:
            existing = f"{mine} {m.group(0)}".strip()
        attempt = Attempt(
            attempt=job.restarts, node=node, start=job.start_time or None, end=int(now),
            requeue=Requeue(requeued=True,
                            reason="slurmd restarted during its prolog; colloc requeued it"))
        text = append_attempt(existing, attempt, max_bytes=cfg.admin_comment_max_bytes)
        sdir = ensure_root_dir(spoolmod.spool_dir_of(cfg.evidence_dir), 0o700)
        spoolmod.write_entry(sdir, job.job_id, job.restarts, text)
        spoolmod.kick(sdir, main_env(os.environ), job_id=job.job_id)
        return f"attempt {job.restarts}'s record spooled (colloc's prolog never ran for it)"
    except Exception as e:  # noqa: BLE001 - the requeue is done; the record is extra
        return f"attempt {job.restarts}'s record not spooled: {type(e).__name__}: {e}"


def _log(cfg: cfgmod.CollocConfig, job: object) -> logging.LoggerAdapter[logging.Logger]:
    from slurm_colloc.node.logging_setup import node_logger

    return node_logger(LOG_COMPONENT, job, cfg.log_file)


def _round_lock(cfg: cfgmod.CollocConfig) -> int | None:
    """One round at a time on the node (root's 0700 late-epilog state directory)."""
    from slurm_colloc.mps import missed_epilogs
    from slurm_colloc.mps.tenancy import ensure_root_dir

    sdir = ensure_root_dir(missed_epilogs.state_dir(cfg.evidence_dir), 0o700)
    return root_lock.try_lock(sdir / "stuck-prologs.lock")


_ARGS = re.compile(r"--force")


def main(argv: list[str] | None = None) -> int:
    """``python -I -m slurm_colloc.node.stuck_prologs [--force]``: one round when
    slurmd restarted recently (``--force``: regardless); always exits 0."""
    from slurm_colloc.node.logging_setup import node_logger
    from slurm_colloc.node.prolog import main_env
    from slurm_colloc.slurm.adapter import SlurmCli

    args = list(sys.argv[1:] if argv is None else argv)
    log: logging.LoggerAdapter[logging.Logger] = node_logger(LOG_COMPONENT, "-", None)
    try:
        cfg = cfgmod.load()
        log = _log(cfg, "-")
        force = any(_ARGS.fullmatch(a) for a in args)
        if not force and not check_due(slurmd_starts(), time.time(),
                                       cfg.stuck_prolog_grace_s):
            return 0
        fd = _round_lock(cfg)
        if fd is None:
            return 0
        node = node_name(os.environ)
        try:
            run(cfg, SlurmCli(env=main_env(os.environ), timeout=SLURM_TIMEOUT_S), node)
        except SlurmError as e:  # "did not answer" is never "nothing stuck"
            log.warning("Slurm gave no answer about node %s (is that slurmd's NodeName? "
                        "SLURMD_NODENAME, else the host name), asked again later: %s",
                        node, str(e)[:300])
        finally:
            os.close(fd)
    except Exception as e:  # noqa: BLE001 - a detached helper: log and end
        log.error("internal error, nothing done: %s: %s", type(e).__name__, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
