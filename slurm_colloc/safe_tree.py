"""Remove a tree a user could write, as root, without walking into the user's traps.

Why: the legacy MPS pipe directory is handed to the job's user, who may plant
anything there: a tree thousands of levels deep (``shutil.rmtree`` recursed until
RecursionError, inside the prolog, under the GPU lock: the job then ran with no MPS
and no limit), hundreds of thousands of entries (the walk held the GPU lock for
minutes), links to other places, FIFOs, files kept open.

So removal is two steps:

1. :func:`quarantine` (cheap, under the caller's lock): one ``rename`` of the tree
   into a root-only 0700 directory on the same filesystem. The user can no longer
   reach it by any path (a descriptor the user still holds inside it reaches only
   the tree itself, never root's directory above it).
2. :func:`purge` (outside any lock): an iterative walk through directory
   descriptors that never follows a link (``O_NOFOLLOW``, ``unlinkat``), never opens
   anything but directories (a FIFO or device is unlinked, never opened), never
   enters another filesystem, and stops after ``max_entries`` operations or
   ``max_seconds``. Non-empty subdirectories are renamed up into the quarantine
   (flattened) instead of being descended into, so a pass holds two descriptors
   whatever the depth. What a pass leaves stays in the quarantine, unreachable,
   for the next pass (:func:`main`, run detached by :func:`spawn`).

Only one purge runs per quarantine at a time (``flock`` on its descriptor, which
only root can open); a second caller returns at once with ``busy``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from slurm_colloc.detach import spawn_module

QUARANTINE_MODE = 0o700
MAX_ENTRIES = 20_000
"""Operations (unlinks, renames) of one in-line pass: about 0.1-0.3 s of work."""
MAX_SECONDS = 2.0
DETACHED_MAX_ENTRIES = 5_000_000
DETACHED_MAX_SECONDS = 300.0
_BATCH = 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class UnsafeTree(RuntimeError):
    """The quarantine is not a root-only directory: nothing is removed through it."""


@dataclass
class Purge:
    """What one pass did."""

    removed: int = 0
    """Entries unlinked (files, links, FIFOs, sockets, empty directories)."""
    left: bool = False
    """Something is still in the quarantine (over the bounds, or not removable)."""
    busy: bool = False
    """Another purge held the quarantine: this one did nothing."""
    errors: list[str] = field(default_factory=list)
    """What could not be removed, and why (at most a few lines)."""

    def note(self, msg: str) -> None:
        if len(self.errors) < 10:
            self.errors.append(msg)


def _check_private(fd: int, what: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() \
            or stat.S_IMODE(st.st_mode) & 0o077:
        raise UnsafeTree(f"{what}: uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}: "
                         "not a directory only root can reach")
    return st


def private_dir(path: Path) -> Path:
    """``path`` as a root-only 0700 directory (made if missing; a link is refused)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, QUARANTINE_MODE)
    fd = os.open(path, _DIR_FLAGS & ~os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_ISDIR(st.st_mode):
            os.fchmod(fd, QUARANTINE_MODE)  # umask-proof
        _check_private(fd, str(path))
    finally:
        os.close(fd)
    return path


@contextlib.contextmanager
def _open_private(path: Path) -> Iterator[int]:
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as e:
        raise UnsafeTree(f"{path}: {e.strerror}") from e
    try:
        _check_private(fd, str(path))
        yield fd
    finally:
        os.close(fd)


def _fresh_name(tag: str) -> str:
    return f"{tag}.{time.time_ns()}.{secrets.token_hex(6)}"


def quarantine(path: Path, qdir: Path, tag: str) -> str | None:
    """Move ``path`` (whatever it is; never followed) into root's ``qdir``.

    One ``rename``, O(1) whatever the tree holds: safe under a lock. ``path``'s
    parent must be a directory the user cannot write (its entry cannot be swapped).
    Returns the name in ``qdir``, or None when ``path`` does not exist. Raises
    OSError when it cannot be moved (another filesystem: ``EXDEV``; a mount point:
    ``EBUSY``), :class:`UnsafeTree` when ``qdir`` is not root-only.
    """
    private_dir(qdir)
    name = _fresh_name(tag)
    parent = os.open(path.parent, _DIR_FLAGS)
    try:
        with _open_private(qdir) as q:
            try:
                os.rename(path.name, name, src_dir_fd=parent, dst_dir_fd=q)
            except FileNotFoundError:
                return None
    finally:
        os.close(parent)
    return name


RECHECKS = 3
"""Passes one purge makes at most when entries keep arriving after its lock is gone."""


def purge(qdir: Path, *, max_entries: int = MAX_ENTRIES,
          max_seconds: float = MAX_SECONDS) -> Purge:
    """Remove what is in root's quarantine ``qdir``, bounded (see the module doc).

    A caller that finds the lock held returns at once (``busy``) and leaves its entry
    to the holder; so the holder looks again once it has let the lock go, and makes
    another pass for what arrived after its last look (issue 28: a burst left empty
    pipe directories in the quarantine). A caller that renames after that look finds
    the lock free itself.
    """
    result = Purge()
    if not os.path.lexists(qdir):
        return result
    deadline = time.monotonic() + max_seconds
    for _ in range(RECHECKS):
        with _open_private(qdir) as top:
            try:
                fcntl.flock(top, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another purge has it, and will look again
                result.busy = result.left = True
                return result
            budget = max_entries - result.removed
            _Walk(top, os.fstat(top).st_dev, result, budget, deadline).run()
        if result.left or time.monotonic() > deadline or result.removed >= max_entries:
            return result
        with _open_private(qdir) as top:
            if not _names(top, 1):
                return result
    result.left = True
    return result


class _Walk:
    """One bounded pass over the quarantine's top level (flattening as it goes)."""

    def __init__(self, top: int, dev: int, result: Purge, budget: int,
                 deadline: float) -> None:
        self.top, self.dev, self.result = top, dev, result
        self.budget, self.deadline = budget, deadline
        self.stuck: set[str] = set()
        """Top-level names this pass cannot remove (another filesystem, ...)."""

    def spent(self) -> bool:
        return self.budget <= 0 or time.monotonic() > self.deadline

    def run(self) -> None:
        while True:
            names = [n for n in _names(self.top, _BATCH + len(self.stuck))
                     if n not in self.stuck][:_BATCH]
            if not names:
                self.result.left = bool(self.stuck)
                return
            for name in names:
                if self.spent():
                    self.result.left = True
                    return
                self._top_entry(name)

    def _top_entry(self, name: str) -> None:
        """Remove one top-level entry, or empty it one level (moving subdirs up).

        Top-level names are root's alone (the quarantine is 0700): none can be
        swapped under us, so an entry that is neither unlinkable nor a directory we
        may enter is left, and reported.
        """
        if self._unlink(self.top, name):
            return
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.top)
        except FileNotFoundError:
            return
        except OSError as e:
            self._stuck(name, f"cannot open: {e.strerror}")
            return
        try:
            if os.fstat(fd).st_dev != self.dev:
                self._stuck(name, "another filesystem: not entered")
                return
            if not self._empty(fd, name) or self.spent():
                return
        finally:
            os.close(fd)
        try:
            os.rmdir(name, dir_fd=self.top)
            self._count()
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):  # refilled: next round
                self._stuck(name, f"not removed: {e.strerror}")

    def _empty(self, fd: int, where: str) -> bool:
        """Unlink what is in ``fd``; move its non-empty subdirectories to the top.

        Below the top the user may still act (a descriptor held inside the tree): a
        name may change type between two calls, so each step is one ``*at`` call on
        a name, never a path. False when something here cannot be removed.
        """
        while not self.spent():
            seen = ok = 0
            with os.scandir(fd) as it:  # one pass; removing returned names is allowed
                for entry in it:
                    if self.spent():
                        return True
                    seen += 1
                    ok += self._child(fd, where, entry.name)
            if seen == 0:
                return True
            if ok < seen:
                return False
        return True

    def _child(self, fd: int, where: str, child: str) -> bool:
        if self._unlink(fd, child):
            return True
        try:
            os.rmdir(child, dir_fd=fd)
            self._count()
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                self._stuck_below(where, child, e)
                return False
        try:  # flatten: the subtree becomes a top-level entry of its own
            os.rename(child, _fresh_name("sub"), src_dir_fd=fd, dst_dir_fd=self.top)
            self._count()
            return True
        except FileNotFoundError:
            return True
        except OSError as e:  # a mount point (EBUSY): left where it is, never entered
            self._stuck_below(where, child, e)
            return False

    def _unlink(self, fd: int, name: str) -> bool:
        """True when ``name`` is gone; False for a directory (or what will not go).

        ``unlinkat`` never follows a link and never opens what it removes (a FIFO or
        a device is just a name here).
        """
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # EISDIR (a directory), EBUSY (a mount point), ...
        self._count()
        return True

    def _count(self) -> None:
        self.result.removed += 1
        self.budget -= 1

    def _stuck(self, name: str, why: str) -> None:
        self.stuck.add(name)
        self.result.note(f"{name}: {why}")

    def _stuck_below(self, where: str, child: str, e: OSError) -> None:
        self.stuck.add(where)
        self.result.note(f"{where}/{child}: {e.strerror}")


def _names(fd: int, limit: int) -> list[str]:
    """Up to ``limit`` names in the directory ``fd``, read from its start.

    ``os.scandir`` works on its own duplicate of ``fd`` and rewinds it when done.
    """
    out: list[str] = []
    with os.scandir(fd) as it:
        for entry in it:
            out.append(entry.name)
            if len(out) >= limit:
                break
    return out


def spawn(qdir: Path, env: Mapping[str, str] | None = None) -> None:
    """Finish the quarantine detached (``python -I -m slurm_colloc.safe_tree QDIR``).

    Started only by a pass that held the lock and left work: one purger at a time,
    never one per job (the lock makes a second one return at once).
    """
    spawn_module("slurm_colloc.safe_tree", (str(qdir),),
                 env if env is not None else {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of the detached purger: one long, still bounded, pass."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.stderr.write("usage: python -m slurm_colloc.safe_tree QUARANTINE_DIR\n")
        return 2
    try:
        purge(Path(args[0]), max_entries=DETACHED_MAX_ENTRIES,
              max_seconds=DETACHED_MAX_SECONDS)
    except (OSError, UnsafeTree):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
