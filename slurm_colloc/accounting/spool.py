"""Root's record spool: one durable file per (job, attempt) until accounting has it.

Why (issue 28): with slurmdbd and MariaDB away for four minutes, 4 of 6 records were
lost. The writer gave up after ~36 s and left a file nothing replayed; files were
named per job, so an older attempt's writer finishing last overwrote the final
record. Now:

* the epilog writes ``<spool>/<job>.<attempt>.adminc`` **before** anything is asked
  of Slurm, whole or not at all (temporary file, ``fsync``, rename, ``fsync`` of the
  directory), in root's state directory (next to the evidence, never ``/run``), so
  it survives a crash or a reboot;
* a file is never removed on the strength of one read-back: once accounting holds
  it, it is renamed ``<job>.<attempt>.adminc.confirming`` (written, confirming) and
  kept until slurmctld no longer holds the job, or :data:`CONFIRM_MAX_S` (issue 28:
  slurmctld, restarted, re-sent a job with its own AdminComment and replaced a
  record colloc had written and read back; the writer rewrites such a record from
  the confirming entry, :mod:`slurm_colloc.node.record_writer`); nothing is ever
  given up;
* whatever runs next on the node replays it: the prolog, the epilog and the
  collector's loop call :func:`kick`, which starts the node's one writer (under its
  lock, non-blocking) when the spool holds anything;
* the replayer notes why an entry is still here in ``<name>.err`` (what
  ``colloc admin records`` shows, confirming entries apart from pending ones).

The layer sits below ``node`` and ``metrics`` so that both can kick a replay; the
writer itself is started by module name.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from slurm_colloc import root_lock
from slurm_colloc.detach import PASSED_FD, spawn_module

WRITER_MODULE = "slurm_colloc.node.record_writer"
LOCK_NAME = "writer.lock"
"""The writer's lock in the spool directory (root 0600)."""
SUFFIX = ".adminc"
ERR_SUFFIX = ".err"
CONFIRM_SUFFIX = ".confirming"
"""A record written and read back, kept until slurmctld has forgotten its job."""
CONFIRM_MAX_S = 3600.0
"""The longest a written record is kept confirming (slurmctld never answering, or a
site's ``MinJobAge`` over an hour)."""
MAX_SCAN = 10000
"""Spool entries listed at most per look."""
MAX_RECORD_BYTES = 65536
"""What is read of one spool file."""
MAX_ERR_BYTES = 512
REPLAY_EVERY_S = 60.0
"""How often the collector's loop kicks a replay while the spool holds records."""
CONFIRM_EVERY_S = REPLAY_EVERY_S / 2
"""A confirming entry is re-read at most this often (half the kick's period, so
each of the collector's kicks finds it due)."""
STAY_FOR_S = 7 * 86400.0
"""The collector stays up (:func:`holds_work`) for spool entries at most this old:
a week of accounting outage; older ones wait for the next job's prolog or epilog."""
_NAME = re.compile(r"([0-9]{1,19})(?:\.([0-9]{1,6}))?\.adminc(\.failed|\.confirming)?")
"""``<job>.<attempt>.adminc``, or ``….adminc.confirming`` once written; ``<job>.adminc``
and ``.failed`` are left by writers before issue 28 and replayed too (attempt
unknown)."""


def spool_dir_of(evidence_dir: str) -> Path:
    """Root's spool: beside the evidence directory (``/var/lib/colloc/spool`` by
    default), on persistent storage."""
    return Path(evidence_dir).parent / "spool"


def entry_path(spool_dir: Path, job_id: int, attempt: int | None) -> Path:
    """Where the record of ``job_id``'s ``attempt`` waits (None: the legacy per-job name)."""
    name = f"{job_id}{SUFFIX}" if attempt is None else f"{job_id}.{attempt}{SUFFIX}"
    return spool_dir / name


@dataclass(frozen=True)
class Entry:
    """One pending record."""

    job_id: int
    attempt: int | None
    """None for a spool file from before issue 28 (named per job)."""
    path: Path
    mtime: float
    """When it was spooled; for a confirming entry, when it was (last) written."""
    confirming: bool = False
    """Written and read back; kept until slurmctld has forgotten the job
    (:func:`mark_written`)."""

    def age(self, now: float | None = None) -> float:
        """Seconds since it was spooled (a confirming one: since it was written)."""
        return max(0.0, (time.time() if now is None else now) - self.mtime)

    @property
    def err_path(self) -> Path:
        return self.path.with_name(self.path.name + ERR_SUFFIX)

    def due(self, now: float | None = None, every: float | None = None) -> bool:
        """Worth a writer's look: a pending entry always; a confirming one when its
        last look (its note's mtime, else when it was written) is ``every``
        (:data:`CONFIRM_EVERY_S`) ago. Keeps prologs from starting a writer, and a
        writer from asking sacct, for confirming entries looked at moments ago."""
        if not self.confirming:
            return True
        try:
            last = os.stat(self.err_path, follow_symlinks=False).st_mtime
        except OSError:
            last = self.mtime
        t = time.time() if now is None else now
        return t - max(last, self.mtime) >= (CONFIRM_EVERY_S if every is None else every)

    def last_error(self) -> str:
        """Why the replayer has not removed it yet ("" when it has not tried)."""
        try:
            return read_text(self.err_path, MAX_ERR_BYTES)
        except OSError:
            return ""


