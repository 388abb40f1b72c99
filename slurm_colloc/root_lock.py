"""One round at a time: a non-blocking ``flock`` on a lock file in a root-only directory.

Root's detached helpers (the record writer, the late epilog, the stuck-prolog check,
the release confirmation) each run one round at a time per node. Their lock file
lives in a 0700 directory of root's, is opened without following a link, and must be
root's regular file: no user can open it, so no user can hold it and keep a helper out.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path


def try_lock(path: Path) -> int | None:
    """The lock at ``path``, held (an fd to close to release it), or None when another
    process holds it. OSError when the file is not root's regular file (a link, another
    owner): nothing is locked, the caller reports it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(f"{path}: not root's regular file")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def held_elsewhere(fd: int) -> bool:
    """Whether another open file holds an exclusive lock on ``fd``'s file (a probe:
    nothing is kept; closing ``fd`` is the caller's). An unexpected error is "not held"."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False
