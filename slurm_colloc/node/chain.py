"""The site's own TaskProlog, run by colloc's (colloc.conf ``chain_task_prolog``).

slurm.conf holds one ``TaskProlog`` (Prolog and Epilog may be listed on several lines,
so those need no chaining: docs/admin.md, "Chaining with a site's own hooks"). A site
that already has a task prolog names it in colloc.conf; ``colloc-task-prolog`` runs it
first and passes on what Slurm would have read from it:

* its stdout lines ``export NAME=value``, ``unset NAME`` and ``print ...`` (the only
  ones slurmstepd acts on), unchanged and in order, before colloc's own ``export``
  lines, so colloc's MPS settings are the last word on the variables colloc sets;
* its exit status: Slurm fails the task when its TaskProlog exits non-zero, so
  colloc's task prolog then exits with the same status (a signal: 128 + its number).

The script runs as the job's user (Slurm runs the TaskProlog so), but it runs in every
job of the node, so it must be root's: the file and each directory on its way
(followed) owned by root and writable by no one else, as for the other programs
colloc runs on a site's behalf. A script that is refused, missing or cannot start
fails the task as a broken TaskProlog would, with a ``print`` line saying why:
silently skipping a site's set-up would run jobs without it.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

SLURM_VERBS = ("export ", "unset ", "print ")
"""The TaskProlog output lines slurmstepd acts on (anything else it ignores)."""
CANNOT_RUN = 1
"""Exit status when the site's script cannot be run at all (Slurm: non-zero fails)."""
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


@dataclass(frozen=True)
class SiteTaskProlog:
    """What the site's TaskProlog said: its Slurm lines and its exit status."""

    lines: tuple[str, ...]
    status: int

    def exported(self) -> dict[str, str]:
        """NAME -> value of its ``export`` lines (the task will have them set)."""
        out: dict[str, str] = {}
        for ln in self.lines:
            if ln.startswith("export "):
                name, _, value = ln[len("export "):].partition("=")
                out[name.strip()] = value
        return out


def untrusted(path: str) -> str | None:
    """Why the site's script must not run in every job (one line), or None."""
    if not os.path.isabs(path):
        return f"{path}: not an absolute path"
    real = os.path.realpath(path)
    for p in (*_ancestors(path), *_ancestors(real)):
        try:
            st = os.stat(p)
        except OSError as e:
            return f"{p}: {e.strerror or e}"
        what = "file" if p in (path, real) else "directory"
        if st.st_uid != 0:
            return f"{what} {p} is owned by uid {st.st_uid}, not root"
        sticky = what == "directory" and st.st_mode & stat.S_ISVTX
        if st.st_mode & _OTHERS_WRITE and not sticky:
            return f"{what} {p} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    if not stat.S_ISREG(os.stat(real).st_mode) or not os.access(real, os.X_OK):
        return f"{path}: not an executable file"
    return None


def _ancestors(path: str) -> list[str]:
    """``/`` down to ``path``, each directory on its way, then ``path``."""
    out, cur = [path], path
    while (parent := os.path.dirname(cur)) != cur:
        out.append(parent)
        cur = parent
    return list(reversed(out))


def slurm_lines(stdout: str) -> tuple[str, ...]:
    """The lines of a TaskProlog's output that slurmstepd acts on, unchanged."""
    return tuple(ln for ln in stdout.splitlines() if ln.startswith(SLURM_VERBS))


def exit_status(returncode: int) -> int:
    """A child's ``returncode`` as a shell would report it (signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def run_site_task_prolog(path: str, env: Mapping[str, str]) -> SiteTaskProlog:
    """Run the site's TaskProlog (checked first) with the task's environment.

    No timeout, as Slurm sets none for a TaskProlog; stderr goes where the task
    prolog's own goes (slurmd's log).
    """
    why = untrusted(path)
    if why:
        return SiteTaskProlog((f"print colloc: the site's task prolog was not run: {why}",),
                              CANNOT_RUN)
    try:
        cp = subprocess.run([path], env=dict(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, check=False)
    except OSError as e:
        return SiteTaskProlog((f"print colloc: cannot run the site's task prolog {path}: "
                               f"{e.strerror or e}",), CANNOT_RUN)
    text = cp.stdout.decode("utf-8", errors="replace")
    return SiteTaskProlog(slurm_lines(text), exit_status(cp.returncode))
