"""Whether the node collector runs, and when it did not: a root-only lock, a public history.

Layout under ``metrics_dir`` (root's, 0755)::

    collector/              root 0700: no other user can open anything inside
    collector/lock          flock-ed by the collector's supervisor while it lives
    collector/pid           "<supervisor pid> <worker pid>" (for people and tests)
    collector/heartbeat     its mtime: the worker's last completed sample
    collector-events.tsv    root 0644, append only: when the collector was up, when it
                            crashed, stalled or stopped (``.1``: the previous 256 KiB)

Why a directory: ``flock`` works on a read-only descriptor, so a lock file any user
can open (the old ``metrics_dir/collector.pid``, 0644) is a lock any user can hold.
Held by a job, it made every prolog believe a collector ran and made every collector
exit at start: no enforcement on the node. Inside a 0700 directory of root's only
root's processes can open the file, and :func:`collector_running` checks that the
directory and the file are root's before it trusts the lock.

The events file is public: the report tells a job's owner when enforcement was off
on the node during the job (:func:`gaps`), which says nothing about other users.
Only the supervisor writes it (one writer; lines are single ``write`` calls).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from slurm_colloc import root_lock
from slurm_colloc.metrics import store

PRIVATE_DIR = "collector"
LOCK = "lock"
PID = "pid"
HEARTBEAT = "heartbeat"
EVENTS = "collector-events.tsv"
LEGACY_PID_FILE = "collector.pid"
"""The old lock (0644 in ``metrics_dir``): removed by the collector, never trusted."""
MAX_EVENTS_BYTES = 256 * 1024
MAX_DETAIL = 300

UP, ALIVE, DOWN, STALLED, STOP = "up", "alive", "down", "stalled", "stop"
"""Events: a worker started; still sampling (every :data:`ALIVE_EVERY_S`); it died
(exit status or signal, or its last exception); it stopped sampling and was killed;
it ended cleanly (idle, SIGTERM)."""
ALIVE_EVERY_S = 30.0
STALE_AFTER_S = 2.5 * ALIVE_EVERY_S
"""No event for this long after ``up``/``alive``: the collector is taken as gone
(its supervisor was killed, or the node went down, and wrote nothing)."""
GRACE_S = 10.0
"""Gaps shorter than this are not reported (a collector a prolog starts samples its
first job a second or two after that job began)."""

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_private_dir(metrics_dir: str | os.PathLike[str], create: bool = False) -> int:
    """A descriptor of ``metrics_dir/collector``, verified ours (owner, 0700, no link).

    ``create``: make it (and ``metrics_dir``) if missing, and tighten the mode of one
    of ours that is looser. Raises OSError (PermissionError when it is not ours).
    """
    base = Path(metrics_dir)
    if create:
        store.ensure_dir(base)
        with contextlib.suppress(FileExistsError):
            os.mkdir(base / PRIVATE_DIR, 0o700)
    fd = os.open(base / PRIVATE_DIR, _O_DIR)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PermissionError(f"{base / PRIVATE_DIR} is owned by uid {st.st_uid}, "
                                  f"not {os.geteuid()}: not trusted")
        if stat.S_IMODE(st.st_mode) & 0o077:
            if not create:
                raise PermissionError(f"{base / PRIVATE_DIR} has mode "
                                      f"{stat.S_IMODE(st.st_mode):04o}: not trusted")
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def acquire_lock(metrics_dir: str | os.PathLike[str], tries: int = 5) -> int | None:
    """Take the collector lock (the descriptor); None when another collector holds it.

    Writes our pid next to it and removes the legacy world-readable lock file.
    """
    dfd = open_private_dir(metrics_dir, create=True)
    try:
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dfd)
        try:
            os.fchmod(fd, 0o600)
            for i in range(tries):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    time.sleep(0.05 * (i + 1))  # a prolog may be probing the lock now
                    continue
                write_pid(metrics_dir, os.getpid())
                with contextlib.suppress(OSError):
                    os.unlink(Path(metrics_dir) / LEGACY_PID_FILE)
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return None
    finally:
        os.close(dfd)


def collector_running(metrics_dir: str | os.PathLike[str]) -> bool:
    """True while a collector holds the lock (the prolog's probe; no pid is parsed).

    Only a lock inside root's 0700 directory, on a file of root's, counts: no
    user's process can open it, so no user's lock can pass for a collector.
    """
    try:
        dfd = open_private_dir(metrics_dir)
    except OSError:
        return False
    try:
        fd = os.open(LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return False
    finally:
        os.close(dfd)
    try:
        return os.fstat(fd).st_uid == os.geteuid() and root_lock.held_elsewhere(fd)
    except OSError:
        return False
    finally:
        os.close(fd)


def write_private(metrics_dir: str | os.PathLike[str], name: str, text: str) -> None:
    """Write ``name`` (root 0600, never through a link) in the private directory."""
    dfd = open_private_dir(metrics_dir)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def write_pid(metrics_dir: str | os.PathLike[str], supervisor: int,
              worker: int | None = None) -> None:
    """Record the supervisor's (and its worker's) pid."""
    write_private(metrics_dir, PID, f"{supervisor} {worker or ''}".rstrip() + "\n")


def read_pids(metrics_dir: str | os.PathLike[str]) -> tuple[int | None, int | None]:
    """(supervisor, worker) pids as last recorded (root only; for people and tests)."""
    try:
        text = store.read_bounded(Path(metrics_dir) / PRIVATE_DIR / PID, 64).decode()
    except (OSError, UnicodeDecodeError):
        return None, None
    parts = [int(p) for p in text.split() if p.isdigit() and len(p) < 10]
    return (parts[0] if parts else None), (parts[1] if len(parts) > 1 else None)


class Heartbeat:
    """The worker's "a sample completed" mark: the mtime of ``collector/heartbeat``."""

    def __init__(self, metrics_dir: str | os.PathLike[str]) -> None:
        """Create the file (in root's private directory) and keep it open."""
        dfd = open_private_dir(metrics_dir, create=True)
        try:
            self._fd = os.open(HEARTBEAT, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                               | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        finally:
            os.close(dfd)

    def beat(self) -> None:
        """Now (one ``futimens``)."""
        os.utime(self._fd)

    def close(self) -> None:
        """Close the file (idempotent)."""
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1


def heartbeat_age(metrics_dir: str | os.PathLike[str], now: float | None = None) -> float | None:
    """Seconds since the worker's last completed sample; None if it never sampled."""
    try:
        st = os.lstat(Path(metrics_dir) / PRIVATE_DIR / HEARTBEAT)
    except OSError:
        return None
    return max(0.0, (time.time() if now is None else now) - st.st_mtime)


# ------------------------------------------------------------------ events ---


@dataclass(frozen=True)
class Event:
    """One line of the events file."""

    t: float
    kind: str
    pid: int
    detail: str = ""


def clean_detail(text: str) -> str:
    """One line, printable, bounded: a detail may quote an exception's message."""
    text = "".join(ch if ch.isprintable() and ch != "\t" else " " for ch in text[:MAX_DETAIL])
    return text


def append_event(metrics_dir: str | os.PathLike[str], kind: str, pid: int,
                 detail: str = "", now: float | None = None) -> None:
    """Append one event (rotating the file past :data:`MAX_EVENTS_BYTES`)."""
    path = Path(metrics_dir) / EVENTS
    t = time.time() if now is None else now
    line = f"{t:.1f}\t{kind}\t{pid}\t{clean_detail(detail)}\n".encode()
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{path}: not a regular file of ours")
        if st.st_size > MAX_EVENTS_BYTES:
            os.close(fd)
            fd = -1
            os.replace(path, path.with_name(EVENTS + ".1"))
            fd = os.open(path, flags, 0o644)
        os.fchmod(fd, 0o644)
        os.write(fd, line)
    finally:
        if fd >= 0:
            os.close(fd)


def parse_events(text: str) -> list[Event]:
    """Events from the file's text (malformed lines skipped)."""
    out = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) != 4 or parts[1] not in (UP, ALIVE, DOWN, STALLED, STOP):
            continue
        try:
            out.append(Event(float(parts[0]), parts[1], int(parts[2]), parts[3]))
        except ValueError:
            continue
    return out


