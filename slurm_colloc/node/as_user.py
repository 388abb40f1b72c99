"""Run one small action as the job's user, in a child process that cannot get root back.

Root must never write into a directory the user can write (docs/security.md): the
user could plant a symlink or a hard link there, or fill it on root's behalf. When
the epilog has to leave a file in such a place (issue 13: a user-readable copy of the
OOM evidence next to the job's output file), the write happens in a forked child that
first becomes the user, completely and for good:

1. ``os.setgroups`` (the user's supplementary groups, computed by the parent: no NSS
   lookup after ``fork``), then ``os.setresgid`` (real, effective and saved gid), then
   ``os.setresuid`` (real, effective and saved uid). The order matters: once the uid is
   no longer 0 the process may change neither its groups nor its gids.
2. It checks the result: all three uids and gids are the user's, the groups are the
   ones asked for, and ``setresuid(0, 0, 0)`` is refused. Otherwise the action is not
   run.
3. The child makes itself non-dumpable (``PR_SET_DUMPABLE`` 0, checked; the kernel's
   own reset on a credential change follows ``fs.suid_dumpable``, which a site may
   have set to 1), so the user can neither ptrace it nor read its memory (a copy of
   the epilog's) through ``/proc``, although it now runs with their uid.

The parent waits for the child's one-line answer with a deadline (a hung NFS server
must not hang the epilog), then kills it (``SIGKILL``) and reaps it when it can. A
child stuck in the kernel (uninterruptible NFS wait) is left behind rather than
waited for; the epilog's exit hands it to init. Nothing here raises anything but
:class:`AsUserError`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

_PR_SET_DUMPABLE = 4
_PR_GET_DUMPABLE = 3
MAX_ANSWER_BYTES = 4096
"""The child's answer (a path or an error message) is cut to this."""
REAP_GRACE_S = 1.0
"""How long the parent waits for a killed child to be reaped."""


class AsUserError(Exception):
    """The action did not run, failed in the child, or did not finish in time."""


class AsUserTimeout(AsUserError):
    """The child did not answer before the deadline and was killed."""


@dataclass(frozen=True)
class Credentials:
    """Who the child becomes."""

    uid: int
    gid: int
    groups: tuple[int, ...]


def credentials(uid: int, gid: int) -> Credentials:
    """The user's credentials: ``gid`` (their primary gid) and their groups from NSS.

    A uid without a passwd entry gets no supplementary groups (not root's).
    """
    try:
        name = pwd.getpwuid(uid).pw_name
        groups = tuple(os.getgrouplist(name, gid))
    except (KeyError, OSError):
        groups = ()
    return Credentials(uid, gid, groups)


def drop_privileges(creds: Credentials) -> None:
    """Become ``creds`` for good (groups, then gids, then uids); verify it.

    Raises :class:`AsUserError` when the credentials are not exactly the user's
    afterwards or root could be regained. Not root: allowed only as oneself (tests).
    """
    if os.geteuid() != 0:
        if (creds.uid, creds.gid) != (os.getuid(), os.getgid()):
            raise AsUserError(f"not root: cannot become uid {creds.uid}/gid {creds.gid}")
        return
    os.setgroups(list(creds.groups))
    os.setresgid(creds.gid, creds.gid, creds.gid)
    os.setresuid(creds.uid, creds.uid, creds.uid)
    if os.getresuid() != (creds.uid,) * 3 or os.getresgid() != (creds.gid,) * 3:
        raise AsUserError(f"credentials not dropped: uids {os.getresuid()}, "
                          f"gids {os.getresgid()}")
    if sorted(set(os.getgroups())) != sorted(set(creds.groups)):
        raise AsUserError(f"groups not dropped: {os.getgroups()}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    if libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise AsUserError("the child is still dumpable: not acting as the user")
    if creds.uid != 0:
        try:
            os.setresuid(0, 0, 0)
        except PermissionError:
            return
        raise AsUserError("root could be regained after dropping privileges")


def _child(creds: Credentials, action: Callable[[], str], w: int) -> int:
    """In the child: drop, act, answer on ``w``; return the exit status."""
    try:
        drop_privileges(creds)
        answer, code = b"ok\n" + action().encode("utf-8", "replace"), 0
    except BaseException as e:  # noqa: BLE001 - everything becomes the answer
        answer, code = f"error\n{type(e).__name__}: {e}".encode("utf-8", "replace"), 1
    os.write(w, answer[:MAX_ANSWER_BYTES])  # below PIPE_BUF: one write, never blocks
    return code


def _reap(pid: int, deadline: float) -> bool:
    """Reap ``pid`` before ``deadline``; True when it is gone."""
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True  # already reaped (SIGCHLD ignored)
        if done:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _reap(pid, time.monotonic() + REAP_GRACE_S)


def run_as_user(creds: Credentials, action: Callable[[], str], *, timeout_s: float) -> str:
    """Run ``action`` in a forked child as ``creds``; return the string it returned.

    ``action`` runs after :func:`drop_privileges`; it should only make system calls
    (the child leaves with ``os._exit``: no ``atexit``, no buffered output flushed).
    Raises :class:`AsUserTimeout` when the child has not answered within
    ``timeout_s`` (it is killed), :class:`AsUserError` for anything else.
    """
    try:
        r, w = os.pipe2(os.O_CLOEXEC)
    except OSError as e:
        raise AsUserError(f"pipe: {e}") from e
    try:
        pid = os.fork()
    except OSError as e:
        os.close(r)
        os.close(w)
        raise AsUserError(f"fork: {e}") from e
    if pid == 0:  # pragma: no cover - the child; coverage does not follow os._exit
        code = 1
        try:
            os.close(r)
            code = _child(creds, action, w)
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout_s
    buf = b""
    try:
        while len(buf) <= MAX_ANSWER_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                _kill(pid)
                raise AsUserTimeout(f"no answer within {timeout_s:g} s: killed")
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            chunk = os.read(r, MAX_ANSWER_BYTES + 1)
            if not chunk:
                break
            buf += chunk
    finally:
        os.close(r)
    if not _reap(pid, max(deadline, time.monotonic() + REAP_GRACE_S)):
        _kill(pid)
    status, _, text = buf.partition(b"\n")
    message = text.decode("utf-8", "replace")
    if status == b"ok":
        return message
    if status == b"error":
        raise AsUserError(message)
    raise AsUserError("the child died without an answer")
