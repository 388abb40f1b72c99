"""The late epilog: colloc's epilog work for a job slurmd never ran it for (issue 28).

When slurmd is killed while a site Epilog line ahead of colloc's runs, the restarted
slurmd does not run the rest: colloc's epilog never runs, so an OOM'd job is not
requeued, its MPS registration stays, no evidence is kept and no record spooled.
The node's collector looks every 30 s for saved job contexts no epilog consumed
(:func:`slurm_colloc.mps.missed_epilogs.due`, root state only) and, when there are
some, starts this module detached (``python -I -m slurm_colloc.node.late_epilog``,
one at a time). It asks Slurm once (``squeue --json``) about those jobs and, for a
job whose saved attempt Slurm shows ended for :data:`~.missed_epilogs.ENDED_FOR_S`,
runs the epilog library's own steps (:func:`slurm_colloc.node.epilog.run`: MPS
release, OOM scan as the user, evidence, record spooled, requeue) under the job's
lock (:mod:`.epilog_once`), exactly once. A job Slurm no longer knows only has its
MPS state released. Every action is one ``late-epilog: job N: ...`` line in
``log_file``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from slurm_colloc import config as cfgmod
from slurm_colloc import root_lock
from slurm_colloc.mps import missed_epilogs as missed
from slurm_colloc.mps.tenancy import Tenancy, ensure_root_dir
from slurm_colloc.node import epilog, epilog_once
from slurm_colloc.node import job as jobmod
from slurm_colloc.node.logging_setup import node_logger
from slurm_colloc.slurm.adapter import SlurmAdapter, SlurmCli, SlurmError
from slurm_colloc.slurm.squeue_json import SlurmJob

MODULE = "slurm_colloc.node.late_epilog"


def ask(adapter: SlurmAdapter, ids: list[int]) -> dict[int, SlurmJob]:
    """One controller question about ``ids`` (``squeue --json --states=all``, only
    those ids where the adapter can ask for them); raises SlurmError, never "none"."""
    among = getattr(adapter, "jobs_among", None)
    if among is not None:
        got: dict[int, SlurmJob] = among(ids)
        return got
    want = set(ids)
    return {j: v for j, v in adapter.jobs().items() if j in want}


def _saved(tenancy: Tenancy, job_id: int) -> tuple[int, int]:
    """(uid, restarts) of the job's saved context; (-1, -1) when unreadable (then
    nothing but a release is ever done)."""
    text = tenancy.read_job_context(job_id)
    try:
        ctx = jobmod.context_from_json(text or "", {"SLURM_JOB_ID": str(job_id),
                                                    "SLURM_JOB_UID": _uid_in(text)})
    except jobmod.JobInfoError:
        return -1, -1
    return ctx.uid, ctx.restarts


def _uid_in(text: str | None) -> str:
    import json

    try:
        return str(int(json.loads(text or "")["uid"]))
    except (ValueError, KeyError, TypeError):
        return "-1"


def scan(cfg: cfgmod.CollocConfig, adapter: SlurmAdapter, now: float | None = None) -> int:
    """One round: ask Slurm about the owed jobs, act on those due. Returns how many
    jobs were acted on (run, released or given up)."""
    now = time.time() if now is None else now
    sdir = ensure_root_dir(missed.state_dir(cfg.evidence_dir), 0o700)
    missed.prune(cfg.mps_root, sdir, now)
    owed = missed.due(cfg.mps_root, sdir, now)
    if not owed:
        return 0
    try:
        jobs = ask(adapter, sorted(owed))
    except SlurmError as e:  # "did not answer" is never "gone"
        node_logger("late-epilog", ",".join(map(str, sorted(owed)))[:200], cfg.log_file) \
            .warning("slurmctld did not answer, asked again later: %s", e)
        return 0
    tenancy = Tenancy(Path(cfg.mps_root))
    acted = 0
    for job_id, mtime in owed.items():
        uid, restarts = _saved(tenancy, job_id)
        verdict = missed.decide(uid, restarts, jobs.get(job_id),
                                missed.read_watch(sdir, job_id, mtime), now)
        missed.write_watch(sdir, job_id, verdict.watch)
        if verdict.action != "wait":
            act(cfg, adapter, sdir, job_id, mtime, verdict, jobs.get(job_id))
            acted += 1
    return acted


def act(cfg: cfgmod.CollocConfig, adapter: SlurmAdapter, sdir: Path, job_id: int,
        mtime: float, verdict: missed.Verdict, job: SlurmJob | None) -> None:
    """Do what :func:`~.missed_epilogs.decide` said, under the job's lock, once."""
    log = node_logger("late-epilog", job_id, cfg.log_file)
    if verdict.action == "give_up":
        (sdir / f"{job_id}.gaveup").write_text(f"{mtime!r}\n")
        missed.forget_watch(sdir, job_id)
        log.warning("gave up: %s; its MPS state is left to the prolog's reaping", verdict.why)
        return
    fd = epilog_once.take(sdir, job_id)
    if fd is None:
        log.info("an epilog of the job holds its lock: not acting")
        return
    try:
        if missed.saved_contexts(cfg.mps_root, time.time() + missed.MIN_CTX_AGE_S) \
                .get(job_id) != mtime:
            log.info("its saved context changed (an epilog or a new prolog ran): not acting")
            return
        epilog_once.mark_late(sdir, job_id, mtime)  # before acting: at most once
        missed.forget_watch(sdir, job_id)
        if verdict.action == "release" or job is None:
            res = epilog.release_first(job_id, cfg)
            Tenancy(Path(cfg.mps_root)).forget_job_context(job_id)
            log.info("released MPS state only (%s): released=%s stopped=%s%s", verdict.why,
                     res.released, res.stopped_daemons,
                     f" errors: {'; '.join(res.errors)}" if res.errors else "")
            return
        started = time.monotonic()
        result = run_epilog(cfg, adapter, job_id, job, log)
        log.info("no colloc epilog did its work; %s: %s [took %.1f s]", verdict.why,
                 result.summary(), time.monotonic() - started)
    finally:
        epilog_once.drop(sdir, job_id, fd)


