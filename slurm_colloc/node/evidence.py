"""Keep a failed attempt's output where the requeued run cannot overwrite it.

A requeued batch job writes its output file again from the start (slurm-facts.md),
so the OOM message of the first attempt would be lost. The epilog copies the tail of
each log into ``evidence_dir/<jobid>/attempt<k>/``. The copy runs as the job's user
(a child process with the user's uid/gid and no supplementary groups), so root never
opens a path the user controls: a symlink to /etc/shadow planted as the job's output
file yields a permission error, not a leak. The attempt directory belongs to the
user (0700), so the evidence stays readable by them and nobody else.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from slurm_colloc.mps.tenancy import ensure_root_dir


def attempt_dir(evidence_dir: str, job_id: int, attempt: int) -> Path:
    """Where attempt ``attempt`` (0-based, = Restarts) of a job keeps its logs."""
    return Path(evidence_dir) / str(job_id) / f"attempt{attempt}"


def keep(
    evidence_dir: str, job_id: int, attempt: int, uid: int, gid: int,
    sources: list[str], max_bytes: int,
) -> list[str]:
    """Copy the tail of each source log into the attempt directory as the user.

    Returns the paths written. Raises OSError/CalledProcessError on failure; the
    epilog logs that and carries on (the requeue does not depend on evidence).
    """
    job_dir = ensure_root_dir(Path(evidence_dir) / str(job_id))
    dest = job_dir / f"attempt{attempt}"
    if dest.exists() or dest.is_symlink():
        raise FileExistsError(f"{dest} already exists; not overwriting earlier evidence")
    os.mkdir(dest, 0o700)
    os.chown(dest, uid, gid, follow_symlinks=False)
    written = []
    for i, src in enumerate(dict.fromkeys(sources)):
        target = dest / f"{i}-{Path(src).name}"
        subprocess.run(
            [sys.executable, "-m", "slurm_colloc.node.evidence", src, str(target), str(max_bytes)],
            user=uid, group=gid, extra_groups=[], check=True, timeout=120,
            capture_output=True, env={"PATH": "/usr/bin:/bin"},
        )
        written.append(str(target))
    return written


def copy_tail(src: str, dst: str, max_bytes: int) -> None:
    """Copy the last ``max_bytes`` of ``src`` to a new file ``dst`` (runs as the user)."""
    fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK)
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - max_bytes)
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            if start:
                os.write(out, f"[colloc: first {start} bytes omitted]\n".encode())
            os.lseek(fd, start, os.SEEK_SET)
            while chunk := os.read(fd, 1 << 20):
                os.write(out, chunk)
        finally:
            os.close(out)
    finally:
        os.close(fd)


if __name__ == "__main__":
    copy_tail(sys.argv[1], sys.argv[2], int(sys.argv[3]))
