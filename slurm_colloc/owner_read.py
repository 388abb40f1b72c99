"""Root's files that one user may read, and nobody else (issue 23, "private data").

Root keeps data that belongs to a job's owner: the evidence copies of their failed
attempts and their rows of the estimator history. Giving the file to the user's
primary group (``root:gid 0640``) leaked it to every other member of that group (sites
where all users share ``users``); giving the file to the user lets them grow it on
root's file system or keep it alive with a hard link. So the file stays root's
(``root:root``, ``0600``/``0700``) and one POSIX ACL entry, ``user:<uid>:r--`` (``r-x``
on a directory), lets the owner read it: no group entry, nothing for others.

The ACL is written as the kernel's ``system.posix_acl_access`` extended attribute on
an open descriptor (no ``setfacl`` program, no path to race). On a file system without
ACLs the file stays root-only and :func:`grant_owner_read` says so (False): privacy
wins over convenience (the user has their own copy next to the job's output, and
``colloc estimate`` works without history).
"""

from __future__ import annotations

import errno
import os
import stat
import struct

_XATTR = "system.posix_acl_access"
_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_UNDEFINED_ID = 0xFFFFFFFF
_R, _W, _X = 4, 2, 1
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


def acl_bytes(uid: int, *, directory: bool) -> bytes:
    """The ACL ``u::rw(x) u:<uid>:r(x) g::- m::r(x) o::-`` in the kernel's format."""
    read = _R | (_X if directory else 0)
    own = _R | _W | (_X if directory else 0)
    entries = [
        (_USER_OBJ, own, _UNDEFINED_ID),
        (_USER, read, uid),
        (_GROUP_OBJ, 0, _UNDEFINED_ID),
        (_MASK, read, _UNDEFINED_ID),
        (_OTHER, 0, _UNDEFINED_ID),
    ]
    return struct.pack("<I", _VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)


def make_private(fd: int) -> None:
    """Root's and root's group's only: ``0600`` (a file) or ``0700`` (a directory),
    any ACL removed."""
    st = os.fstat(fd)
    os.fchown(fd, os.geteuid(), 0)
    os.fchmod(fd, 0o700 if stat.S_ISDIR(st.st_mode) else 0o600)
    try:
        os.removexattr(fd, _XATTR)
    except OSError as e:
        if e.errno not in (*_UNSUPPORTED, errno.ENODATA):
            raise


def grant_owner_read(fd: int, uid: int) -> bool:
    """Make ``fd`` root's, readable by ``uid`` too (a directory: listable and
    traversable) and by nobody else. True when the grant is in place, False when the
    file system has no ACLs (then only root reads it). Other errors are raised.
    """
    make_private(fd)
    if uid == os.geteuid():
        return True
    directory = stat.S_ISDIR(os.fstat(fd).st_mode)
    try:
        os.setxattr(fd, _XATTR, acl_bytes(uid, directory=directory))
    except OSError as e:
        if e.errno in _UNSUPPORTED:
            return False
        raise
    return True
