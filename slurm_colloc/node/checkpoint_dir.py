"""The job's checkpoint directory: made by the TaskProlog, as the job's user.

Why: colloc requeues a job that died of GPU OOM (and Slurm requeues jobs after a node
failure); the rerun starts the batch script again from its first line. A job that saves
its progress somewhere that survives the requeue and reads it back at the start loses
only the work since its last save. The job id stays the same across requeues, so a
directory named after it (``checkpoint_dir`` in colloc.conf, e.g.
``{home}/.colloc/checkpoints/{jobid}``) is the same directory in every attempt. The
TaskProlog exports it as ``COLLOC_CHECKPOINT_DIR`` with ``COLLOC_RESTART_COUNT`` (Slurm's
``SLURM_RESTART_COUNT``, 0 in the first attempt), and the templates in sbatch_templates/
resume from it.

Security: the TaskProlog runs as the job's user, so the directory is made with the
user's own rights (never root's: :func:`prepare` refuses to create anything when it runs
as root). A directory on a path another user can change (a shared scratch directory
someone else created for this user's name, a group-writable parent) would let that user
swap the checkpoint, which a framework then unpickles: such a path is refused, as are
links along it that lead to such places (each directory on the way, followed, must be
root's or the user's and writable by no one else unless sticky; the directory itself
must be the user's). A refusal never fails the task: it runs without the variable and is
told why in one ``print`` line.
"""

from __future__ import annotations

import os
import pwd
import stat
import string
from collections.abc import Mapping
from dataclasses import dataclass

ENV_DIR = "COLLOC_CHECKPOINT_DIR"
ENV_RESTARTS = "COLLOC_RESTART_COUNT"
FIELDS = frozenset({"home", "user", "uid", "jobid"})
"""Placeholders a ``checkpoint_dir`` template may use."""
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class TemplateError(ValueError):
    """The template cannot give a path for this job."""


def template_fields(template: str) -> set[str]:
    """The placeholder names in ``template`` (raises ValueError on a malformed one)."""
    return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}


def expand(template: str, *, home: str, user: str, uid: int, job_id: str) -> str:
    """The job's directory: ``template`` with its placeholders filled in.

    Raises :class:`TemplateError` unless the result is an absolute path (normalised) of
    printable characters (Slurm reads the TaskProlog's output line by line).
    """
    try:
        unknown = template_fields(template) - FIELDS
        if unknown:
            raise TemplateError(f"unknown placeholder(s) {sorted(unknown)}")
        path = template.format(home=home, user=user, uid=uid, jobid=job_id)
    except (ValueError, IndexError, KeyError) as e:
        raise TemplateError(f"{template!r}: {e}") from None
    if not os.path.isabs(path) or ".." in path.split("/"):
        raise TemplateError(f"{path!r} is not an absolute path without '..'")
    if not path.isprintable():
        raise TemplateError(f"{path!r} has control characters")
    return os.path.normpath(path)


def unsafe(path: str, uid: int) -> str | None:
    """Why ``path`` (an existing directory) must not hold this user's checkpoints, or None.

    Each directory on the way to it, and on the way to where it really is, must be
    root's or ``uid``'s and writable by nobody else (a sticky directory such as /tmp
    is fine); ``path`` itself must be a directory of ``uid``'s.
    """
    real = os.path.realpath(path)
    for p in (*_ancestors(path), *_ancestors(real)):
        try:
            st = os.stat(p)
        except OSError as e:
            return f"{p}: {e.strerror or e}"
        if st.st_uid not in (0, uid):
            return f"{p} is owned by uid {st.st_uid}, not by you or root"
        if p not in (path, real) and st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
            return f"{p} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != uid:
        return f"{path} is not yours (owned by uid {st.st_uid})"
    if st.st_mode & _OTHERS_WRITE:
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _ancestors(path: str) -> list[str]:
    """``path``, then each directory above it up to ``/``."""
    out, cur = [path], path
    while (parent := os.path.dirname(cur)) != cur:
        out.append(parent)
        cur = parent
    return out


@dataclass(frozen=True)
class Prepared:
    """What the TaskProlog says: the directory (None: not available) and why not."""

    path: str | None
    problem: str | None
    restarts: str

    def lines(self) -> list[str]:
        """The TaskProlog's lines: ``export``s, or a ``print`` saying why not."""
        out = [f"export {ENV_RESTARTS}={self.restarts}"]
        if self.path is not None:
            out.append(f"export {ENV_DIR}={self.path}")
        elif self.problem:
            out.append(f"print colloc: no checkpoint directory for this job "
                       f"({ENV_DIR} is not set): {self.problem}")
        return out


def job_path(template: str, env: Mapping[str, str], uid: int) -> str:
    """The job's directory for the user ``uid`` (raises :class:`TemplateError`, KeyError)."""
    pw = pwd.getpwuid(uid)
    return expand(template, home=pw.pw_dir, user=pw.pw_name, uid=uid,
                  job_id=env["SLURM_JOB_ID"])


def prepare(template: str, env: Mapping[str, str], uid: int | None = None) -> Prepared | None:
    """Make the job's checkpoint directory (mode 0700, parents too) and check it.

    None when the feature is off (empty ``template``): the TaskProlog then says nothing.
    A ``COLLOC_CHECKPOINT_DIR`` already in ``env`` (the task's environment: the user's
    or the site's TaskProlog's) is kept: nothing is made or exported but the count.
    ``uid``: the user this runs as (default: the effective uid; root is refused).
    """
    if not template:
        return None
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    restarts = restarts if restarts.isdigit() else "0"
    if env.get(ENV_DIR):  # the user's (or the site's) own choice wins
        return Prepared(None, None, restarts)
    uid = os.geteuid() if uid is None else uid
    if uid == 0:
        return Prepared(None, "the task prolog runs as root; colloc makes it only as the "
                        "job's user", restarts)
    try:
        path = job_path(template, env, uid)
    except (TemplateError, KeyError) as e:
        return Prepared(None, f"checkpoint_dir: {e}", restarts)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        return Prepared(None, f"cannot create {path}: {e.strerror or e}", restarts)
    try:
        why = unsafe(path, uid)
    except OSError as e:
        why = f"cannot check {path}: {e.strerror or e}"
    return Prepared(None if why else path, why, restarts)


def checkpoint_lines(template: str, env: Mapping[str, str]) -> list[str]:
    """The TaskProlog's checkpoint lines for this task (none when the feature is off)."""
    got = prepare(template, env)
    return got.lines() if got is not None else []
