"""Bounded reads of ``/proc/<pid>/...`` for code that runs as root.

Root decides whom to signal and whose memory a process is from these files, so every
read is bounded, follows no link, and a vanished process is simply None. A pid alone
is not an identity (pids are reused): pair it with :func:`start_ticks`.
"""

from __future__ import annotations

import os


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


def start_ticks(pid: int, proc: str = "/proc") -> int | None:
    """Process start time (stat field 22): with the pid, a unique identity."""
    fields = stat_fields(pid, proc)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None
