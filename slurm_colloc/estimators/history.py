"""History hook: measured peaks of the same model beat any estimate from its summary.

The epilog (root) calls :meth:`SqliteHistory.record` after a successful job, through
``slurm_colloc.metrics.summary.record_history``; ``colloc estimate`` (run as the
submitting user by the cli_filter) calls :meth:`~SqliteHistory.peaks` before
estimating, and :mod:`slurm_colloc.estimators.history_scaling` turns peaks at other batch sizes into
this one's. Keys are the owner's uid, the summary fingerprint and the job parameters
that change memory. The store keeps the largest peak seen (a job that once needed more
may need it again).

Trust policy (security issue 11, H3 "history poisoning")
--------------------------------------------------------

The fingerprint a job is filed under is **user-controlled**: it reaches the epilog
through the job's record, which the submitting user writes (the cli_filter runs a
program the user may choose with ``COLLOC_ESTIMATOR_COMMAND``, and ``job_submit``
accepts any hex ``fp``). Keyed by fingerprint alone, one user's job could lower
another user's estimate (a 700 MiB job cut a bert-base estimate from 12,266 MiB to
735 MiB: their jobs OOM on a shared GPU) or raise it (a fake huge peak puts them on
whole GPUs for good). Therefore:

* **History is per user.** Every row carries the uid of the job's owner, which
  ``record_history`` takes from the root-side context (the prolog's ``JobMeta.uid``,
  from slurmd's ``SLURM_JOB_UID``), never from user text.
* **Only the user's own history is used.** :class:`SqliteHistory` reads the rows of
  one uid (default: the caller's real uid, ``os.getuid()``, which is the submitting
  user under the cli_filter). **Other users' measurements are ignored**, not even
  used to raise an estimate: raising is the denial-of-service half of the attack. A
  user can only mislead their own estimates, which they can set directly anyway
  (``--colloc-mem``), and the MPS memory limit confines the damage to their own job.
* **Provenance** is stored with each peak: uid, the job id and attempt that set the
  peak, the last job, the time, and where the fingerprint came from (``fp_source``);
  :meth:`SqliteHistory.provenance` lists it for an admin.
* **Old databases** (schema 1: table ``peaks`` without a uid) hold rows of unknown
  owner that anyone could have poisoned: they are left in the file untouched and
  never read; new rows go to table ``peaks_v2``.
* **Readers never hold the writer's file.** Root writes a private database
  (``<history_db>.rw``, 0600) and after each write publishes snapshots (atomic
  rename). Before, any user could hold a read lock on the one shared file
  (``BEGIN; SELECT ...`` left open, or a POSIX lock on sqlite's lock bytes) and make
  every epilog's write fail with "database is locked" (issue 11 review). A snapshot a
  reader keeps open is simply an old inode.
* **Each user reads only their own rows** (issue 23). The full snapshot at
  ``history_db`` is root's (0600): it listed every user's uid, fingerprints, batch
  sizes and job ids to anyone. Each user gets ``<history_db>.users/<uid>.sqlite``
  with their rows only, ``root:root 0600`` plus one ACL entry ``user:<uid>:r``
  (:mod:`slurm_colloc.owner_read`): no other user, nor the user's group, reads it,
  and the user cannot grow it on root's disk. The directory is ``0711`` (who has
  history is not listed). On a file system without ACLs the user's snapshot stays
  root-only: that user's ``colloc estimate`` then runs without history. A reader
  that is not root reads its own snapshot; root reads the full one.
* **File trust.** The database is written by root and read by users at sbatch time.
  A reader uses it only when the file and its directory are owned by root or the
  reader and are writable by nobody else (group/other write bits clear), and opens it
  read-only; anything else is treated as no history. The writer refuses
  (:class:`HistoryUnsafe`) a symlink, or a file or directory others could write, and
  creates the file ``0600``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from slurm_colloc.estimators.history_scaling import HISTORY_MARGIN

__all__ = ["HISTORY_MARGIN", "HistoryBounds", "HistoryStore", "HistoryUnsafe", "SqliteHistory"]


class HistoryStore(Protocol):
    """Where measured peaks are looked up (and recorded, by the metrics side).

    A store answers for one user (see the module docstring's trust policy)."""

    def lookup(self, fingerprint: str, batch_size: int, seq_len: int | None, optimizer: str,
               precision: str) -> int | None:
        """Measured peak MiB of an earlier run with the same key, or None."""
        ...

    def peaks(self, fingerprint: str, seq_len: int | None, optimizer: str,
              precision: str) -> dict[int, int]:
        """Measured peak MiB by batch size for the key without the batch size."""
        ...

    def record(self, fingerprint: str, batch_size: int, seq_len: int | None, optimizer: str,
               precision: str, peak_mib: int, job_id: str | None = None) -> None:
        """Remember a measured peak."""
        ...


@runtime_checkable
class HistoryBounds(Protocol):
    """A store that also knows lower bounds: peaks of incomplete attempts (sampling
    gaps, killed, OOM'd: :mod:`slurm_colloc.accounting.history_runs`). They may raise
    an estimate to the bound plus the history margin, never lower it (issue 27)."""

    def floors(self, fingerprint: str, seq_len: int | None, optimizer: str,
               precision: str) -> dict[int, int]:
        """Largest lower bound (MiB) by batch size for the key without the batch size."""
        ...


class HistoryUnsafe(OSError):
    """The history database (or its directory) is not safe to write as root."""


SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS peaks_v2 (
    uid INTEGER NOT NULL,
    fingerprint TEXT NOT NULL,
    batch_size INTEGER NOT NULL,
    seq_len INTEGER NOT NULL,
    optimizer TEXT NOT NULL,
    precision TEXT NOT NULL,
    peak_mib INTEGER NOT NULL,
    runs INTEGER NOT NULL DEFAULT 1,
    peak_job TEXT,
    peak_attempt INTEGER,
    last_job TEXT,
    last_attempt INTEGER,
    fp_source TEXT,
    updated REAL NOT NULL,
    PRIMARY KEY (uid, fingerprint, batch_size, seq_len, optimizer, precision)
)
"""
_PROVENANCE = ("uid", "fingerprint", "batch_size", "seq_len", "optimizer", "precision",
               "peak_mib", "runs", "peak_job", "peak_attempt", "last_job", "last_attempt",
               "fp_source", "updated")
_WRITE_BITS = stat.S_IWGRP | stat.S_IWOTH


def _safe_owner_and_mode(st: os.stat_result, owners: set[int]) -> bool:
    return st.st_uid in owners and not st.st_mode & _WRITE_BITS


class SqliteHistory:
    """A :class:`HistoryStore` in one sqlite file (``CollocConfig.history_db``), seen
    as user ``uid`` (default: the caller's real uid).

    A missing or untrusted database is an empty history for lookups (login nodes may
    not have it); the file is created on the first :meth:`record`.
    """

    def __init__(self, path: str | Path, uid: int | None = None):
        self.path = Path(path)
        self.uid = os.getuid() if uid is None else int(uid)

    # ------------------------------------------------------------- trust ---

    def _trusted_for_reading(self) -> bool:
        """The file and its directory are root's (or the reader's) and nobody else can
        write them: otherwise another user could have put rows in it."""
        owners = {0, os.geteuid()}
        path = self.read_path()
        try:
            st = os.stat(path)
            dst = os.stat(path.parent)
        except OSError:
            return False
        return (stat.S_ISREG(st.st_mode) and _safe_owner_and_mode(st, owners)
                and _safe_owner_and_mode(dst, owners))

    def _check_writable_safely(self) -> None:
        """Refuse to write (as root) through a symlink or into a file or directory
        others can write."""
        owners = {0, os.geteuid()}
        dst = os.stat(self.path.parent)
        if not _safe_owner_and_mode(dst, owners):
            raise HistoryUnsafe(f"history db directory {self.path.parent} is writable by "
                                "others or not owned by root")
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            os.fchmod(fd, 0o600)  # every user's rows: root's only (issue 23)
            os.close(fd)
            return
        if not stat.S_ISREG(st.st_mode):
            raise HistoryUnsafe(f"history db {self.path} is not a regular file (a symlink?)")
        if not _safe_owner_and_mode(st, owners):
            raise HistoryUnsafe(f"history db {self.path} is writable by others or not owned "
                                "by root")

    # ------------------------------------------------------------ access ---

    def _read(self, sql: str, args: tuple[object, ...]) -> list[tuple[object, ...]]:
        """Rows of a read-only query; [] when the db is absent, untrusted or of
        another version (no ``peaks_v2`` table)."""
        if not self._trusted_for_reading():
            return []
        try:
            con = sqlite3.connect(f"file:{self.read_path()}?mode=ro", uri=True, timeout=2.0)
        except sqlite3.Error:
            return []
        try:
            return con.execute(sql, args).fetchall()
        except sqlite3.Error:
            return []  # no table yet, or a db of another version: no history
        finally:
            con.close()

    def lookup(self, fingerprint: str, batch_size: int, seq_len: int | None, optimizer: str,
               precision: str) -> int | None:
        """Largest measured peak of this user for the key, or None."""
        rows = self._read(
            "SELECT peak_mib FROM peaks_v2 WHERE uid=? AND fingerprint=? AND batch_size=?"
            " AND seq_len=? AND optimizer=? AND precision=?",
            (self.uid, fingerprint.lower(), batch_size, seq_len or 0, optimizer, precision),
        )
        return int(rows[0][0]) if rows else None  # type: ignore[call-overload]

    def peaks(self, fingerprint: str, seq_len: int | None, optimizer: str,
              precision: str) -> dict[int, int]:
        """This user's largest measured peak per batch size ({} when none)."""
        rows = self._read(
            "SELECT batch_size, peak_mib FROM peaks_v2 WHERE uid=? AND fingerprint=?"
            " AND seq_len=? AND optimizer=? AND precision=?",
            (self.uid, fingerprint.lower(), seq_len or 0, optimizer, precision),
        )
        return {int(b): int(p) for b, p in rows}  # type: ignore[call-overload]

    def provenance(self, uid: int, fingerprint: str) -> list[dict[str, object]]:
        """Every stored peak of ``uid`` for ``fingerprint`` with where it came from."""
        rows = self._read(
            "SELECT uid, fingerprint, batch_size, seq_len, optimizer, precision, peak_mib, "
            "runs, peak_job, peak_attempt, last_job, last_attempt, fp_source, updated "
            "FROM peaks_v2 WHERE uid=? AND fingerprint=? ORDER BY batch_size",
            (int(uid), fingerprint.lower()))
        return [dict(zip(_PROVENANCE, r, strict=True)) for r in rows]

    def record(self, fingerprint: str, batch_size: int, seq_len: int | None, optimizer: str,
               precision: str, peak_mib: int, job_id: str | None = None, *,
               uid: int | None = None, attempt: int | None = None,
               fp_source: str | None = None) -> None:
        """Insert or raise the stored peak of ``uid`` (default: this store's uid).

        The epilog passes the job owner's uid from the root-side context. Raises
        :class:`HistoryUnsafe` when the file is not safe to write (module docstring).
        """
        owner = self.uid if uid is None else int(uid)
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        self._check_writable_safely()
        rw = self._private()
        con = sqlite3.connect(f"file:{rw}?mode=rw", uri=True, timeout=2.0)
        try:
            with con:
                con.execute(_SCHEMA)
                con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                con.execute(
                    "INSERT INTO peaks_v2 VALUES (?,?,?,?,?,?,?,1,?,?,?,?,?,?) "
                    "ON CONFLICT DO UPDATE SET "
                    "peak_job=CASE WHEN excluded.peak_mib > peak_mib THEN excluded.peak_job "
                    "ELSE peak_job END, "
                    "peak_attempt=CASE WHEN excluded.peak_mib > peak_mib "
                    "THEN excluded.peak_attempt ELSE peak_attempt END, "
                    "peak_mib=max(peak_mib, excluded.peak_mib), runs=runs+1, "
                    "last_job=excluded.last_job, last_attempt=excluded.last_attempt, "
                    "fp_source=excluded.fp_source, updated=excluded.updated",
                    (owner, fingerprint.lower(), batch_size, seq_len or 0, optimizer, precision,
                     int(peak_mib), job_id, attempt, job_id, attempt, fp_source, time.time()),
                )
            self._publish(con, owner)
        finally:
            con.close()

    def user_snapshot_path(self, uid: int | None = None) -> Path:
        """The snapshot of one user's rows (default: this store's uid)."""
        return self.path.with_name(self.path.name + ".users") / (
            f"{self.uid if uid is None else int(uid)}.sqlite")

    def read_path(self) -> Path:
        """What this reader opens: root the full snapshot, a user their own."""
        return self.path if os.geteuid() == 0 else self.user_snapshot_path()

    @property
    def private_path(self) -> Path:
        """Root's own database; users read the snapshot at :attr:`path`."""
        return self.path.with_name(self.path.name + ".rw")

    def _private(self) -> Path:
        """The writer's file (root 0600), started from the published one if any."""
        rw = self.private_path
        try:
            st = os.lstat(rw)
        except FileNotFoundError:
            fd = os.open(rw, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            os.fchmod(fd, 0o600)
            os.close(fd)
            if os.path.getsize(self.path) if self.path.is_file() else 0:
                src = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=2.0)
                dst = sqlite3.connect(f"file:{rw}?mode=rw", uri=True)
                try:
                    src.backup(dst)  # carry the rows written before the split
                finally:
                    src.close()
                    dst.close()
            return rw
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise HistoryUnsafe(f"history db {rw} is not root's private regular file")
        return rw

    def _publish(self, con: sqlite3.Connection, uid: int) -> None:
        """Atomically replace root's full snapshot (0600) and ``uid``'s own snapshot.

        The first time (no per-user directory yet: a new node, or an older release's
        single public snapshot) every user's snapshot is published.
        """
        tmp = self._new_tmp(self.path.parent, f"{self.path.name}.{os.getpid()}.tmp")
        out = sqlite3.connect(f"file:{tmp}?mode=rw", uri=True)
        try:
            con.backup(out)
        finally:
            out.close()
        os.replace(tmp, self.path)
        users = self.user_snapshot_path(uid).parent
        first = not os.path.lexists(users)
        if first:
            with contextlib.suppress(FileExistsError):
                os.mkdir(users, 0o711)
        ust = os.lstat(users)
        if (not stat.S_ISDIR(ust.st_mode) or ust.st_uid != os.geteuid()
                or ust.st_mode & _WRITE_BITS):
            raise HistoryUnsafe(f"{users} is not root's directory")
        os.chmod(users, 0o711)  # noqa: S103 - traversable, not listable
        uids = ([int(r[0]) for r in con.execute("SELECT DISTINCT uid FROM peaks_v2")]
                if first else [uid])
        for u in uids:
            self._publish_user(con, u)

    def _publish_user(self, con: sqlite3.Connection, uid: int) -> None:
        """``uid``'s rows only, readable by ``uid`` and root (an ACL entry)."""
        from slurm_colloc.owner_read import grant_owner_read

        final = self.user_snapshot_path(uid)
        tmp = self._new_tmp(final.parent, f"{final.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            grant_owner_read(fd, uid)
        finally:
            os.close(fd)
        out = sqlite3.connect(f"file:{tmp}?mode=rw", uri=True)
        try:
            with out:
                out.execute(_SCHEMA)
                out.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                # the same table (_SCHEMA) on both sides: the columns line up
                out.executemany("INSERT INTO peaks_v2 VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                                con.execute("SELECT * FROM peaks_v2 WHERE uid=?", (uid,)))
        finally:
            out.close()
        os.replace(tmp, final)

    @staticmethod
    def _new_tmp(directory: Path, name: str) -> Path:
        """A new root-only file in root's ``directory`` (never through a link)."""
        tmp = directory / name
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        os.fchmod(fd, 0o600)
        os.close(fd)
        return tmp
