"""Which jobs are owed colloc's epilog that slurmd never ran (issue 28: slurmd killed
while a site Epilog line ahead of colloc's ran; the restarted slurmd does not rerun it).

The evidence is root's own: the prolog's saved job context ``mps_root/ctx/<job>.json``
(root 0600), which colloc's epilog consumes first thing (``entry.epilog_context``) and
which the prolog's reaping of dead jobs' MPS markers leaves alone. A context still
there means: a prolog of this job ran here and no colloc epilog began since. Whether
the job is over comes from Slurm's ``--json`` answer only; nothing a user can write is
read. The decision (:func:`decide`) is pure; the state it keeps per job is one small
root-only file in ``<state>/late-epilog/`` (``<state>``: the parent of ``evidence_dir``).

Correctness over coverage: a job Slurm lists as holding resources, pending, or with
another restart count than the saved attempt is never acted on (its epilog may still
run, or a new attempt may start here); one it no longer knows at all only has its MPS
state released, after a grace.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from slurm_colloc.slurm.squeue_json import SlurmJob

ENDED_FOR_S = 20.0
"""Slurm must show the attempt ended this long before a late epilog runs."""
GONE_FOR_S = 120.0
"""A job Slurm no longer knows at all: released only after this long (a controller
restart's empty answer must not look like "gone"; the prolog's reaping waits as long)."""
GIVE_UP_S = 6 * 3600.0
"""No late epilog for a job Slurm has shown ended (or not known) for longer."""
MAX_CTX_AGE_S = 60 * 86400.0
"""A saved context older than this is not watched any more (bounded)."""
MIN_CTX_AGE_S = 20.0
"""A context this young belongs to a prolog that may still run: not yet a candidate."""
CHECK_EVERY_S = 30.0
"""A job Slurm shows running is asked about again after this (longer for long jobs)."""
LOOK_EVERY_S = 10.0
"""The collector looks at root's state (files only, no Slurm question) this often."""
MAX_CHECK_EVERY_S = 300.0
MAX_JOBS = 512
"""At most this many candidates per round (bounded work and controller question)."""
DIR_NAME = "late-epilog"
LATE_EPILOG_MODULE = "slurm_colloc.node.late_epilog"
"""What the collector starts (by name: metrics does not import node) when :func:`due`
finds jobs to ask Slurm about."""

ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY",
                          "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE"})

Action = Literal["wait", "run", "release", "give_up"]


def state_dir(evidence_dir: str) -> Path:
    """``<state>/late-epilog`` (``<state>``: the parent of ``evidence_dir``, where the
    spool and the requeue helper's files are)."""
    return Path(evidence_dir).parent / DIR_NAME


@dataclass(frozen=True)
class Watch:
    """What the watcher remembers of one job's saved context (root 0600 JSON)."""

    ctx_mtime: float
    """The saved context it is about (a new prolog writes a new one: a new watch)."""
    first_ended: float | None = None
    first_gone: float | None = None
    next_check: float = 0.0


@dataclass(frozen=True)
class Verdict:
    action: Action
    watch: Watch
    why: str


def decide(saved_uid: int, saved_restarts: int, job: SlurmJob | None, watch: Watch,
           now: float) -> Verdict:
    """What to do about one job whose saved context no epilog consumed.

    ``run``: the attempt the prolog saved is over by Slurm's word (an ended state, no
    COMPLETING flag, the same restart count and uid) for :data:`ENDED_FOR_S`: do the
    epilog's work. ``release``: Slurm no longer knows the job (for :data:`GONE_FOR_S`),
    or shows it ended as another attempt or another user's: release root's MPS state
    only. ``give_up``: nothing could be done for :data:`GIVE_UP_S`. ``wait``: ask again
    at ``watch.next_check``.
    """
    if job is None:
        gone = watch.first_gone if watch.first_gone is not None else now
        w = replace(watch, first_gone=gone, first_ended=None, next_check=now + CHECK_EVERY_S)
        if now - gone >= GIVE_UP_S:
            return Verdict("give_up", w, f"unknown to Slurm for {now - gone:.0f} s")
        if now - gone >= GONE_FOR_S:
            return Verdict("release", w, f"unknown to Slurm for {now - gone:.0f} s")
        return Verdict("wait", w, "unknown to Slurm: waiting before releasing")
    if not _ended(job):
        back = min(MAX_CHECK_EVERY_S, max(CHECK_EVERY_S, (now - watch.ctx_mtime) / 10))
        w = replace(watch, first_gone=None, first_ended=None, next_check=now + back)
        return Verdict("wait", w, f"Slurm shows it {job.state}")
    ended = watch.first_ended if watch.first_ended is not None else now
    w = replace(watch, first_gone=None, first_ended=ended,
                next_check=max(now, ended + ENDED_FOR_S) if now - ended < ENDED_FOR_S
                else now + CHECK_EVERY_S)
    if now - ended >= GIVE_UP_S:
        return Verdict("give_up", w, f"ended for {now - ended:.0f} s")
    if now - ended < ENDED_FOR_S:
        return Verdict("wait", w, f"{job.state} for {now - ended:.0f} s")
    if job.user_id != saved_uid or job.restarts != saved_restarts:
        return Verdict("release", w, f"Slurm shows uid {job.user_id} attempt {job.restarts}, "
                       f"the prolog saved uid {saved_uid} attempt {saved_restarts}")
    return Verdict("run", w, f"{job.state} for {now - ended:.0f} s")


