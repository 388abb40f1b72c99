"""Bounded reads of ``/proc/<pid>/...`` for code that runs as root.

Root decides whom to signal and whose memory a process is from these files, so every
read is bounded, follows no link, and a vanished process is simply None. A pid alone
is not an identity (pids are reused): pair it with :func:`start_ticks`, as
:class:`Process` does. :func:`sluid` validates the job name Slurm 26.05 puts in a
process's cgroup path (``/proc/<pid>/cgroup``) and in the job's cgroup directory.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

SLUID_PATTERN = "s[0-9A-HJKMNP-TV-Z]{13}"
"""A job's SLUID as Slurm 25.11+ writes it (``sluid2str``: ``s`` and 13 upper-case
Crockford base32 digits, e.g. ``sEKNKTV3WPV500``). Slurm 26.05 names job cgroups by it
(``CgroupJobIdPaths=no``, its default) and slurmd exports it as ``SLURM_JOB_SLUID``."""
_SLUID_RE = re.compile(SLUID_PATTERN)


def sluid(value: object) -> str | None:
    """``value`` if it is a SLUID, else None.

    The value becomes a path component under ``/sys/fs/cgroup`` and a key root
    attributes processes by, so anything else (lower case, ``/``, ``..``, another
    length) is refused even from slurmd's own environment.
    """
    return value if isinstance(value, str) and _SLUID_RE.fullmatch(value) else None


def read(path: str, limit: int) -> bytes | None:
    """At most ``limit`` bytes of ``path`` (no link followed), None if unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def stat_fields(pid: int, proc: str = "/proc") -> list[bytes] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (field 3 onwards)."""
    raw = read(f"{proc}/{pid}/stat", 4096)
    if not raw or b")" not in raw:
        return None
    return raw[raw.rfind(b")") + 2:].split()


def _stat_int(pid: int, index: int, proc: str) -> int | None:
    """Field ``index`` of :func:`stat_fields` as a number."""
    fields = stat_fields(pid, proc)
    try:
        return int(fields[index]) if fields else None
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int, proc: str = "/proc") -> int | None:
    """Process start time (stat field 22): with the pid, a unique identity."""
    return _stat_int(pid, 19, proc)


def parent(pid: int, proc: str = "/proc") -> int | None:
    """Parent pid (stat field 4)."""
    return _stat_int(pid, 1, proc)


def alive(pid: int, proc: str = "/proc") -> bool:
    """The process exists and is neither a zombie nor dead (stat field 3)."""
    fields = stat_fields(pid, proc)
    return bool(fields) and fields[0] not in (b"Z", b"X")  # type: ignore[index]


def uid(pid: int, proc: str = "/proc") -> int | None:
    """The real uid (first ``Uid:`` field of ``/proc/<pid>/status``)."""
    for line in (read(f"{proc}/{pid}/status", 1 << 16) or b"").splitlines():
        if line.startswith(b"Uid:"):
            parts = line.split()
            return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    return None


def environ(pid: int, key: str, proc: str = "/proc") -> str | None:
    """The value of ``key`` in the process's initial environment, None if unset."""
    raw = read(f"{proc}/{pid}/environ", 1 << 20) or b""
    prefix = key.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode("utf-8", "replace")
    return None


@dataclass(frozen=True)
class Process:
    """A process known by pid and kernel start time: pids are reused, the pair is not."""

    pid: int
    start_ticks: int

    def matches(self) -> bool:
        """The live process ``pid`` is still this one (not a zombie, not a reused pid)."""
        return start_ticks(self.pid) == self.start_ticks and alive(self.pid)

    def signal(self, sig: int) -> bool:
        """Send ``sig`` only if the process still :meth:`matches`; True when sent."""
        if not self.matches():
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
        return True
