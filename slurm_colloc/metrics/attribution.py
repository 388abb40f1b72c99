"""Which Slurm job (and attempt) a GPU process belongs to.

NVML (and the sim backend) name GPU processes by pid only. The collector runs as
root and asks, in order of trust:

1. the process's cgroup, only in the layouts Slurm's own cgroup plugins make
   (v2 ``0::/system.slice/[<node>_]slurmstepd.scope/job_<id>/...``, v1
   ``.../slurm[_<node>]/uid_<uid>/job_<id>/...`` with ``uid`` the process's owner): set by
   slurmstepd, not by the user. A ``job_<id>`` anywhere else (a user can make one in a
   cgroup subtree delegated to them) is ignored. Slurm 26.05 names the v2 job cgroup by
   the job's SLUID instead (``.../slurmstepd.scope/sEKNKTV3WPV500/...``, unless
   ``CgroupJobIdPaths=yes``): that SLUID is turned into a job id only through the
   mapping the prolog recorded in root's meta (slurmd's ``SLURM_JOB_SLUID``; see
   :class:`slurm_colloc.metrics.store.SluidIndex`), so a SLUID no prolog recorded here
   attributes nothing and the next source is asked;
2. its environment (``/proc/<pid>/environ``: ``SLURM_JOB_ID``,
   ``SLURM_RESTART_COUNT``): works with ``proctrack/linuxproc`` (the devcluster), but
   a user can change it.

Whatever the source, the job's owner (the prolog's meta) must be the process's owner
(root's own processes aside), or the process is not attributed; the collector then
also requires that the job is live on that GPU (:mod:`.collector`).

Answers are cached per (pid, start time), so pid reuse never inherits an old answer
and each process's files are read once. Reads are bounded; nothing follows links.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from slurm_colloc import procfs

MAX_ENVIRON = 256 * 1024
MAX_CGROUP = 16 * 1024
_CG_V2 = re.compile(
    rb"^0::/system\.slice/(?:[\w.-]+_)?slurmstepd\.scope/"
    rb"(?:job_(\d{1,12})|(" + procfs.SLUID_PATTERN.encode() + rb"))(?:/|$)")
_CG_V1 = re.compile(rb"^\d+:[\w,=]*:/slurm(?:_[\w.-]+)?/uid_(\d{1,10})/job_(\d{1,12})(?:/|$)")


log = logging.getLogger("colloc.metrics.attribution")
_JOB_ID = re.compile(r"[0-9]{1,12}")

JobOfSluid = Callable[[str], str | None]
"""SLUID -> job id as root's metas record it (None: no prolog here recorded it)."""


def slurm_cgroup_job(
    cgroup: bytes, uid: int, job_of_sluid: JobOfSluid | None = None
) -> str | None:
    """The job of a ``/proc/<pid>/cgroup`` text, only in Slurm's own layouts.

    A SLUID-named v2 job cgroup (26.05) counts only when ``job_of_sluid`` knows it:
    the name alone says which job only to whoever recorded it, and that is the prolog.
    """
    for line in cgroup.splitlines():
        m = _CG_V2.match(line)
        if m and m.group(1):
            return m.group(1).decode()
        if m:
            job = job_of_sluid(m.group(2).decode()) if job_of_sluid is not None else None
            if job is not None and _JOB_ID.fullmatch(job):
                return job
            continue
        m1 = _CG_V1.match(line)
        if m1 and int(m1.group(1)) == uid:
            return m1.group(2).decode()
    return None


@dataclass(frozen=True)
class JobTag:
    """A process's job and attempt, and how we know."""

    job_id: str
    attempt: int
    source: str
    """``cgroup``, ``environ`` or ``tenancy`` (the owner's MPS job on that GPU)."""
    uid: int


_read = procfs.read
start_ticks = procfs.start_ticks


def _env_value(environ: bytes, key: bytes) -> str | None:
    for item in environ.split(b"\0"):
        if item.startswith(key + b"="):
            return item[len(key) + 1 :].decode("ascii", "replace")
    return None


MAX_ATTEMPT = 9999
"""Attempts beyond this are not Slurm's (its restart counter is far smaller) and have
no file name in the store (``series-<n>.tsv``, at most four digits)."""
_ATTEMPT = re.compile(r"[0-9]{1,4}")