def _ended(job: SlurmJob) -> bool:
    """Over by Slurm's word: an ended base state and no flag that says otherwise."""
    busy = {"COMPLETING", "STAGE_OUT", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SIGNALING"}
    return (job.state in ENDED_STATES and job.job_state.base in ENDED_STATES
            and not (job.job_state.flags & busy))


def saved_contexts(mps_root: str | os.PathLike[str], now: float) -> dict[int, float]:
    """Job id -> mtime of each saved context that is root's regular file, at least
    :data:`MIN_CTX_AGE_S` and at most :data:`MAX_CTX_AGE_S` old (no link followed)."""
    d = Path(mps_root) / "ctx"
    out: dict[int, float] = {}
    try:
        entries = list(os.scandir(d))
    except OSError:
        return out
    for e in entries:
        name = e.name
        if not name.endswith(".json") or not name[:-5].isdigit() or len(name) > 17:
            continue
        with contextlib.suppress(OSError):
            st = e.stat(follow_symlinks=False)
            if (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
                    and MIN_CTX_AGE_S <= now - st.st_mtime <= MAX_CTX_AGE_S):
                out[int(name[:-5])] = st.st_mtime
    return out


def watch_path(sdir: Path, job_id: int) -> Path:
    return sdir / f"{int(job_id)}.watch"


def read_watch(sdir: Path, job_id: int, ctx_mtime: float) -> Watch:
    """The job's watch for this saved context (a fresh one when none or another's)."""
    from slurm_colloc.mps.control import read_small_file

    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        d = json.loads(read_small_file(watch_path(sdir, job_id), owner=os.geteuid(), limit=4096))
        w = Watch(ctx_mtime=float(d["ctx_mtime"]),
                  first_ended=None if d.get("first_ended") is None else float(d["first_ended"]),
                  first_gone=None if d.get("first_gone") is None else float(d["first_gone"]),
                  next_check=float(d.get("next_check", 0.0)))
        if w.ctx_mtime == ctx_mtime:
            return w
    return Watch(ctx_mtime=ctx_mtime)


def write_watch(sdir: Path, job_id: int, watch: Watch) -> None:
    """Atomic, root 0600, no link followed."""
    path = watch_path(sdir, job_id)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(watch)))
    os.replace(tmp, path)


def forget_watch(sdir: Path, job_id: int) -> None:
    with contextlib.suppress(OSError):
        watch_path(sdir, job_id).unlink()


def gave_up(sdir: Path, job_id: int, ctx_mtime: float) -> bool:
    """Whether the watcher gave this saved context up (``<job>.gaveup`` names it)."""
    from slurm_colloc.mps.control import read_small_file

    with contextlib.suppress(OSError, ValueError):
        text = read_small_file(sdir / f"{int(job_id)}.gaveup", owner=os.geteuid(), limit=64)
        return float(text.strip()) == ctx_mtime
    return False


def due(mps_root: str | os.PathLike[str], sdir: Path, now: float) -> dict[int, float]:
    """The saved contexts to ask Slurm about now (job id -> context mtime), at most
    :data:`MAX_JOBS`, oldest first: no controller question when this is empty."""
    out: dict[int, float] = {}
    for job, mtime in sorted(saved_contexts(mps_root, now).items(), key=lambda kv: kv[1]):
        if len(out) >= MAX_JOBS:
            break
        if read_watch(sdir, job, mtime).next_check <= now and not gave_up(sdir, job, mtime):
            out[job] = mtime
    return out


def owed(mps_root: str | os.PathLike[str], sdir: Path, now: float) -> bool:
    """Whether a saved context (older than :data:`MIN_CTX_AGE_S`) still waits for an
    epilog the watcher has not given up: the node's collector stays up for it."""
    return any(not gave_up(sdir, job, mtime)
               for job, mtime in saved_contexts(mps_root, now).items())


KEEP_MARKERS_S = 7 * 86400.0
"""``<job>.late`` and ``<job>.gaveup`` are kept this long, then removed (bounded)."""


def prune(mps_root: str | os.PathLike[str], sdir: Path, now: float) -> int:
    """Remove watches of contexts an epilog consumed meanwhile, and old markers.
    Returns how many files went."""
    ctx_dir = Path(mps_root) / "ctx"
    gone = 0
    try:
        entries = list(os.scandir(sdir))
    except OSError:
        return 0
    for e in entries:
        stem, _, kind = e.name.partition(".")
        if not stem.isdigit() or kind not in ("watch", "late", "gaveup"):
            continue
        with contextlib.suppress(OSError):
            old = now - e.stat(follow_symlinks=False).st_mtime > KEEP_MARKERS_S
            if (kind == "watch" and not os.path.lexists(ctx_dir / f"{stem}.json")) or (
                    kind != "watch" and old):
                os.unlink(e.path)
                gone += 1
    return gone


def answered(jobs: Mapping[int, SlurmJob], job_id: int) -> SlurmJob | None:
    """The job in a controller answer (None: the controller does not hold it)."""
    return jobs.get(job_id)
