"""Whether root may run an interpreter: ``colloc selftest --python`` (issue 23).

The kit runs as root and asks ``--python`` whether PyTorch sees the GPU before any
job starts. An interpreter a user can change (the file, a directory on its way, the
venv it belongs to, that venv's ``site-packages``) is that user's code running as
root. So, as root, the interpreter is run only when every one of those is root's
and writable by nobody else, along the path as given and along its real path (a
root-owned link to a user's file is the user's file). Otherwise the kit refuses
with one line that names what is wrong; the admin can install torch in a root-owned
environment or fix the owner. A bare name (``python3``) is looked up on
:data:`SAFE_PATH`, never on the caller's ``PATH``.
"""

from __future__ import annotations

import glob
import os
import shutil
import stat

SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def resolve(python: str) -> str | None:
    """The interpreter's absolute path: a bare name is looked up on :data:`SAFE_PATH`."""
    if os.sep not in python:
        return shutil.which(python, path=SAFE_PATH)
    return os.path.abspath(python)


def _unsafe(path: str, what: str, *, sticky_ok: bool = False) -> str | None:
    """Why ``path`` (followed) is not root's alone, or None.

    ``sticky_ok``: a root-owned sticky directory (``/tmp``) passes: nobody but root
    can rename or remove root's entries in it, and the next one on the way is checked.
    """
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if st.st_uid != 0:
        return f"{what} {path} is owned by uid {st.st_uid}, not root"
    sticky = sticky_ok and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & _OTHERS_WRITE and not sticky:
        return f"{what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _chain(path: str) -> list[str]:
    """``path``'s directories from ``/`` down, then ``path``."""
    parts, cur = [], path
    while True:
        parts.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    return list(reversed(parts))


def _venv_dirs(interpreter: str) -> list[str]:
    """A venv's ``site-packages`` (where its imports come from), when it is one."""
    root = os.path.dirname(os.path.dirname(interpreter))
    if not os.path.isfile(os.path.join(root, "pyvenv.cfg")):
        return []
    found = glob.glob(os.path.join(glob.escape(root), "lib*", "python*", "site-packages"))
    return sorted(found)[:8]


def untrusted_interpreter(python: str) -> str | None:
    """Why root must not run ``python`` (one line), or None when it may."""
    path = resolve(python)
    if path is None:
        return f"{python}: not found on {SAFE_PATH}"
    if not os.path.exists(path):
        return f"{path}: not found"
    if not os.path.isfile(path):
        return f"{path}: not a regular file"
    real = os.path.realpath(path)
    seen: set[str] = set()
    for chain in (_chain(path), _chain(real)):
        for p in chain:
            if p in seen:
                continue
            seen.add(p)
            last = p in (path, real)
            why = _unsafe(p, "interpreter" if last else "directory", sticky_ok=not last)
            if why:
                return why
    for site in (*_venv_dirs(path), *_venv_dirs(real)):
        why = _unsafe(site, "site-packages")
        if why:
            return why
    return None
