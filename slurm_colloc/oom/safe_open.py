"""Open a user's log file from a root process without being tricked.

The epilog runs as root and reads files whose paths the job's user chose
(``#SBATCH -o``). The user controls those directories, so every classic trick is
available to them: make the log a symlink to ``/etc/shadow``, swap a parent directory
for a symlink between our check and our open, make it a FIFO so the epilog blocks
forever, or a device node whose open has side effects. The rule implemented here:

1. The path must be absolute. It is walked one component at a time with ``openat``
   (``O_PATH | O_NOFOLLOW | O_DIRECTORY``), keeping a descriptor to each directory, so
   a rename or swap of a parent after we passed it cannot redirect us.
2. A symlink met on the way is followed only if **root owns the symlink** (a site's
   ``/home -> /mnt/home``); its target is walked under the same rules (40 hops at
   most). A user can create symlinks but not root-owned ones, so no user-made link is
   ever followed. Writable parent directories are then harmless: we never re-resolve a
   name we already passed.
3. The final component is ``lstat``-ed through its directory descriptor and must be a
   regular file *before* it is opened (opening a FIFO blocks; opening a device can act
   on hardware), then opened with ``O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY``,
   ``fstat``-ed, and refused unless it is still the same regular file (device and
   inode equal), closing the swap race between ``lstat`` and ``open``.
4. With ``uid`` given, the file must belong to that user (Slurm creates job logs as
   the job's user), which also defeats a hard link to a root file in the user's
   directory when ``fs.protected_hardlinks`` is off.
5. With ``uid`` given and the process running as root, the whole walk and open run
   with the user's effective uid, primary gid and supplementary groups
   (:func:`as_user`), so the kernel refuses anything the user could not read
   themselves: defence in depth behind 1-4. Without an explicit ``gid`` the primary
   gid comes from the passwd entry (never ``gid = uid``, which may be another group's
   number: issue 11); a uid without a passwd entry is refused.

Errors are reported as :class:`RefusedPath` (a rule said no) or :class:`OSError`
(the file system said no); the caller turns both into a result, never a crash.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from collections.abc import Iterator

MAX_SYMLINK_HOPS = 40


class RefusedPath(Exception):
    """The path breaks one of the rules above; the message says which."""


class PrivilegeRestoreError(RuntimeError):
    """Root credentials could not be restored after acting as the user.

    Never caught by colloc: a process stuck half-way between root and a user must stop.
    """


@contextlib.contextmanager
def as_user(uid: int, gid: int) -> Iterator[None]:
    """Run the body with the effective uid/gid/groups of a user; restore root after.

    ``gid`` is the user's primary gid (:func:`primary_gid`); the supplementary groups
    are the user's own (``os.getgrouplist``), or just ``gid`` for a uid without a
    passwd entry. Only for single-threaded callers (the epilog): ``os.seteuid``
    changes the credentials of the whole process. A no-op unless we are root and
    ``uid`` is not 0.
    """
    if os.geteuid() != 0 or uid == 0:
        yield
        return
    saved_groups = os.getgroups()
    try:
        name = pwd.getpwuid(uid).pw_name
        groups = os.getgrouplist(name, gid)
    except KeyError:
        groups = [gid]
    os.setgroups(groups)
    try:
        os.setegid(gid)
        try:
            os.seteuid(uid)
            try:
                yield
            finally:
                try:
                    os.seteuid(0)
                except OSError as e:  # pragma: no cover - kernel refused to give root back
                    raise PrivilegeRestoreError(f"cannot restore euid 0: {e}") from e
        finally:
            os.setegid(0)
    finally:
        os.setgroups(saved_groups)


def primary_gid(uid: int) -> int:
    """The user's primary gid from passwd; :class:`RefusedPath` for an unknown uid."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        pw = None
    if pw is None:
        raise RefusedPath(f"uid {uid} has no passwd entry: its groups are unknown")
    return int(pw.pw_gid)


def _walk_dir(path: str, hops: list[int]) -> int:
    """Open directory ``path`` (absolute) by the rules; return an ``O_PATH`` fd."""
    if not path.startswith("/"):
        raise RefusedPath(f"{path!r}: not an absolute path")
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    for name in [c for c in path.split("/") if c not in ("", ".")]:
        fd = _step(fd, name, hops)  # consumes fd, also when it raises
    return fd


def _step(dir_fd: int, name: str, hops: list[int]) -> int:
    """One component: return an fd of ``name`` inside ``dir_fd``.

    Always closes ``dir_fd``, whether it returns or raises.
    """
    try:
        if name == "..":
            # O_NOFOLLOW does not apply to "..", and ".." of a directory we already hold
            # is not user-redirectable; allow it.
            return os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid != 0:
                raise RefusedPath(f"symlink {name!r} is owned by uid {st.st_uid}, not root")
            hops[0] += 1
            if hops[0] > MAX_SYMLINK_HOPS:
                raise RefusedPath("too many symlinks")
            target = os.readlink(name, dir_fd=dir_fd)
            if target.startswith("/"):
                return _walk_dir(target, hops)
            base = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
            for comp in [c for c in target.split("/") if c not in ("", ".")]:
                base = _step(base, comp, hops)  # consumes base, also when it raises
            return base
        if not stat.S_ISDIR(st.st_mode):
            raise RefusedPath(f"{name!r} is not a directory")
        return os.open(
            name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    finally:
        os.close(dir_fd)


def _open_checked(path: str, uid: int | None) -> int:
    head, _, name = path.rstrip("/").rpartition("/")
    if not path.startswith("/") or not name or name in (".", ".."):
        raise RefusedPath(f"{path!r}: not an absolute path to a file")
    dir_fd = _walk_dir(head or "/", [0])
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise RefusedPath(f"{path}: is a symlink")
        if not stat.S_ISREG(st.st_mode):
            raise RefusedPath(f"{path}: not a regular file (mode {stat.filemode(st.st_mode)})")
        if uid is not None and st.st_uid != uid:
            raise RefusedPath(f"{path}: owned by uid {st.st_uid}, not the job's uid {uid}")
        fd = os.open(
            name,
            os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
            dir_fd=dir_fd,
        )
    finally:
        os.close(dir_fd)
    fst = os.fstat(fd)
    if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise RefusedPath(f"{path}: changed while being opened")
    return fd


def open_log(path: str, *, uid: int | None = None, gid: int | None = None) -> int:
    """Open a job log for reading by the rules in the module docstring; return the fd.

    ``uid``/``gid``: the job's user. When given, the file must belong to ``uid`` and,
    if we are root, the open happens with the user's credentials (``gid`` defaults to
    the user's primary gid from passwd, and their supplementary groups apply).
    """
    if uid is not None:
        if gid is None and os.geteuid() == 0 and uid != 0:
            gid = primary_gid(uid)
        with as_user(uid, gid if gid is not None else os.getegid()):
            return _open_checked(path, uid)
    return _open_checked(path, None)


def open_as_user(path: str, uid: int, gid: int) -> int:
    """:func:`open_log` with the job's user (the form the epilog should use)."""
    return open_log(path, uid=uid, gid=gid)