def restart_count(value: str | None) -> int:
    """``SLURM_RESTART_COUNT`` as an attempt number; 0 unless it is 1-4 ASCII digits.

    The value is the job owner's to set. It is checked by shape before ``int()``:
    5,000 digits made ``int()`` raise past Python's digit limit and killed the root
    collector for the whole node; 300 digits made a file name too long for the store.
    A malformed count is taken as attempt 0 (the process stays attributed to its job,
    whose owner is verified separately).
    """
    if value is None or not _ATTEMPT.fullmatch(value):
        return 0
    return int(value)


_warned: set[int] = set()


def _malformed(pid: int, length: int) -> None:
    """Say once per pid (bounded) that its restart count was not a count."""
    if pid in _warned:
        return
    if len(_warned) > 4096:
        _warned.clear()
    _warned.add(pid)
    log.warning("process %d: SLURM_RESTART_COUNT is not 1-4 digits (%d characters): "
                "taken as attempt 0", pid, length)


def tag_of(
    pid: int, proc: str = "/proc", job_of_sluid: JobOfSluid | None = None
) -> JobTag | None:
    """Look the process up (no cache); ``job_of_sluid`` reads 26.05's SLUID cgroups."""
    try:
        uid = os.stat(f"{proc}/{pid}").st_uid
    except OSError:
        return None
    environ = _read(f"{proc}/{pid}/environ", MAX_ENVIRON) or b""
    raw_count = _env_value(environ, b"SLURM_RESTART_COUNT")
    attempt = restart_count(raw_count)
    if raw_count is not None and attempt == 0 and raw_count != "0":
        _malformed(pid, len(raw_count))
    cg = _read(f"{proc}/{pid}/cgroup", MAX_CGROUP) or b""
    cg_job = slurm_cgroup_job(cg, uid, job_of_sluid)
    if cg_job:
        return JobTag(cg_job, attempt, "cgroup", uid)
    job = _env_value(environ, b"SLURM_JOB_ID")
    if job and _JOB_ID.fullmatch(job):
        return JobTag(job, attempt, "environ", uid)
    return None


class Attributor:
    """Cached pid -> job lookups; ``uid_of_job`` verifies environment answers."""

    def __init__(
        self, proc: str = "/proc", uid_of_job: Callable[[str], int | None] | None = None,
        job_of_sluid: JobOfSluid | None = None,
    ) -> None:
        """``uid_of_job(job)`` gives the owner the prolog recorded, or None;
        ``job_of_sluid(sluid)`` the job it recorded with that SLUID, or None."""
        self.proc = proc
        self.uid_of_job = uid_of_job
        self.job_of_sluid = job_of_sluid
        self._cache: dict[int, tuple[int, JobTag | None]] = {}

    def lookup(self, pid: int) -> JobTag | None:
        """The process's job, or None (not a Slurm job, gone, or failed verification)."""
        ident = self.identity(pid)
        return None if ident is None else ident[1]

    def identity(self, pid: int) -> tuple[int, JobTag] | None:
        """``(start ticks, tag)`` of the process: what a signal must be checked against.

        Enforcement signals a pid only if its start time still equals the ticks the
        attribution was made for (see :mod:`slurm_colloc.metrics.enforce`).
        """
        ticks = start_ticks(pid, self.proc)
        if ticks is None:
            self._cache.pop(pid, None)
            return None
        hit = self._cache.get(pid)
        if hit is not None and hit[0] == ticks:
            return None if hit[1] is None else (ticks, hit[1])
        tag = tag_of(pid, self.proc, self.job_of_sluid)
        if tag is not None and self.uid_of_job is not None:
            owner = self.uid_of_job(tag.job_id)
            if tag.uid != 0 and (owner is None or owner != tag.uid):
                # a user's process claiming another user's job, or a job no prolog
                # recorded here: unverified (the collector then asks root's MPS
                # bookkeeping which job of this user runs on the GPU)
                tag = None
        if tag is None:
            return None
        # negatives are not cached: a process caught between fork and exec still
        # shows its parent's environment, and its start time will not change
        self._cache[pid] = (ticks, tag)
        return ticks, tag

    def forget_missing(self, alive: set[int]) -> None:
        """Drop cache entries of pids no longer on any GPU (bounds the cache)."""
        for pid in [p for p in self._cache if p not in alive]:
            del self._cache[pid]
