"""Node-wide event counters the epilog bumps and the Prometheus export reads.

GPU OOMs and requeues are decided by the epilog, which runs once per job and leaves
nothing running; the collector, which exports metrics, never sees them. So the epilog
adds to ``metrics_dir/collector/counters.json``, in root's private directory
(:func:`.liveness.open_private_dir`: root-owned, 0700, no link), and the exporter
reads it every sample. The counts only grow (Prometheus counters), across jobs and
collector restarts; they are lost only with the file.

Concurrent epilogs (jobs ending together) serialise on an ``flock`` of
``counters.lock`` beside it: read, add, write to a temp file, rename. No user can open
either file, so no user can hold the lock or feed the counts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Mapping

from slurm_colloc.metrics import liveness

COUNTERS = "counters.json"
LOCK = "counters.lock"
MAX_BYTES = 4096
KNOWN = ("gpu_oom", "requeues")
"""The counters there are (unknown names in the file are ignored)."""


def read(metrics_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Every known counter (0 when the file or the directory is missing or damaged)."""
    out = dict.fromkeys(KNOWN, 0)
    try:
        dfd = liveness.open_private_dir(metrics_dir)
    except OSError:
        return out
    try:
        return _read_at(dfd, out)
    finally:
        os.close(dfd)


def _read_at(dfd: int, out: dict[str, int]) -> dict[str, int]:
    try:
        fd = os.open(COUNTERS, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return out
    try:
        data = json.loads(os.read(fd, MAX_BYTES))
    except (OSError, ValueError):
        return out
    finally:
        os.close(fd)
    if isinstance(data, dict):
        for k in KNOWN:
            v = data.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                out[k] = v
    return out


def bump(metrics_dir: str | os.PathLike[str], deltas: Mapping[str, int]) -> dict[str, int]:
    """Add ``deltas`` (known names, >= 0) to the node's counters; the new counts.

    Creates the private directory if needed. Raises OSError (the epilog logs it: a
    lost count never fails a job's epilog).
    """
    add = {k: int(v) for k, v in deltas.items() if k in KNOWN and int(v) > 0}
    dfd = liveness.open_private_dir(metrics_dir, create=True)
    try:
        lock = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                       dir_fd=dfd)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            counts = _read_at(dfd, dict.fromkeys(KNOWN, 0))
            if not add:
                return counts
            for k, v in add.items():
                counts[k] += v
            _write_at(dfd, json.dumps(counts, sort_keys=True))
            return counts
        finally:
            os.close(lock)
    finally:
        os.close(dfd)


def _write_at(dfd: int, text: str) -> None:
    """Temp file + rename inside the private directory (readers see old or new)."""
    tmp = f".{COUNTERS}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dfd)
    try:
        os.write(fd, text.encode())
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    os.close(fd)
    os.replace(tmp, COUNTERS, src_dir_fd=dfd, dst_dir_fd=dfd)