def write_entry(spool_dir: Path, job_id: int, attempt: int, text: str) -> Path:
    """Spool ``text`` durably (fsync'd file and directory, atomic rename); OSError
    (ENOSPC...) when it could not be: then nothing half-written is left behind."""
    path = entry_path(spool_dir, job_id, attempt)
    _write_atomic(path, text.encode("utf-8", "replace"), durable=True)
    return path


def _write_atomic(path: Path, data: bytes, *, durable: bool) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def note_error(entry: Entry, why: str) -> None:
    """Remember why ``entry`` is still pending (best effort: a full disk says nothing)."""
    with contextlib.suppress(OSError):
        _write_atomic(entry.err_path, why[:MAX_ERR_BYTES].encode("utf-8", "replace"),
                      durable=False)


def remove(entry: Entry) -> None:
    """Forget ``entry`` (accounting holds it and slurmctld has forgotten the job)."""
    for p in (entry.path, entry.err_path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def mark_written(entry: Entry, now: float | None = None) -> Entry | None:
    """Keep ``entry``, written and read back, as ``<name>.confirming`` (its mtime the
    time written) until slurmctld forgets the job; the confirming entry, or None
    when it is gone (another replayer) or could not be renamed (then it is removed:
    the behaviour before confirming entries). A pending entry of the same attempt
    that is confirming already replaces it (the newer text)."""
    base = entry_path(entry.path.parent, entry.job_id, entry.attempt)
    dest = base.with_name(base.name + CONFIRM_SUFFIX)
    t = time.time() if now is None else now
    try:
        if entry.path != dest:
            os.replace(entry.path, dest)
        os.utime(dest, (t, t), follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError:
        remove(entry)
        return None
    with contextlib.suppress(FileNotFoundError):
        os.unlink(entry.err_path)
    return Entry(entry.job_id, entry.attempt, dest, t, confirming=True)


def read_text(path: Path, limit: int = MAX_RECORD_BYTES) -> str:
    """A spool file's text: a regular file of the writer's own user (root), never
    through a link, bounded.

    The owner check: a spool under a directory others can write (a site's
    ``evidence_dir`` in /tmp, say) must not let a user plant ``<job>.0.adminc`` and
    have root write it into another user's job record (review of issue 28).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file")
        if st.st_uid != os.geteuid():
            raise OSError(f"{path}: owned by uid {st.st_uid}, not written by colloc")
        data = os.read(fd, limit)
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").strip()


def entries(spool_dir: Path, limit: int | None = None) -> list[Entry]:
    """Spooled records, pending and confirming, the oldest first (at most ``limit``)."""
    found: list[Entry] = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(spool_dir) as it:
        for n, item in enumerate(it):
            if n >= MAX_SCAN:
                break
            m = _NAME.fullmatch(item.name)
            if m is None:
                continue
            try:
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue
            attempt = int(m.group(2)) if m.group(2) is not None else None
            found.append(Entry(int(m.group(1)), attempt, Path(item.path), st.st_mtime,
                               confirming=m.group(3) == CONFIRM_SUFFIX))
    found.sort(key=lambda e: (e.mtime, e.job_id, -1 if e.attempt is None else e.attempt))
    return found if limit is None else found[:limit]


def holds_work(spool_dir: Path, now: float | None = None) -> bool:
    """Whether the spool holds a record younger than :data:`STAY_FOR_S`: the node's
    collector stays up to replay it (issue 28: slurmdbd away past the collector's idle
    exit left records no one replayed)."""
    t = time.time() if now is None else now
    return any(e.age(t) <= STAY_FOR_S for e in entries(spool_dir))


# ------------------------------------------------------------------ the lock ---


def try_lock(spool_dir: Path) -> int | None:
    """The writer's lock in ``spool_dir`` (:func:`slurm_colloc.root_lock.try_lock`):
    held (an fd to close), None when another process holds it, OSError when the lock
    file is not root's."""
    return root_lock.try_lock(spool_dir / LOCK_NAME)


Spawner = Callable[..., None]


def kick(spool_dir: Path, env: Mapping[str, str], *, job_id: int = 0,
         spawner: Spawner = spawn_module, extra: Sequence[str] = ()) -> bool:
    """Start the node's writer detached when the spool holds a pending record, or a
    confirming one due a look (:meth:`Entry.due`), and none runs; True when one was
    started. Never blocks: a held lock means a writer is at work. The collector's
    call every :data:`REPLAY_EVERY_S` brings the writer back to re-read confirming
    entries; a burst of prologs starts none for entries looked at moments ago.

    The lock is taken here and handed to the writer (an inherited descriptor), so no
    second one starts while the first starts up. OSError when the lock is not root's.
    """
    pending = next((e for e in entries(spool_dir) if e.due()), None)
    if pending is None:
        return False
    fd = try_lock(spool_dir)
    if fd is None:
        return False
    try:
        first = pending.path
        spawner(WRITER_MODULE, (str(job_id), str(first), str(PASSED_FD), *extra), env,
                pass_fd=fd)
    finally:
        os.close(fd)  # the writer's copy keeps the lock
    return True
