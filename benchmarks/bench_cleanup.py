"""Processes a devcluster leaves behind that ``Cluster.down`` does not know.

The Epilog detaches a record writer (``slurm_colloc.node.record_writer``) that keeps
retrying ``sacct``/``sacctmgr`` until the job's record is written; it carries the
cluster's ``SLURM_CONF`` but no ``SLURM_JOB_ID``, so it outlives a benchmark's
cluster, retrying against a slurmdbd that is gone (or, worse, against the next
cluster brought up on the same ports). Benchmarks that bring their own cluster up
end these after taking it down.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def leftovers(slurm_conf: Path, fs_root: str = "/") -> list[int]:
    """Pids whose environment names ``slurm_conf`` and whose root directory is
    ``fs_root`` (a release's root filesystem: the same path names another cluster
    there)."""
    needle = f"SLURM_CONF={slurm_conf}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            root = os.readlink(entry / "root")
        except OSError:
            continue
        if needle in env and root == fs_root:
            found.append(int(entry.name))
    return found


def end_leftovers(slurm_conf: Path, fs_root: str | None = None) -> int:
    """SIGTERM, then SIGKILL, the :func:`leftovers` of a cluster; how many there were.
    ``fs_root`` defaults to this process's own root directory."""
    root = fs_root if fs_root is not None else os.readlink("/proc/self/root")
    first = leftovers(slurm_conf, root)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = leftovers(slurm_conf, root)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        if not pids:
            break
        time.sleep(1)
    return len(first)
