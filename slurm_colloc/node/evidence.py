"""Keep a failed attempt's output where the requeued run cannot overwrite it.

A requeued batch job writes its output file again from the start (slurm-facts.md),
so the OOM message of the first attempt would be lost. The epilog copies the tail of
each log into ``evidence_dir/<jobid>/attempt<k>/``.

The rules (issue 11, M1), for code that runs as root on a path the user chose:

* **Opened as the user, by the scan's rules.** Each log is opened with
  :func:`slurm_colloc.oom.safe_open.open_log`: the walk and the open run with the
  user's uid, primary gid and groups; no user-made symlink is followed (``O_NOFOLLOW``
  on the file, root-owned links only on the way); it must be a regular file owned by
  the user *before* it is opened (``O_NONBLOCK``), so a FIFO, ``/dev/zero`` or another
  device is refused without blocking and without reading a byte. The epilog only hands
  over logs the scan could read.
* **Bounded by root.** Root reads at most ``max_bytes`` (the tail) from that
  descriptor, whatever the file's size says or however it grows, and writes the copy
  itself. The user's process never writes into the evidence tree.
* **Private, and not the user's to fill.** The attempt directory and each copy belong
  to root (``root:root``, ``0700``/``0600``), so the user can neither grow, rewrite nor
  keep a copy alive with a hard link (a user-owned copy allowed all three: issue 11
  review). The job's owner reads them through one ACL entry, ``user:<uid>:r``
  (:mod:`slurm_colloc.owner_read`); nobody else does. The user's primary group got
  them before, which leaked the evidence to every user of a shared group (issue 23).
* **Sparse stays sparse.** A run of zeros of a 4 KiB block (a hole in the user's log,
  which costs the user nothing) is skipped in root's copy too, never written as real
  zeros: root's copy uses about as many blocks as the copied range of the user's log
  (issue 23: 64 MiB sparse logs made root write 64 MiB real copies).
* **Owned by the job's owner, in root's own record.** :data:`OWNER_RECORD` in each
  attempt directory (root 0600 JSON, written with the copies) names the job's owner
  from slurmd's ``SLURM_JOB_UID``. The copies are root's, so their owner names nobody;
  the per-user cap used to read it and never applied (issue 23).
* **Pruned.** Each :func:`keep` deletes evidence older than :data:`RETENTION_S` and
  then the user's oldest attempts beyond :data:`MAX_BYTES_PER_USER` (the bytes the
  copies really use). Pruning never follows a symlink (``lstat`` only;
  ``shutil.rmtree`` is fd-based on Linux), so the user-owned attempt directories of
  older releases are safe to clean too (they are counted by their owner). An attempt
  an older release gave to the owner's primary group is made root-only on the way.

``config.py`` has no evidence retention keys yet; the two limits are module constants.

**The user's copy (issue 13).** ``evidence_dir`` is on the compute node; the user reads
the report on the login host. With ``evidence_user_copy`` (the default) the epilog
also leaves ``colloc-evidence-<jobid>-<attempt>.txt`` next to the job's output file
(:func:`keep_user_copy`): a short header (job, attempt, node, cause, pattern, matched
line, time) and the end of root's copies, at most :data:`USER_COPY_MAX_BYTES`. Root
builds the text from its own copies, or, when it kept none (its evidence file system
full: issue 28), from the end of the logs the scan read, opened as the user by the
scan's rules: the user's copy never depends on root's, nor root's on the user's. The
file is created by a child process that has become the user for good
(:mod:`slurm_colloc.node.as_user`): the directory is opened with
``O_DIRECTORY | O_NOFOLLOW``, the file with ``O_CREAT | O_EXCL | O_NOFOLLOW``,
mode 0600, so nothing there is followed or overwritten (an existing name gets a
``-N`` suffix, up to :data:`USER_COPY_MAX_SUFFIX`). The directory comes from the
controller's structured record (``StdOut``, else ``StdErr``, ``%`` patterns expanded)
and only for a log the scan itself read. The write has a deadline
(:data:`USER_COPY_TIMEOUT_S`, for a hung NFS server); any failure is reported and
root's copy remains the record's evidence.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slurm_colloc.mps.tenancy import ensure_root_dir
from slurm_colloc.node.as_user import AsUserError, credentials, run_as_user
from slurm_colloc.oom.safe_open import RefusedPath, open_log
from slurm_colloc.owner_read import grant_owner_read, make_private

RETENTION_S = 14 * 86400
"""Evidence older than this (by the attempt directory's mtime) is deleted."""
MAX_BYTES_PER_USER = 1 << 30
"""Total evidence one user may hold on a node; their oldest attempts go first."""
MAX_ENTRIES_PER_ATTEMPT = 256
"""Pruning looks at this many entries of an attempt directory (old layouts were the
user's to fill)."""
USER_COPY_MAX_BYTES = 256 << 10
"""The user's copy is at most this long (header included)."""
USER_COPY_TIMEOUT_S = 10.0
"""How long the epilog waits for the user's copy to be written (then kills the writer)."""
USER_COPY_MAX_SUFFIX = 9
"""``-1`` .. ``-N`` are tried when the user's copy's name is taken."""
USER_COPY_MAX_PATH = 512
"""A longer user path is not put in the accounting record (root's copy is)."""
OWNER_RECORD = "colloc-owner.json"
"""Root's record of an attempt's owner (``{"uid": N, "job": J, "attempt": K}``)."""
_OWNER_RECORD_MAX = 4096
_CHUNK = 1 << 20
_BLOCK = 4096
"""Holes are kept at this granularity (a file system block)."""
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def attempt_dir(evidence_dir: str, job_id: int, attempt: int) -> Path:
    """Where attempt ``attempt`` (0-based, = Restarts) of a job keeps its logs."""
    return Path(evidence_dir) / str(job_id) / f"attempt{attempt}"


def _target_name(index: int, src: str) -> str:
    name = _SAFE_NAME.sub("_", Path(src).name)[:100] or "log"
    return f"{index}-{name}"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _write_sparse(fd: int, data: bytes, offset: int) -> int:
    """Write ``data`` at ``offset`` of ``fd``, leaving blocks of zeros as holes; the
    real bytes written.

    Pieces are cut at multiples of :data:`_BLOCK` of the output offset, so a piece of
    zeros is a whole output block that is simply never allocated.
    """
    written, pos, end = 0, 0, len(data)
    run_start = -1
    while pos < end:
        nxt = min(end, (offset + pos) // _BLOCK * _BLOCK + _BLOCK - offset)
        zero = data.count(0, pos, nxt) == nxt - pos
        if not zero and run_start < 0:
            run_start = pos
        if zero and run_start >= 0:
            written += _pwrite_all(fd, data[run_start:pos], offset + run_start)
            run_start = -1
        pos = nxt
    if run_start >= 0:
        written += _pwrite_all(fd, data[run_start:end], offset + run_start)
    return written


def _pwrite_all(fd: int, data: bytes, offset: int) -> int:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
    return len(data)


def copy_tail_fd(src_fd: int, out_fd: int, max_bytes: int, *, size: int | None = None) -> int:
    """Copy the last ``max_bytes`` of ``src_fd`` to ``out_fd``; return the bytes copied.

    ``size`` is the source's size (``fstat`` when None). At most ``max_bytes`` are read,
    even when the file is longer than its size said (it grows, or a /proc-style file).
    Zeros filling an output block are left as a hole (:func:`_write_sparse`): the
    copy's content is the same, its disk use no more than the source's real data.
    ``out_fd`` is written from its current offset on and left at the end of the copy.
    """
    if size is None:
        size = os.fstat(src_fd).st_size
    start = max(0, size - max_bytes)
    if start:
        _write_all(out_fd, f"[colloc: first {start} bytes omitted]\n".encode())
    out = os.lseek(out_fd, 0, os.SEEK_CUR)
    pos, left = start, max(0, max_bytes)
    while left > 0:
        chunk = os.pread(src_fd, min(_CHUNK, left), pos)
        if not chunk:
            break
        _write_sparse(out_fd, chunk, out + pos - start)
        pos += len(chunk)
        left -= len(chunk)
    end = out + pos - start
    if os.fstat(out_fd).st_size < end:
        os.ftruncate(out_fd, end)  # a trailing hole still counts in the size
    os.lseek(out_fd, end, os.SEEK_SET)
    return pos - start


def _copy_one(src: str, target: Path, uid: int, gid: int, max_bytes: int) -> bool:
    """Copy one log (opened as the user) into root's ``target``; True when the owner
    can read the copy (False: root-only, no ACLs on this file system)."""
    fd = open_log(src, uid=uid, gid=gid)  # as the user; regular file of theirs only
    try:
        out = os.open(
            target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            # root's, readable by the job's owner only: the user can neither grow it
            # on root's file system, nor rewrite it, nor keep it alive by a hard link,
            # and no other member of their group reads it
            granted = grant_owner_read(out, uid)
            copy_tail_fd(fd, out, max_bytes)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return granted


def _write_owner_record(dest: Path, job_id: int, attempt: int, uid: int) -> None:
    """Root's record of whose attempt this is (the per-user cap counts by it)."""
    fd = os.open(dest / OWNER_RECORD,
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        _write_all(fd, json.dumps({"uid": uid, "job": job_id, "attempt": attempt}).encode())
    finally:
        os.close(fd)


def keep(
    evidence_dir: str, job_id: int, attempt: int, uid: int, gid: int,
    sources: list[str], max_bytes: int, *, errors: list[str] | None = None,
) -> list[str]:
    """Copy the tail of each source log into the attempt directory; prune old evidence.

    Returns the paths written. A source that is refused or unreadable is skipped and
    its reason appended to ``errors`` (when given). Raises OSError if the attempt
    directory cannot be made; the epilog logs that and carries on (the requeue does
    not depend on evidence).
    """
    job_dir = ensure_root_dir(Path(evidence_dir) / str(job_id))
    dest = job_dir / f"attempt{attempt}"
    if dest.exists() or dest.is_symlink():
        raise FileExistsError(f"{dest} already exists; not overwriting earlier evidence")
    os.mkdir(dest, 0o700)
    dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        # root's; the job's owner may list and read it, nobody else; only root writes
        granted = grant_owner_read(dfd, uid)
    finally:
        os.close(dfd)
    _write_owner_record(dest, job_id, attempt, uid)
    written = []
    for i, src in enumerate(dict.fromkeys(sources)):
        target = dest / _target_name(i, src)
        try:
            granted = _copy_one(src, target, uid, gid, max_bytes) and granted
        except (RefusedPath, OSError) as e:
            with contextlib.suppress(OSError):
                os.unlink(target)
            if errors is not None:
                errors.append(f"{src}: not kept: {e}")
            continue
        written.append(str(target))
    if not written:
        _remove(dest, keep_job_dir=True)
    elif not granted and errors is not None:
        errors.append(f"{dest}: no ACLs on this file system: root's copy is root-only")
    try:
        prune(evidence_dir, uid=uid, keep=dest)
    except OSError as e:
        if errors is not None:
            errors.append(f"evidence not pruned: {e}")
    return written


def user_copy_name(job_id: int, attempt: int, n: int = 0) -> str:
    """``colloc-evidence-<jobid>-<attempt>.txt``, ``-<n>`` before the suffix when taken."""
    return f"colloc-evidence-{job_id}-{attempt}" + (f"-{n}" if n else "") + ".txt"


def _tail_of_root_copy(path: str, max_bytes: int) -> tuple[bytes, int]:
    """The last ``max_bytes`` of one of root's own copies, and its size."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file")
        start = max(0, st.st_size - max_bytes)
        return os.pread(fd, max(0, min(max_bytes, st.st_size)), start), st.st_size
    finally:
        os.close(fd)


def _tail_of_user_log(path: str, max_bytes: int, *, uid: int, gid: int) -> tuple[bytes, int]:
    """The last ``max_bytes`` of the job's own log, opened as the user by the scan's
    rules (:func:`~slurm_colloc.oom.safe_open.open_log`), and its size."""
    fd = open_log(path, uid=uid, gid=gid)
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - max_bytes)
        return os.pread(fd, max(0, min(max_bytes, size)), start), size
    finally:
        os.close(fd)


def user_copy_text(
    *, job_id: int, attempt: int, node: str, cause: str, pattern: str | None,
    line: str | None, root_files: list[str], max_bytes: int = USER_COPY_MAX_BYTES,
    now: float | None = None, user_logs: tuple[list[str], int, int] | None = None,
) -> bytes:
    """What the user's copy says: a header, then the end of each of root's copies.

    At most ``max_bytes`` in all; each copy gets an equal share of what the header
    leaves. ``line`` is the scan's matched line (already made printable).

    Without root's copies (its evidence file system full or failing: issue 28), the
    end of each of ``user_logs`` = (paths, uid, gid) is read instead, opened as the
    user by the scan's rules: the user's copy never depends on root's.
    """
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if now is None else now))
    head = [
        "colloc: evidence of a failed attempt (the requeued run rewrites the job's output)",
        f"job: {job_id}  attempt: {attempt}  node: {node or '?'}  written: {when}",
        f"cause: {cause}  pattern: {pattern or '-'}",
    ]
    if line:
        head.append(f"matched line: {line}")
    if root_files:
        head.append(f"root's copy on {node or 'the node'}: {Path(root_files[0]).parent}")
    elif user_logs is not None:
        head.append(f"root's copy on {node or 'the node'}: not kept (see the epilog's log)")
    out = ("\n".join(head) + "\n").encode("utf-8", "replace")[:max_bytes]
    files = root_files[:MAX_ENTRIES_PER_ATTEMPT]
    tail: Callable[[str, int], tuple[bytes, int]] = _tail_of_root_copy
    if not files and user_logs is not None:
        paths, uid, gid = user_logs
        files = paths[:MAX_ENTRIES_PER_ATTEMPT]
        tail = functools.partial(_tail_of_user_log, uid=uid, gid=gid)
    for i, path in enumerate(files):
        share = (max_bytes - len(out)) // (len(files) - i)
        title = f"\n--- {Path(path).name} ---\n".encode("utf-8", "replace")
        if share <= len(title) + 64:
            break
        try:
            data, size = tail(path, share - len(title) - 64)
        except (OSError, RefusedPath) as e:
            part = title + f"[colloc: not readable: {e}]\n".encode("utf-8", "replace")
        else:
            cut = f"[colloc: last {len(data)} of {size} bytes]\n" if len(data) < size else ""
            part = title + cut.encode() + data
        out += part[:share]
    return out[:max_bytes]


def _create_exclusive(directory: str, job_id: int, attempt: int, data: bytes) -> str:
    """Create the user's copy in ``directory``; return its path. Runs as the user.

    Never follows a symlink at the directory or the file, never overwrites: a taken
    name (file, link, anything) moves on to the next suffix.
    """
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for n in range(USER_COPY_MAX_SUFFIX + 1):
            name = user_copy_name(job_id, attempt, n)
            try:
                fd = os.open(
                    name,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY
                    | os.O_CLOEXEC, 0o600, dir_fd=dfd,
                )
            except FileExistsError:
                continue
            try:
                os.fchmod(fd, 0o600)
                _write_all(fd, data)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dfd)
                raise
            os.close(fd)
            return os.path.join(directory, name)
        raise FileExistsError(
            f"{directory}: {user_copy_name(job_id, attempt)} and its "
            f"{USER_COPY_MAX_SUFFIX} suffixes are taken"
        )
    finally:
        os.close(dfd)


def write_user_copy(
    directory: str, job_id: int, attempt: int, data: bytes, uid: int, gid: int,
    *, timeout_s: float = USER_COPY_TIMEOUT_S,
) -> str:
    """Create the user's copy as the user (uid, primary gid, their groups); its path.

    Raises :class:`~slurm_colloc.node.as_user.AsUserError` (timeout included) on any
    failure; the message says why.
    """
    if not directory.startswith("/"):
        raise AsUserError(f"{directory!r}: not an absolute directory")
    data = data[:USER_COPY_MAX_BYTES]
    return run_as_user(
        credentials(uid, gid), lambda: _create_exclusive(directory, job_id, attempt, data),
        timeout_s=timeout_s,
    )


def keep_user_copy(
    log_path: str, job_id: int, attempt: int, uid: int, gid: int, *, node: str,
    cause: str, pattern: str | None, line: str | None, root_files: list[str],
    errors: list[str] | None = None, timeout_s: float = USER_COPY_TIMEOUT_S,
    sources: list[str] | None = None,
) -> str | None:
    """Leave the user's copy next to ``log_path`` (the job's output file); its path.

    None when it could not be written: the reason is appended to ``errors``; root's
    copies are untouched. Never raises. ``sources``: the logs the scan read, whose
    ends the copy holds when root kept none (``root_files`` empty).
    """
    try:
        data = user_copy_text(
            job_id=job_id, attempt=attempt, node=node, cause=cause, pattern=pattern,
            line=line, root_files=root_files,
            user_logs=(sources or [log_path], uid, gid) if not root_files else None,
        )
        return write_user_copy(
            os.path.dirname(log_path) or "/", job_id, attempt, data, uid, gid,
            timeout_s=timeout_s,
        )
    except Exception as e:  # noqa: BLE001 - the user's copy is a convenience
        if errors is not None:
            errors.append(f"user copy of the evidence next to {log_path} not written: {e}")
        return None


@dataclass(frozen=True)
class _Attempt:
    path: Path
    mtime: float
    uid: int
    size: int


def _recorded_owner(path: Path) -> int | None:
    """The uid in root's :data:`OWNER_RECORD` of an attempt, or None.

    Believed only when it is a regular file of root's (an old, user-owned attempt
    directory could hold a forged one), read bounded, never through a symlink.
    """
    try:
        fd = os.open(path / OWNER_RECORD, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        data = os.read(fd, _OWNER_RECORD_MAX)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        uid = json.loads(data).get("uid")
    except (ValueError, AttributeError):
        return None
    return uid if isinstance(uid, int) and not isinstance(uid, bool) and uid >= 0 else None


def _disk_bytes(st: os.stat_result) -> int:
    """What a file really costs: its size, or its blocks when fewer (sparse)."""
    return min(st.st_size, st.st_blocks * 512)


def _scan_attempt(path: Path) -> _Attempt | None:
    """An attempt directory's owner, age and real size.

    The owner is root's :data:`OWNER_RECORD`; an attempt of an older release has
    none: its user-owned directory or files then name the owner (those layouts were
    the user's). Without either the attempt counts for nobody (uid 0) and goes by age.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    owner = _recorded_owner(path) if st.st_uid == os.geteuid() else st.st_uid
    size = 0
    try:
        with os.scandir(path) as it:
            for n, entry in enumerate(it):
                if n >= MAX_ENTRIES_PER_ATTEMPT:
                    break
                try:
                    est = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(est.st_mode):
                    size += _disk_bytes(est)
                    if owner is None and est.st_uid != 0:
                        owner = est.st_uid
    except OSError:
        pass
    return _Attempt(path, st.st_mtime, owner if owner is not None else 0, size)


def _close_legacy(a: _Attempt) -> None:
    """An attempt of an older release (root's, group = the owner's primary group,
    0750): root-only from now on, or the recorded owner's by the ACL entry. Before
    issue 23 every member of that group could read it."""
    try:
        fd = os.open(a.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_gid == 0:
            return
        owner = _recorded_owner(a.path)
        if owner is None:
            make_private(fd)
        else:
            grant_owner_read(fd, owner)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: Path, *, keep_job_dir: bool = False) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)  # fd-based on Linux: never follows a symlink inside
    if not keep_job_dir:
        with contextlib.suppress(OSError):
            os.rmdir(path.parent)  # the job directory, once empty


def prune(
    evidence_dir: str, *, uid: int, now: float | None = None,
    max_age_s: float = RETENTION_S, max_bytes_per_user: int | None = None,
    keep: Path | None = None,
) -> list[str]:
    """Delete evidence older than ``max_age_s``, then ``uid``'s oldest attempts until
    their total fits ``max_bytes_per_user`` (default :data:`MAX_BYTES_PER_USER`).
    ``keep`` (the attempt just written) is never deleted. Returns the attempt
    directories removed."""
    now = time.time() if now is None else now
    if max_bytes_per_user is None:
        max_bytes_per_user = MAX_BYTES_PER_USER
    root = Path(evidence_dir)
    attempts: list[_Attempt] = []
    try:
        with os.scandir(root) as jobs:
            for job in jobs:
                if not job.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError), os.scandir(job.path) as it:
                    for entry in it:
                        if entry.name.startswith("attempt") and entry.is_dir(
                            follow_symlinks=False
                        ):
                            info = _scan_attempt(Path(entry.path))
                            if info is not None:
                                attempts.append(info)
    except FileNotFoundError:
        return []
    removed: list[str] = []
    kept: list[_Attempt] = []
    for a in attempts:
        if a.path != keep and now - a.mtime > max_age_s:
            _remove(a.path)
            removed.append(str(a.path))
        else:
            _close_legacy(a)
            kept.append(a)
    mine = sorted((a for a in kept if a.uid == uid), key=lambda a: a.mtime)
    total = sum(a.size for a in mine)
    for a in mine:
        if total <= max_bytes_per_user:
            break
        if a.path == keep:
            continue
        _remove(a.path)
        removed.append(str(a.path))
        total -= a.size
    return removed