def read_events(metrics_dir: str | os.PathLike[str]) -> list[Event]:
    """The events kept (previous file, then the current one), oldest first."""
    text = []
    for name in (EVENTS + ".1", EVENTS):
        try:
            raw = store.read_bounded(Path(metrics_dir) / name, 2 * MAX_EVENTS_BYTES)
        except OSError:
            continue
        text.append(raw.decode("utf-8", "replace"))
    return sorted(parse_events("\n".join(text)), key=lambda e: e.t)


def covered(events: Iterable[Event], now: float) -> list[tuple[float, float]]:
    """The time spans in which a collector sampled, as the events say."""
    spans: list[tuple[float, float]] = []
    begun: float | None = None
    last = 0.0
    for ev in events:
        if begun is not None and ev.t - last > STALE_AFTER_S:
            spans.append((begun, last + STALE_AFTER_S))  # went silent: gone
            begun = None
        if ev.kind in (UP, ALIVE):
            begun = ev.t if begun is None else begun
        elif begun is not None:
            spans.append((begun, ev.t))
            begun = None
        last = ev.t
    if begun is not None:
        spans.append((begun, min(now, last + STALE_AFTER_S)))
    return spans


def gaps(events: list[Event], start: float, end: float | None,
         now: float | None = None) -> list[tuple[float, float]] | None:
    """Spans of ``[start, end]`` (``end`` None: still running) with no collector.

    None when the events do not reach back to ``start`` (no record: unknown, not
    "unenforced"); gaps shorter than :data:`GRACE_S` are left out.
    """
    now = time.time() if now is None else now
    if not events or events[0].t > start + GRACE_S:
        return None
    stop = now if end is None else min(end, now)
    out = []
    t = start
    for a, b in covered(events, now):
        if b <= t:
            continue
        if a > t:
            out.append((t, min(a, stop)))
        t = max(t, b)
        if t >= stop:
            break
    if t < stop:
        out.append((t, stop))
    return [(a, b) for a, b in out if b - a >= GRACE_S]
