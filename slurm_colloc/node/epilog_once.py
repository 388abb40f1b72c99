"""One colloc epilog per job attempt: slurmd's, or the late one (issue 28).

slurmd's Epilog (``entry.epilog_main``) and the late epilog
(:mod:`slurm_colloc.node.late_epilog`) take the same per-job ``flock`` in root's
``<state>/late-epilog/`` (0700), so they never run beside each other. The late epilog
leaves ``<job>.late`` behind (root 0600): a colloc epilog that slurmd runs for the
job afterwards anyway, with no saved context left (the late one consumed it), does
nothing, so the job is never requeued twice. A later attempt's prolog saves a new
context, and its epilog runs as usual (and removes the stale marker).

The lock file is removed by its holder before it lets go; a taker checks that the
file it locked is still the one at the path, so a removed file never lets two in.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.mps import missed_epilogs
from slurm_colloc.mps.tenancy import Tenancy, TenancyError, ensure_root_dir

WAIT_S = 30.0
"""How long slurmd's epilog waits for a late epilog of the same job to finish."""


def take(sdir: Path, job_id: int, wait_s: float = 0.0) -> int | None:
    """The job's lock (a descriptor to hand to :func:`drop`); None when another
    epilog of the job still holds it after ``wait_s``."""
    ensure_root_dir(sdir, 0o700)
    path = sdir / f"{int(job_id)}.lock"
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)
            continue
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # its holder removed it as we took it: take the new one


def drop(sdir: Path, job_id: int, fd: int) -> None:
    """Remove the lock file, then let go (see the module docstring)."""
    with contextlib.suppress(OSError):
        (sdir / f"{int(job_id)}.lock").unlink()
    os.close(fd)


def late_marker(sdir: Path, job_id: int) -> Path:
    return sdir / f"{int(job_id)}.late"


def mark_late(sdir: Path, job_id: int, ctx_mtime: float) -> None:
    """Say that the late epilog took this attempt (before it acts: at most once)."""
    path = late_marker(sdir, job_id)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{ctx_mtime!r} {time.time():.0f}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _late_ran(sdir: Path, job_id: int) -> bool:
    with contextlib.suppress(OSError):
        st = late_marker(sdir, job_id).lstat()
        return st.st_uid == os.geteuid()
    return False


@contextlib.contextmanager
def slurmd_epilog(cfg: CollocConfig, job_id: int) -> Iterator[str | None]:
    """Around slurmd's colloc epilog: yields None to go ahead (the job's lock held), or
    why not (a late epilog holds the job, or already did this attempt's work).

    Bookkeeping that fails (a full state disk) never stops the epilog: it goes ahead
    without the lock, and the late epilog then finds the context consumed."""
    sdir = missed_epilogs.state_dir(cfg.evidence_dir)
    try:
        fd = take(sdir, job_id, WAIT_S)
    except (OSError, TenancyError):
        yield None
        return
    if fd is None:
        yield f"a late epilog holds job {job_id} for over {WAIT_S:.0f} s: not run here"
        return
    try:
        saved = Tenancy(Path(cfg.mps_root)).read_job_context(job_id)
        if saved is None and _late_ran(sdir, job_id):
            yield "the late epilog already did this job's epilog: nothing done again"
            return
        with contextlib.suppress(OSError):
            late_marker(sdir, job_id).unlink()  # an earlier attempt's
        missed_epilogs.forget_watch(sdir, job_id)
        yield None
    finally:
        drop(sdir, job_id, fd)
