"""Write finished jobs' accounting records once Slurm lets us: one writer per node.

Why a detached helper: from inside the Epilog the job is still COMPLETING, when
``scontrol update AdminComment`` is refused ("Job has already finished"), and
``sacctmgr modify job`` only sticks once the controller has sent the job's final
record to slurmdbd (slurm-facts.md). The field is config ``record_field``
(AdminComment, or SystemComment at jobstats sites); a jobstats ``JS1:`` summary
found there is never replaced (:func:`write_verified`). So the epilog leaves the
encoded text in root's spool (``<spool>/<jobid>.adminc``, a 0700 directory) and
makes sure a writer runs. The writer waits until slurmdbd has each job's end
(``sacct``: slurmdbd, not slurmctld, so no load on the controller; Slurm advises
against controller calls from node scripts), writes with sacctmgr (the encoding
survives its lowercasing), reads it back, and retries a few times. A spool file is
removed only after a verified write; one given up is renamed
``<jobid>.adminc.failed`` for an admin to replay.

**One writer per node** (issue 23). Each finished job used to start its own root
process polling sacct every second for up to 120 s: a flood of short jobs forked
hundreds of pollers. Now:

* the writer holds an exclusive ``flock`` on :data:`LOCK_NAME` (root 0600 in root's
  spool directory, opened ``O_NOFOLLOW``; no user can open it, so no user can hold
  it); a second writer exits at once;
* the epilog spools first, then takes the lock (non-blocking) and hands it to the
  writer it starts (an inherited descriptor): while one writer runs or starts up no
  epilog starts another (:func:`spawn`); a writer that finds the spool empty releases
  the lock and looks once more (:func:`run_writer`), so a record spooled while it was
  ending is never left without a writer;
* each round asks slurmdbd once for every pending job (at most :data:`BATCH`), and
  the pause between rounds doubles while nothing can be written, from
  :data:`PAUSE_S` to :data:`MAX_PAUSE_S`;
* bounded: a record is written anyway after :data:`WAIT_S`, given up after
  :data:`TRIES` failed writes; the writer exits when the spool is empty.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_colloc.accounting.field import placement
from slurm_colloc.config import RecordField
from slurm_colloc.detach import PASSED_FD, spawn_module
from slurm_colloc.node.logging_setup import node_logger
from slurm_colloc.slurm.adapter import TERMINAL_STATES, SlurmAdapter, SlurmError, by_start

MODULE = "slurm_colloc.node.record_writer"
LOCK_NAME = "writer.lock"
"""The writer's lock in the spool directory (root 0600)."""
TRIES = 8
"""Failed writes (or unverified read-backs) before a record is given up."""
WAIT_S = 120.0
"""How long a record waits for slurmdbd to show its job's end before it is written
anyway."""
PAUSE_S = 1.0
"""The first pause between rounds, and after any progress."""
MAX_PAUSE_S = 30.0
"""The longest pause between rounds."""
BATCH = 100
"""Pending records looked at per round (the oldest first): one sacct call for them."""
MAX_SCAN = 10000
"""Spool entries listed at most per round."""
MAX_RECORD_BYTES = 65536
"""What is read of one spool file."""
LOCK_TRIES = 5
"""A starting writer retries the lock this often (0.1 s apart): an epilog's probe
holds it for an instant."""
_NAME = re.compile(r"([0-9]{1,19})\.adminc")

LogFor = Callable[[int], "logging.LoggerAdapter[Any]"]


def spool_path(spool_dir: str, job_id: int) -> Path:
    """Where the epilog leaves the text for job ``job_id``."""
    return Path(spool_dir) / f"{job_id}.adminc"


# ------------------------------------------------------------------ the lock ---


