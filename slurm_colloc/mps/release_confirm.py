"""Release confirmation (issue 28): a requeue Slurm accepted ends with the job released,
even when slurmctld lost the release.

colloc's requeue is ``scontrol requeuehold``, the new request, then ``scontrol
release`` (:mod:`slurm_colloc.node.requeue_steps`). When slurmctld accepts the release
and is SIGKILLed before it saves its state, the restarted slurmctld has the job still
held ("job requeued in held state") and nothing ever releases it: a lost requeue.
Likewise when a release "failed" because its answer was lost though Slurm did it.

So after a hold Slurm accepted, the epilog (or the retry helper, once done) leaves a
marker ``<state>/requeue/<job>.<attempt>.confirm`` (root 0600 JSON in root's 0700
directory; ``<state>``: the parent of ``evidence_dir``) holding the attempt, the uid
and the plan. The node's collector looks at these files every :data:`LOOK_EVERY_S`
(files only, no Slurm question) and, when one is due, starts
``python -I -m slurm_colloc.node.requeue_retry --confirm`` detached: one
``squeue --json`` question about the due jobs, then :func:`decide` for each.

The rule, on Slurm's ``--json`` answer only (no user-written field is read):

* the job unknown to Slurm, another restart count than the one colloc's hold began
  (``attempt + 1``), another uid, or not PENDING (running, ended): done, marker removed
  (a restart count below it, same uid: slurmctld lost the requeue itself, logged as an
  error; nothing is redone);
* PENDING and not held, seen by a controller that answered :data:`CONFIRM_AFTER_S` or
  more after the release: done (slurmctld saves a changed job within seconds, so a
  release it still shows then survives a later restart);
* PENDING and held by a requeuehold: ``hold`` true and slurmctld's own description
  ``job requeued in held state`` or the REQUEUE_HOLD flag: released again (the plan's
  steps after the hold redone, idempotent), one log line, checked again
  :data:`CONFIRM_AFTER_S` later; at most :data:`MAX_RELEASES` times;
* PENDING and held otherwise (an admin's or the user's own ``scontrol hold``: Slurm
  clears the description): left alone. The reason cannot tell them apart: on 26.05 a
  requeuehold by root shows JobHeldUser, an admin's hold JobHeldAdmin (seen by
  ``tests/e2e/test_release_confirm.py``);
* no answer: asked again every :data:`CHECK_EVERY_S` until ``give_up_s`` after the
  release (:data:`GIVE_UP_S`, or config ``requeue_retry_s`` when longer: the wait the
  requeue itself gets for a controller that is away), then given up with a log line
  naming the ``scontrol release`` to run.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Literal

from slurm_colloc.detach import spawn_module
from slurm_colloc.slurm.squeue_json import SlurmJob

DIR_NAME = "requeue"
"""The requeue state directory (shared with the retry helper's plans)."""
SUFFIX = ".confirm"
CONFIRM_AFTER_S = 30.0
"""The first look at a released job, and the pause after each re-release."""
CHECK_EVERY_S = 30.0
"""The pause after an unanswered question."""
GIVE_UP_S = 900.0
"""No question after this long since the release (at least)."""
MAX_GIVE_UP_S = 7 * 86400.0
LATE_S = 300.0
"""The collector stays for a marker this long past its ``give_up_s`` (time to give up)."""
MAX_RELEASES = 3
"""Re-releases of one attempt; a job held again after these is given up (logged)."""
LOOK_EVERY_S = 10.0
"""The collector looks at the markers (files only) this often."""
MAX_JOBS = 256
"""At most this many markers per round (bounded controller question)."""
MAX_FILES = 4096
"""At most this many markers are read per look (bounded work on a flooded directory)."""
MAX_BYTES = 256 << 10
CONFIRM_MODULE = "slurm_colloc.node.requeue_retry"
"""What the collector starts with ``--confirm`` (by name: metrics does not import node)."""
HELD_TEXT = "job requeued in held state"
"""slurmctld's ``state_description`` after ``scontrol requeuehold``."""

Action = Literal["wait", "release", "done", "give_up", "lost"]


@dataclass(frozen=True)
class Marker:
    """One hold Slurm accepted whose release is still to be seen (root's file)."""

    job_id: int
    attempt: int
    """The restart count of the attempt that failed; the hold made it ``attempt + 1``."""
    uid: int
    released_at: float
    """Wall-clock time the requeue's steps ended (the bound counts from it)."""
    next_check: float
    releases: int = 0
    """Re-releases done so far."""
    plan: str | None = None
    """The requeue plan (``RequeuePlan.to_json``): its steps after the hold are redone."""
    give_up_s: float = GIVE_UP_S
    """Unanswered questions end this long after the release."""

    @property
    def held_attempt(self) -> int:
        return self.attempt + 1


@dataclass(frozen=True)
class Verdict:
    action: Action
    marker: Marker
    why: str


def state_dir(evidence_dir: str) -> Path:
    """``<state>/requeue`` (``<state>``: the parent of ``evidence_dir``)."""
    return Path(evidence_dir).parent / DIR_NAME


def marker_path(sdir: Path, job_id: int, attempt: int) -> Path:
    return sdir / f"{int(job_id)}.{int(attempt)}{SUFFIX}"


def held_by_requeue(job: SlurmJob) -> bool:
    """Pending and held by a ``requeuehold`` (not a plain ``scontrol hold``)."""
    return (job.job_state.base == "PENDING" and job.held
            and ("REQUEUE_HOLD" in job.job_state.flags or job.state_description == HELD_TEXT))


def decide(m: Marker, job: SlurmJob | None, now: float, *, answered: bool = True) -> Verdict:
    """What to do about one marker given Slurm's answer (``answered`` False: none)."""
    since = now - m.released_at
    if not answered:
        if since >= m.give_up_s:
            return Verdict("give_up", m, f"slurmctld did not answer for {since:.0f} s after "
                           f"the release: the job may still be held "
                           f"(scontrol release {m.job_id})")
        return Verdict("wait", replace(m, next_check=now + CHECK_EVERY_S),
                       "slurmctld did not answer")
    if job is None:
        return Verdict("done", m, "unknown to Slurm")
    if job.restarts < m.held_attempt and job.user_id == m.uid:
        return Verdict("lost", m, f"Slurm shows restart {job.restarts} ({job.state}): the "
                       f"requeue it accepted is not in its state (slurmctld lost it)")
    if job.restarts != m.held_attempt or job.user_id != m.uid:
        return Verdict("done", m, f"Slurm shows uid {job.user_id} restart {job.restarts}, "
                       f"colloc's hold was uid {m.uid} restart {m.held_attempt}")
    if job.job_state.base != "PENDING":
        return Verdict("done", m, f"Slurm shows it {job.state}")
    if held_by_requeue(job):
        if m.releases >= MAX_RELEASES:
            return Verdict("give_up", m, f"still held after {m.releases} releases "
                           f"(scontrol release {m.job_id})")
        return Verdict("release", replace(m, releases=m.releases + 1,
                                          next_check=now + CONFIRM_AFTER_S),
                       f"still held {since:.0f} s after colloc's release ({job.reason})")
    if job.held:
        return Verdict("done", m, f"held by someone else ({job.reason}): left alone")
    if since < CONFIRM_AFTER_S:
        return Verdict("wait", replace(m, next_check=m.released_at + CONFIRM_AFTER_S),
                       "pending, released: looked at again later")
    return Verdict("done", m, f"pending and released ({job.reason})")


# ------------------------------------------------------------------ the files ---


def write_marker(sdir: Path, m: Marker) -> Path:
    """Whole or not at all, root 0600, never through a link."""
    path = marker_path(sdir, m.job_id, m.attempt)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(m), sort_keys=True))
    os.replace(tmp, path)
    return path


