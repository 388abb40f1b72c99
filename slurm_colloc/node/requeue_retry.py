"""A decided requeue slurmctld did not answer, retried by a detached helper until it
does (issue 28 item 2).

In the fault runs slurmctld was killed at the start of an OOM job's epilog:
``scontrol requeuehold`` timed out once, the job ended FAILED and its record said
"requeued". Now the epilog tries once (:func:`slurm_colloc.node.requeue_steps.advance`);
when slurmctld does not answer it leaves the plan in root's state
(``<state>/requeue/<job>.<attempt>.json``, 0600 in a 0700 directory) and starts this
module detached, as it does the record writer, so the epilog still ends in time
(slurmd waits for it, and the job stays COMPLETING meanwhile).

The helper retries with a pause doubling from :data:`PAUSE_S` to :data:`MAX_PAUSE_S`
until slurmctld answers. The bound is the job's own life in Slurm: once slurmctld
answers, it either accepts the requeue or refuses it (a job it no longer knows, past
``MinJobAge``: "Invalid job id"), and either ends the retry. Config
``requeue_retry_s`` caps the wait for a controller that never comes back. Every
outcome is logged, and the record says what happened: "requeued" only when Slurm
accepted the hold (the record then travels in AdminComment as before); otherwise
the record, marked "requeue failed: ...", goes to the record writer's spool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_colloc.node.requeue_steps import (
    ControllerAway,
    RequeuePlan,
    advance,
    failed_record,
    read_plan,
    write_plan,
)
from slurm_colloc.slurm.adapter import SlurmAdapter, SlurmError

PAUSE_S = 1.0
"""The first pause between tries."""
MAX_PAUSE_S = 30.0
"""The longest pause between tries."""
TRY_TIMEOUT_S = 20.0
"""Each Slurm command's own limit (as the epilog's)."""


@dataclass(frozen=True)
class Outcome:
    """How a retried requeue ended."""

    requeued: bool
    waited_s: float
    tries: int
    why: str
    """One sentence for the log and (when not requeued) the record."""
    errors: tuple[str, ...] = ()


def retry(plan: RequeuePlan, adapter: SlurmAdapter, *, cap_s: float,
          clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
          save: Callable[[RequeuePlan], None] = lambda p: None,
          log: Any = None) -> Outcome:
    """Advance ``plan`` until Slurm answers or ``cap_s`` after the decision has passed.

    ``save`` keeps the plan's progress after each try (a helper that dies goes on from
    there). ``clock`` is wall-clock time (the decision's time is one).
    """
    pause, tries = PAUSE_S, 0
    while True:
        tries += 1
        try:
            errors = advance(plan, adapter)
        except ControllerAway as e:
            save(plan)
            waited = clock() - plan.decided_at
            if waited >= cap_s:
                return Outcome(plan.held, waited, tries,
                               _unreachable(waited, plan) if not plan.held else
                               f"requeued, but slurmctld stopped answering ({e.step}) "
                               f"for {waited:.0f} s: the job may still be held "
                               f"(scontrol release {plan.job_id})")
            if log is not None and (tries == 1 or tries % 10 == 0):
                log.warning("attempt %s: requeue: %s; retrying for up to %.0f s more",
                            plan.attempt, e, cap_s - waited)
            sleep(min(pause, max(0.0, cap_s - waited)))
            pause = min(pause * 2, MAX_PAUSE_S)
            continue
        except SlurmError as e:
            save(plan)
            waited = clock() - plan.decided_at
            if plan.held:
                return Outcome(True, waited, tries, f"requeued; then Slurm refused: {e}")
            return Outcome(False, waited, tries,
                           f"requeue failed: slurmctld refused it after {waited:.0f} s: "
                           f"{str(e)[:200]}")
        save(plan)
        waited = clock() - plan.decided_at
        return Outcome(True, waited, tries, f"requeued after {waited:.0f} s "
                       f"({tries} tr{'y' if tries == 1 else 'ies'})", tuple(errors))


def _unreachable(waited: float, plan: RequeuePlan) -> str:
    """The record's sentence when the requeue never reached Slurm."""
    return f"requeue failed: controller unreachable for {waited:.0f} s"


# ------------------------------------------------------------------ the helper ---


def finish(plan: RequeuePlan, outcome: Outcome, cfg: Any, log: Any,
           spool: Callable[[str], None]) -> str | None:
    """Log the outcome; when the requeue did not land, spool the record saying so.
    Returns the record text spooled (None: none)."""
    if outcome.requeued:
        log.info("attempt %s: %s%s", plan.attempt, outcome.why,
                 f"; {'; '.join(outcome.errors)}" if outcome.errors else "")
        return None
    log.error("attempt %s: %s; the job stays as Slurm ended it", plan.attempt, outcome.why)
    text = failed_record(plan.record, plan.attempt, outcome.why,
                         max_bytes=cfg.admin_comment_max_bytes)
    if text is not None:
        spool(text)
    return text


def _spool_with_epilog(plan: RequeuePlan, cfg: Any) -> Callable[[str], None]:
    """The epilog's own spooling of a finished job's record (and its writer)."""
    from slurm_colloc.node import epilog, job

    def spool(text: str) -> None:
        env = {"SLURM_JOB_ID": str(plan.job_id)}
        ctx = None
        with contextlib.suppress(ValueError, job.JobInfoError):
            import json

            env["SLURM_JOB_UID"] = str(json.loads(plan.context)["uid"])
            ctx = job.context_from_json(plan.context, env)
        if ctx is None:
            raise SlurmError(f"job {plan.job_id}: no job context kept, record not spooled")
        result = epilog.EpilogResult(plan.job_id)
        epilog._spool_record(ctx, cfg, text, result)  # the one spool path (and its writer)
        if result.errors:
            raise SlurmError("; ".join(result.errors))

    return spool


# ------------------------------------------------------- release confirmation ---


def confirm_round(evidence_dir: str, adapter: SlurmAdapter, log_file: str | None,
                  now: float | None = None) -> int:
    """One round of release confirmation (:mod:`slurm_colloc.mps.release_confirm`):
    one ``squeue --json`` question about the due markers, then each decided. A marker
    whose retry helper still holds its plan waits (that helper releases, then leaves
    its own). Returns how many markers were acted on (released, done, given up)."""
    from slurm_colloc.mps import release_confirm as rc
    from slurm_colloc.node.late_epilog import ask
    from slurm_colloc.node.logging_setup import node_logger
    from slurm_colloc.node.requeue_steps import plan_dir, plan_path

    t = time.time() if now is None else now
    sdir = plan_dir(evidence_dir)
    for name in rc.markers(sdir)[1]:
        node_logger("requeue-confirm", name.split(".")[0], log_file).error(
            "unreadable release marker %s removed", name)
        (sdir / name).unlink(missing_ok=True)
    todo = []
    for m in rc.due(sdir, t):
        if os.path.lexists(plan_path(evidence_dir, m.job_id, m.attempt)):
            rc.write_marker(sdir, dataclasses.replace(m, next_check=t + rc.CHECK_EVERY_S))
        else:
            todo.append(m)
    if not todo:
        return 0
    answered, jobs = True, {}
    try:
        jobs = ask(adapter, [m.job_id for m in todo])
    except SlurmError:
        answered = False  # "did not answer" is never "gone": asked again later
    for m in todo:
        _confirm_one(sdir, m, rc.decide(m, jobs.get(m.job_id), t, answered=answered),
                     adapter, node_logger("requeue-confirm", m.job_id, log_file))
    return len(todo) if answered else 0


def _confirm_one(sdir: Path, m: Any, v: Any, adapter: SlurmAdapter, log: Any) -> None:
    """Do what :func:`slurm_colloc.mps.release_confirm.decide` said about one marker."""
    from slurm_colloc.mps import release_confirm as rc

    if v.action == "wait":
        rc.write_marker(sdir, v.marker)
    elif v.action == "done":
        rc.drop(sdir, m)
        log.info("attempt %s: release confirmed: %s", m.attempt, v.why)
    elif v.action == "give_up":
        rc.drop(sdir, m)
        log.error("attempt %s: release confirmation given up: %s", m.attempt, v.why)
    elif v.action == "lost":
        rc.drop(sdir, m)
        log.error("attempt %s: requeue lost: %s", m.attempt, v.why)
    else:
        rc.write_marker(sdir, v.marker)  # counted before acting: bounded even if we die
        try:
            errors = _release_again(m, adapter)
        except SlurmError as e:
            log.error("attempt %s: %s; releasing again failed: %s (looked at again in "
                      "%.0f s)", m.attempt, v.why, str(e)[:300], rc.CONFIRM_AFTER_S)
            return
        log.warning("attempt %s: %s: released again (%d of %d)%s", m.attempt, v.why,
                    v.marker.releases, rc.MAX_RELEASES,
                    f"; {'; '.join(errors)}" if errors else "")


def _release_again(m: Any, adapter: SlurmAdapter) -> list[str]:
    """The plan's steps after the hold, redone (a crash that lost the release may
    have lost the new request too; each step is idempotent); a bare release when the
    marker holds no readable plan."""
    try:
        plan = RequeuePlan.from_json(m.plan or "")
    except (ValueError, TypeError):
        adapter.release(m.job_id)
        return []
    if plan.job_id != m.job_id:
        adapter.release(m.job_id)
        return []
    plan.done, plan.hold_unsure = ["hold"], False
    return advance(plan, adapter)


def _confirm_lock(sdir: Path) -> int | None:
    """One confirmation round at a time on the node (root's 0700 directory)."""
    from slurm_colloc.root_lock import try_lock

    return try_lock(sdir / "confirm.lock")


def confirm_main() -> int:
    """``python -m slurm_colloc.node.requeue_retry --confirm``: one round; exits 0."""
    from slurm_colloc import config as cfgmod
    from slurm_colloc.mps.tenancy import ensure_root_dir
    from slurm_colloc.node.logging_setup import node_logger
    from slurm_colloc.node.prolog import main_env
    from slurm_colloc.node.requeue_steps import plan_dir
    from slurm_colloc.slurm.adapter import SlurmCli

    log = node_logger("requeue-confirm", "-", None)
    try:
        cfg = cfgmod.load()
        log = node_logger("requeue-confirm", "-", cfg.log_file)
        fd = _confirm_lock(ensure_root_dir(plan_dir(cfg.evidence_dir), 0o700))
        if fd is None:
            return 0
        try:
            confirm_round(cfg.evidence_dir, SlurmCli(env=main_env(os.environ),
                                                     timeout=TRY_TIMEOUT_S), cfg.log_file)
        finally:
            os.close(fd)
    except Exception as e:  # noqa: BLE001 - detached: log and end
        log.error("release confirmation stopped: %s: %s", type(e).__name__, e)
    return 0


def _keep_confirming(plan: RequeuePlan, cfg: Any, log: Any) -> Path | None:
    """The retry is over: when its hold landed, leave the release confirmation's
    marker (uid from the job context the epilog kept); its path."""
    import json

    from slurm_colloc.mps.tenancy import TenancyError
    from slurm_colloc.node.requeue_steps import confirm_later

    try:
        uid = int(json.loads(plan.context)["uid"])
        return confirm_later(cfg.evidence_dir, plan, uid, wait_s=cfg.requeue_retry_s)
    except (OSError, ValueError, KeyError, TypeError, TenancyError) as e:
        log.error("attempt %s: release confirmation not kept: %s", plan.attempt, e)
        return None


def confirm_here(marker: Path, evidence_dir: str, adapter: SlurmAdapter,
                 log_file: str | None, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.time) -> None:
    """The retry helper confirms its own release: after a long outage the collector
    may have idled out. A round (under the node's lock) each time the marker may be
    due, until it is gone or its ``give_up_s`` passed."""
    from slurm_colloc.mps import release_confirm as rc

    found = [m for m in rc.markers(marker.parent)[0]
             if rc.marker_path(marker.parent, m.job_id, m.attempt) == marker]
    end = clock() + (found[0].give_up_s if found else rc.GIVE_UP_S) + rc.LATE_S
    while os.path.lexists(marker) and clock() < end:
        sleep(rc.CONFIRM_AFTER_S)
        fd = _confirm_lock(marker.parent)
        if fd is None:
            continue  # a round of the collector's is at work
        try:
            confirm_round(evidence_dir, adapter, log_file, now=clock())
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """Entry: ``python -m slurm_colloc.node.requeue_retry PLANFILE`` (root, detached);
    ``--confirm``: one round of release confirmation."""
    from slurm_colloc import config as cfgmod
    from slurm_colloc.node.logging_setup import node_logger
    from slurm_colloc.node.prolog import main_env
    from slurm_colloc.slurm.adapter import SlurmCli

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--confirm"]:
        return confirm_main()
    path = Path(args[0])
    log = node_logger("requeue-retry", path.name.split(".")[0], None)
    try:
        cfg = cfgmod.load()
        log = node_logger("requeue-retry", path.name.split(".")[0], cfg.log_file)
        plan = read_plan(path)
        adapter = SlurmCli(env=main_env(os.environ), timeout=TRY_TIMEOUT_S)
        outcome = retry(plan, adapter, cap_s=cfg.requeue_retry_s,
                        save=lambda p: write_plan(path, p), log=log)
        finish(plan, outcome, cfg, log, _spool_with_epilog(plan, cfg))
        marker = _keep_confirming(plan, cfg, log)
        path.unlink(missing_ok=True)
        if marker is not None:
            with contextlib.suppress(OSError):  # the collector's rounds go on
                confirm_here(marker, cfg.evidence_dir, adapter, cfg.log_file)
    except Exception as e:  # noqa: BLE001 - detached: nothing above us to report to
        log.error("requeue retry of %s stopped: %s: %s (plan left in place)", path,
                  type(e).__name__, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