def run_epilog(cfg: cfgmod.CollocConfig, adapter: SlurmAdapter, job_id: int, job: SlurmJob,
               log: logging.LoggerAdapter[logging.Logger]) -> epilog.EpilogResult:
    """The epilog's own steps for the saved attempt, with the exit Slurm recorded.

    The context is the one the prolog saved (root's, from Slurm's JSON then), checked
    against Slurm's record now (job id, uid); the exit is Slurm's ``exit_code`` in
    slurmd's ``SLURM_JOB_EXIT_CODE2`` form. The logs are opened as the job's user, as
    the normal epilog does."""
    tenancy = Tenancy(Path(cfg.mps_root))
    text = tenancy.read_job_context(job_id)
    status, signal = job.exit_status
    env = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_UID": str(job.user_id),
           "SLURM_JOB_EXIT_CODE2": f"{status}:{signal}"}
    released = epilog.release_first(job_id, cfg)
    try:
        ctx = jobmod.context_from_json(text or "", env)
    finally:
        tenancy.forget_job_context(job_id)
    return epilog.run(ctx, cfg, adapter, log, released)


def main(argv: list[str] | None = None) -> int:
    """``python -m slurm_colloc.node.late_epilog``: one round; always exits 0."""
    from slurm_colloc.node.prolog import main_env

    log = node_logger("late-epilog", "-", None)
    try:
        cfg = cfgmod.load()
        log = node_logger("late-epilog", "-", cfg.log_file)
        fd = root_lock.try_lock(ensure_root_dir(missed.state_dir(cfg.evidence_dir), 0o700)
                                / "scan.lock")  # one late-epilog round at a time
        if fd is None:
            return 0
        try:
            scan(cfg, SlurmCli(env=main_env(os.environ), timeout=20))
        finally:
            os.close(fd)
    except Exception as e:  # noqa: BLE001 - a detached helper: log and end
        log.error("internal error, nothing done: %s: %s", type(e).__name__, e)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