def drop(sdir: Path, m: Marker) -> None:
    with contextlib.suppress(FileNotFoundError):
        marker_path(sdir, m.job_id, m.attempt).unlink()


def _from_json(text: str) -> Marker:
    d = json.loads(text)
    if not isinstance(d, Mapping):
        raise ValueError("not an object")
    names = {f.name for f in fields(Marker)}
    m = Marker(**{k: v for k, v in d.items() if k in names})
    ints = (m.job_id, m.attempt, m.uid, m.releases)
    if not (all(isinstance(v, int) and not isinstance(v, bool) for v in ints) and m.job_id > 0
            and m.attempt >= 0 and m.uid >= 0 and m.releases >= 0
            and all(isinstance(v, (int, float)) for v in (m.released_at, m.next_check))
            and isinstance(m.give_up_s, (int, float)) and 0 < m.give_up_s <= MAX_GIVE_UP_S
            and (m.plan is None or isinstance(m.plan, str))):
        raise ValueError("marker fields out of range")
    return m


def markers(sdir: Path) -> tuple[list[Marker], list[str]]:
    """Every marker that is root's regular file (no link followed), oldest release
    first, and the names of unreadable ones. Nothing else in the directory is read."""
    from slurm_colloc.mps.control import read_small_file

    out: list[Marker] = []
    bad: list[str] = []
    try:
        entries = list(os.scandir(sdir))
    except OSError:
        return out, bad
    for e in entries:
        if not e.name.endswith(SUFFIX) or e.name.startswith("."):
            continue
        if len(out) + len(bad) >= MAX_FILES:
            break
        with contextlib.suppress(OSError):
            st = e.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            try:
                out.append(_from_json(read_small_file(Path(e.path), owner=os.geteuid(),
                                                      limit=MAX_BYTES)))
            except (ValueError, TypeError):
                bad.append(e.name)
    return sorted(out, key=lambda m: m.released_at), bad


def due(sdir: Path, now: float) -> list[Marker]:
    """The markers to ask Slurm about now, at most :data:`MAX_JOBS` (no controller
    question when this is empty)."""
    return [m for m in markers(sdir)[0] if m.next_check <= now][:MAX_JOBS]


def pending(sdir: Path, now: float) -> bool:
    """Whether a marker still waits for its confirmation (up to its ``give_up_s`` and
    :data:`LATE_S` after its release): the node's collector stays up for it."""
    return any(now - m.released_at < m.give_up_s + LATE_S for m in markers(sdir)[0])


def kick(sdir: Path, env: Mapping[str, str], now: float) -> bool:
    """The collector's chore: start the confirmer detached when a marker is due
    (files only; the confirmer takes a lock, so a second one ends at once)."""
    if not due(sdir, now):
        return False
    spawn_module(CONFIRM_MODULE, ("--confirm",), env)
    return True
