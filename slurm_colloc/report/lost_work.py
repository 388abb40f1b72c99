"""The work an OOM cost: time from the job's last checkpoint to the attempt's end.

Why: a job requeued after a GPU OOM resumes from its last checkpoint (colloc.conf
``checkpoint_dir``, exported to the job as ``COLLOC_CHECKPOINT_DIR``); what it lost is
the work since that checkpoint, which is what a user weighs against checkpointing more
often. The report finds the newest file in the job's checkpoint directory written
before the attempt ended (its modification time) and says "lost ~N min of work since
the last checkpoint".

Only what is known is said. Nothing when the feature is off, when the attempt did not
end in an OOM or its end is unknown, when no file in the directory predates the end
(the job writes no checkpoints, or a later attempt replaced them: a guess either way),
or when the report does not run as the job's user: the directory is the user's, read
with the user's own rights on the login host, never by root or another user
(docs/security.md). The walk is bounded and follows no links.
"""

from __future__ import annotations

import os
import pwd
import stat
import time
from collections.abc import Sequence
from html import escape
from typing import Any, Protocol

from slurm_colloc.node.checkpoint_dir import TemplateError, expand

MAX_ENTRIES = 5000
MAX_DEPTH = 4
"""Framework checkpoints are a few levels deep (``checkpoint-500/``, Orbax's step
directories); the walk looks no further, and at no more entries than this."""


class _Attempt(Protocol):
    oom: dict[str, Any] | None
    start: int | None
    end: int | None
    attempt: int
    lost_work: dict[str, Any] | None


def newest_before(directory: str, until: float) -> float | None:
    """Modification time of the newest regular file under ``directory`` written at or
    before ``until`` (None: none, or the directory cannot be read)."""
    best: float | None = None
    todo, seen = [(directory, 0)], 0
    while todo and seen < MAX_ENTRIES:
        path, depth = todo.pop()
        try:
            with os.scandir(path) as it:
                for entry in it:
                    seen += 1
                    if seen > MAX_ENTRIES:
                        break
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode) and depth < MAX_DEPTH:
                        todo.append((entry.path, depth + 1))
                    elif stat.S_ISREG(st.st_mode) and st.st_mtime <= until:
                        best = st.st_mtime if best is None else max(best, st.st_mtime)
        except OSError:
            if path == directory:
                return None
    return best


def estimate(template: str, user: str, job_id: str, start: int | None,
             end: int | None) -> dict[str, Any] | None:
    """``{"checkpoint_dir", "last_checkpoint", "lost_s"}`` of an attempt that ended at
    ``end``, or None when not known (see the module docstring)."""
    if not template or not user or end is None:
        return None
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return None
    if os.geteuid() != pw.pw_uid:  # only the user reads their own directory
        return None
    try:
        path = expand(template, home=pw.pw_dir, user=pw.pw_name, uid=pw.pw_uid, job_id=job_id)
    except TemplateError:
        return None
    last = newest_before(path, end)
    if last is None:
        return None
    lost = end - max(last, start or last)
    return {"checkpoint_dir": path, "last_checkpoint": int(last), "lost_s": max(0, int(lost))}


def add_lost_work(attempts: Sequence[_Attempt], template: str, user: str, job_id: str) -> None:
    """Set ``lost_work`` on each attempt that ended in an OOM, where it is known."""
    for a in attempts:
        if a.oom is not None:
            a.lost_work = estimate(template, user, job_id, a.start, a.end)


def _amount(seconds: int) -> str:
    return f"~{seconds} s" if seconds < 90 else f"~{round(seconds / 60)} min"


def lost_work_lines(attempts: Sequence[_Attempt]) -> list[str]:
    """One line per attempt whose lost work is known, for the text and HTML reports."""
    out = []
    for a in attempts:
        lw = a.lost_work
        if lw is None:
            continue
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lw["last_checkpoint"]))
        out.append(f"Attempt {a.attempt}: lost {_amount(lw['lost_s'])} of work since the last "
                   f"checkpoint (saved {saved} in {lw['checkpoint_dir']})")
    return out


def lost_work_html(a: _Attempt) -> str:
    """The attempt's line as an HTML paragraph (escaped), or ""."""
    return "".join(f'<p class="missing">{escape(ln)}</p>' for ln in lost_work_lines([a]))
