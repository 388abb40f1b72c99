"""Which jobs use which MPS daemon, on disk under ``mps_root`` (root-owned).

::

    mps_root/                       root 0755
      jobs/<jobid>.env              root 0644  what the TaskProlog exports
      gpu<i>/lock                   root 0600  flock: one prolog/epilog per GPU at a time
      gpu<i>/uid<u>/pipe/           user 0700  the daemon's pipe dir (only u can connect)
      gpu<i>/uid<u>/log/            root 0755  control.log, server.log
      gpu<i>/uid<u>/jobs/<jobid>    root 0644  one marker per job using this daemon

One daemon per (GPU, user): MPS runs one server per user per GPU and makes a second
user's clients wait for the first user's to finish. Separate daemons let different
users' jobs share a GPU by time slicing between servers instead of stalling (see
docs/node.md), while each user's own jobs share SMs through one MPS server.

The pipe directory is created root-owned, the daemon started, and only then handed
to the user: the root daemon never writes into a directory a user could have
prepared with symlinks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class TenancyError(RuntimeError):
    """The state directory is not safe to use (wrong owner, a symlink, ...)."""


def ensure_root_dir(path: Path, mode: int = 0o755) -> Path:
    """mkdir that refuses symlinks and foreign owners at the final component."""
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except FileExistsError as e:
        raise TenancyError(f"{path} exists and is not a directory") from e
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise TenancyError(f"{path} is not a directory (symlink?)")
    if st.st_uid != os.geteuid():
        raise TenancyError(f"{path} belongs to uid {st.st_uid}, expected {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode, follow_symlinks=False)
    return path


@dataclass(frozen=True)
class Tenancy:
    """The per-node MPS bookkeeping rooted at ``root`` (``CollocConfig.mps_root``)."""

    root: Path

    def gpu_dir(self, gpu: int) -> Path:
        return self.root / f"gpu{gpu}"

    def user_dir(self, gpu: int, uid: int) -> Path:
        return self.gpu_dir(gpu) / f"uid{uid}"

    def pipe_dir(self, gpu: int, uid: int) -> Path:
        return self.user_dir(gpu, uid) / "pipe"

    def log_dir(self, gpu: int, uid: int) -> Path:
        return self.user_dir(gpu, uid) / "log"

    def job_env_file(self, job_id: int) -> Path:
        return self.root / "jobs" / f"{job_id}.env"

    @contextlib.contextmanager
    def locked(self, gpu: int) -> Iterator[None]:
        """Serialise prolog/epilog work on one GPU (20 jobs may end at once)."""
        ensure_root_dir(self.gpu_dir(gpu))
        fd = os.open(self.gpu_dir(gpu) / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def prepare_user_dirs(self, gpu: int, uid: int) -> tuple[Path, Path]:
        """Fresh root-owned pipe dir (0700) and log dir for a daemon about to start."""
        ensure_root_dir(self.user_dir(gpu, uid))
        pipe = self.pipe_dir(gpu, uid)
        if pipe.is_symlink() or pipe.exists():
            shutil.rmtree(pipe) if pipe.is_dir() and not pipe.is_symlink() else pipe.unlink()
        ensure_root_dir(pipe, 0o700)
        ensure_root_dir(self.log_dir(gpu, uid))
        ensure_root_dir(self.user_dir(gpu, uid) / "jobs")
        return pipe, self.log_dir(gpu, uid)

    def hand_pipe_dir_to(self, gpu: int, uid: int, gid: int) -> None:
        """After the daemon made its socket: let the job's user (only) reach it."""
        os.chown(self.pipe_dir(gpu, uid), uid, gid, follow_symlinks=False)
        for entry in os.scandir(self.pipe_dir(gpu, uid)):
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                os.chown(entry.path, uid, gid, follow_symlinks=False)

    def add_job(self, gpu: int, uid: int, job_id: int) -> None:
        marker = ensure_root_dir(self.user_dir(gpu, uid) / "jobs") / str(job_id)
        marker.write_text(f"{job_id}\n")

    def remove_job(self, job_id: int) -> list[tuple[int, int]]:
        """Drop the job's markers; return the (gpu, uid) daemons it was using."""
        used = []
        for marker in self.root.glob(f"gpu*/uid*/jobs/{job_id}"):
            gpu = int(marker.parents[2].name[3:])
            uid = int(marker.parents[1].name[3:])
            marker.unlink(missing_ok=True)
            used.append((gpu, uid))
        self.job_env_file(job_id).unlink(missing_ok=True)
        return used

    def jobs_of(self, gpu: int, uid: int) -> list[int]:
        d = self.user_dir(gpu, uid) / "jobs"
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []

    def users_on(self, gpu: int) -> list[int]:
        d = self.gpu_dir(gpu)
        if not d.is_dir():
            return []
        return sorted(int(p.name[3:]) for p in d.iterdir() if p.name.startswith("uid"))

    def all_jobs(self) -> dict[int, list[tuple[int, int]]]:
        """Every registered job with its (gpu, uid) daemons."""
        out: dict[int, list[tuple[int, int]]] = {}
        for marker in self.root.glob("gpu*/uid*/jobs/*"):
            if marker.name.isdigit():
                gpu = int(marker.parents[2].name[3:])
                uid = int(marker.parents[1].name[3:])
                out.setdefault(int(marker.name), []).append((gpu, uid))
        return out

    def write_job_env(self, job_id: int, values: dict[str, str]) -> None:
        """What the TaskProlog (running as the user) exports into the job's tasks."""
        ensure_root_dir(self.root / "jobs")
        path = self.job_env_file(job_id)
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in sorted(values.items()))
        os.replace(tmp, path)