def _open_lock(spool_dir: Path) -> int:
    """Root's lock file in ``spool_dir``, never through a link; OSError otherwise."""
    fd = os.open(spool_dir / LOCK_NAME,
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(f"{spool_dir / LOCK_NAME}: not root's regular file")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_lock(spool_dir: Path) -> int | None:
    """The writer's lock, held (an fd to close to release it), or None when another
    process holds it. OSError when the lock file is not root's (a link, another
    owner): nothing is locked, the caller reports it."""
    fd = _open_lock(spool_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def spawn(job_id: int, spool_file: Path, env: dict[str, str]) -> bool:
    """Start the node's writer detached unless one runs; True when one was started.

    Call it after the record is in the spool. The lock is taken here and handed to
    the writer (it inherits the descriptor), so no other epilog starts a second one
    while the first is still starting up (measured: 50 short jobs started 7 writers
    when each writer took the lock itself). A writer that is ending releases the lock,
    then looks at the spool once more. Raises OSError when the lock file is not root's.
    """
    fd = try_lock(spool_file.parent)
    if fd is None:
        return False  # a writer holds it: it drains this record too
    try:
        spawn_module(MODULE, (str(job_id), str(spool_file), str(PASSED_FD)), env, pass_fd=fd)
    finally:
        os.close(fd)  # the writer's copy keeps the lock
    return True


def _adopt_lock(fd: int, spool_dir: Path) -> int | None:
    """The lock the epilog handed over as ``fd``, verified to be this spool's lock
    and held; None (and ``fd`` closed) otherwise."""
    try:
        st, want = os.fstat(fd), os.stat(spool_dir / LOCK_NAME, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):
            raise OSError("not the spool's lock")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours already: a no-op
    except OSError:
        with contextlib.suppress(OSError):
            os.close(fd)
        return None
    return fd


# --------------------------------------------------------------- the spool ---


def pending(spool_dir: Path) -> dict[int, Path]:
    """Spooled records, the oldest :data:`BATCH` (by mtime), by job id."""
    found: list[tuple[float, int, Path]] = []
    with contextlib.suppress(FileNotFoundError), os.scandir(spool_dir) as it:
        for n, entry in enumerate(it):
            if n >= MAX_SCAN:
                break
            m = _NAME.fullmatch(entry.name)
            if m is None:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            found.append((st.st_mtime, int(m.group(1)), Path(entry.path)))
    found.sort()
    return {job: path for _, job, path in found[:BATCH]}


def _read_record(path: Path) -> str:
    """A spool file's text: a regular file, never through a link, bounded."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        data = os.read(fd, MAX_RECORD_BYTES)
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").strip()


def _give_up(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.rename(path, path.with_name(path.name + ".failed"))


# --------------------------------------------------------------- slurmdbd ---


def _finished(adapter: SlurmAdapter, jobs: list[int],
              rows_out: dict[str, list[Any]] | None = None) -> set[int]:
    """The jobs whose end slurmdbd has recorded (one sacct call; none on error).

    The end time too, not only a final state: slurmdbd that was down gets the job-end
    record queued by slurmctld after the state already reads final, and that late
    record rewrote an AdminComment written in between (seen killing slurmdbd mid-run).
    ``rows_out`` (when given) receives the rows by job id, for :func:`write_verified`.
    """
    try:
        rows = adapter.accounting(jobs)
    except SlurmError:
        return set()
    by_job: dict[str, list[Any]] = {} if rows_out is None else rows_out
    for r in rows:
        by_job.setdefault(r.job_id, []).append(r)
    done = set()
    for job in jobs:
        recs = by_start(by_job.get(str(job), []))
        if not recs:
            continue
        state = (recs[-1].state.split() or [""])[0]
        if state in TERMINAL_STATES and recs[-1].fields.get("End", "Unknown") != "Unknown":
            done.add(job)
    return done


def write_verified(adapter: SlurmAdapter, job_id: int, text: str,
                   field: RecordField = "admin_comment",
                   current: Iterable[Mapping[str, str]] = ()) -> str | None:
    """Set the record's field once and read it back: None when verified, else why not.

    ``field`` is config ``record_field``; ``current`` the job's accounting fields as
    this round's sacct saw them. A jobstats summary (``JS1:``) already in that field is
    never replaced: the record goes to the other field instead
    (:func:`slurm_colloc.accounting.field.placement`)."""
    where = placement(current, field, text)
    if where is None:
        return "both comment fields hold a jobstats summary: nowhere to write"
    name, text = where
    try:
        if name == "AdminComment":
            adapter.set_admin_comment_finished(job_id, text)
        else:
            adapter.set_field_finished(job_id, name, text)
        recs = adapter.accounting([job_id])
    except SlurmError as e:  # sacctmgr or the read-back: both worth another try
        return str(e)
    want = text.lower()
    if any(r.fields.get(name, "").lower() == want for r in recs):
        return None
    return "read back a different value"


@dataclass
class _Entry:
    first_seen: float
    tries: int = 0
    next_try: float = 0.0


def drain(adapter: SlurmAdapter, spool_dir: Path, log_for: LogFor, *, wait: float = WAIT_S,
          pause: float = PAUSE_S, field: RecordField = "admin_comment") -> int:
    """Write spooled records until the spool is empty; the number written.

    The caller holds the writer's lock. ``field``: config ``record_field``."""
    state: dict[int, _Entry] = {}
    written, delay = 0, pause
    while True:
        jobs = pending(spool_dir)
        if not jobs:
            return written
        now = time.monotonic()
        state = {j: state.get(j) or _Entry(now) for j in jobs}
        fresh = any(e.first_seen == now for e in state.values())
        rows: dict[str, list[Any]] = {}
        finished = _finished(adapter, list(jobs), rows)
        progressed = False
        for job, path in jobs.items():
            e = state[job]
            now = time.monotonic()
            if (job not in finished and now - e.first_seen < wait) or now < e.next_try:
                continue
            log = log_for(job)
            try:
                text = _read_record(path)
            except OSError as err:
                log.error("spooled record unreadable, set aside: %s", err)
                _give_up(path)
                continue
            why = write_verified(adapter, job, text, field,
                                 [r.fields for r in rows.get(str(job), [])])
            if why is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                log.info("written (%d bytes, try %d)", len(text), e.tries + 1)
                written += 1
                progressed = True
                continue
            e.tries += 1
            e.next_try = time.monotonic() + pause * e.tries
            if e.tries >= TRIES:
                _give_up(path)
                log.error("AdminComment not written after %d tries, left in %s.failed: %s",
                          TRIES, path, why)
        if not pending(spool_dir):
            return written
        delay = pause if progressed or fresh else min(MAX_PAUSE_S, delay * 2)
        time.sleep(delay)


def run_writer(spool_dir: Path, adapter: SlurmAdapter, log_for: LogFor,
               held: int | None = None, field: RecordField = "admin_comment") -> int:
    """Be the node's one writer: lock, drain, release, look again; the number written.

    ``held``: the lock the epilog took and handed over (the first round uses it).
    Returns at once (0) when another writer holds the lock."""
    written = 0
    fd = held
    tries = LOCK_TRIES
    while True:
        for attempt in range(tries):
            if fd is not None:
                break
            fd = try_lock(spool_dir)
            if fd is None and attempt < tries - 1:
                time.sleep(0.1)
        if fd is None:
            return written  # another writer drains the spool
        tries = 1  # after a round: a lock held now is a newer writer's, which drains
        try:
            written += drain(adapter, spool_dir, log_for, field=field)
        finally:
            os.close(fd)
            fd = None
        if not pending(spool_dir):
            return written


def main() -> int:
    """Entry: ``python -m slurm_colloc.node.record_writer JOBID SPOOLFILE [LOCKFD]``
    (root). Drains SPOOLFILE's directory; JOBID is the job whose epilog started it;
    LOCKFD the writer's lock that epilog took and handed over."""
    from slurm_colloc import config as cfgmod
    from slurm_colloc.node.prolog import main_env
    from slurm_colloc.slurm.adapter import SlurmCli

    job_id, spool = int(sys.argv[1]), Path(sys.argv[2])
    handed = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3].isdigit() else None
    log_file = None
    field: RecordField = "admin_comment"
    with contextlib.suppress(cfgmod.ConfigError):
        cfg = cfgmod.load()
        log_file, field = cfg.log_file, cfg.record_field

    def log_for(job: int) -> logging.LoggerAdapter[Any]:
        return node_logger("record-writer", job, log_file)

    try:
        held = _adopt_lock(handed, spool.parent) if handed is not None else None
        run_writer(spool.parent, SlurmCli(env=main_env(os.environ), timeout=30), log_for, held,
                   field)
    except Exception as e:  # noqa: BLE001 - detached: nothing above us to report to
        log_for(job_id).error("records not written, left in %s: %s", spool.parent, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
