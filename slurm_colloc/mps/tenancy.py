"""Which jobs use which MPS daemon, on disk under ``mps_root`` (root-owned).

::

    mps_root/                       root 0755
      jobs/<jobid>.env              uid 0400  what the TaskProlog (the job's user) exports
      ctx/<jobid>.json              root 0600  the prolog's job context, for the epilog
      ctx/<jobid>.env               root 0600  root's copy of the above (limits root sums)
      quarantine/                   root 0700  retired pipe dirs, until purged
      gpu<i>/lock                   root 0600  flock: one prolog/epilog per GPU at a time
      gpu<i>/uid<u>/daemon.json     root 0600  the daemon's identity (pid, start time)
      gpu<i>/uid<u>/cap.lock        root 0600  flock: one server-cap commit at a time
      gpu<i>/uid<u>/cap.want        root 0600  registrations so far (a counter)
      gpu<i>/uid<u>/cap.done        root 0600  the counter the server cap last covered
      gpu<i>/uid<u>/pipe/           user 0700  the daemon's pipe dir (only u can connect)
      gpu<i>/uid<u>/log/            root:gid 0750  control.log, server.log
      gpu<i>/uid<u>/jobs/<jobid>    root 0644  one marker per job using this daemon
      gpu<i>/uid<u>/absent/<jobid>  root 0644  first time the controller did not list it

Modes are set explicitly (chmod after create), never left to the umask: under umask
077 a 0644 job file became 0600 and the TaskProlog, which runs as the user, silently
exported nothing. Nothing here is read from the user's pipe directory: the daemon's
identity lives in ``daemon.json`` (:mod:`slurm_colloc.mps.control`).

One daemon per (GPU, user): MPS runs one server per user per GPU and makes a second
user's clients wait for the first user's to finish. Separate daemons let different
users' jobs share a GPU by time slicing between servers instead of stalling (see
docs/node.md), while each user's own jobs share SMs through one MPS server.

The pipe directory is created root-owned, the daemon started, and only then handed
to the user: the root daemon never writes into a directory a user could have
prepared with symlinks.

The pipe directory is the one user-writable tree under ``mps_root``. It is retired
(:meth:`Tenancy.retire_pipe_dir`: one ``rename`` into the root-only quarantine, under
the GPU lock) when the user's last job on that GPU ends and before it is made anew,
and the quarantine is purged outside the lock with a bounded, non-following,
iterative walk (:mod:`slurm_colloc.safe_tree`): nothing the user planted survives,
and no tree the user built can stop or stall a prolog.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from slurm_colloc import priority, safe_tree, waits

LOCK_TIMEOUT_S = 60.0
"""Longest a prolog/epilog waits for a GPU's lock; every holder's work is bounded
(MPS commands 10 s each, no controller calls under the lock), so a longer wait means
a stuck holder: the waiter gives up (the job runs without MPS) instead of hanging."""


class TenancyError(RuntimeError):
    """The state directory is not safe to use (wrong owner, a symlink, ...)."""


def ensure_root_dir(path: Path, mode: int = 0o755) -> Path:
    """mkdir that refuses symlinks and foreign owners at the final component.

    Missing parents are made 0755 explicitly: ``mkdir(parents=True)`` would give
    them the umask's mode (0700 under umask 077, which locks the users out).
    """
    missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    for parent in reversed(missing[1:]):
        with contextlib.suppress(FileExistsError):
            parent.mkdir()
            os.chmod(parent, 0o755, follow_symlinks=False)  # noqa: S103 - traversable by jobs
    try:
        path.mkdir(mode=mode, exist_ok=True)
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


@contextlib.contextmanager
def _flocked(path: Path, what: str, timeout: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on root's ``path``; TenancyError after ``timeout``.

    The wait blocks in the kernel (:func:`_wait_flock`), not in a sleep loop: under a
    burst tens of prologs wait for one GPU, and 20 wake-ups a second each cost the
    node's CPUs, and the holder's, for nothing (issue 28: prolog p99 under a burst).
    The holder runs at a raised priority (:mod:`slurm_colloc.priority`): the waiters'
    wall time is its wall time.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        # raised while it waits too: blocked in the kernel it costs no CPU, and when the
        # holder lets go it runs at once instead of queueing at the scripts' priority
        # behind a burst's other prologs (issue 28: ten waiters of one GPU lock took
        # 0.1-0.2 s each to wake and take it, 1.2 s for the last)
        with priority.boosted():  # others wait for this holder (issue 28)
            with waits.timed(_wait_name(what)):
                taken = _wait_flock(fd, timeout)
            if not taken:
                raise TenancyError(
                    f"{what}: lock held for over {timeout:.0f}s by another prolog/epilog")
            # how long this holder kept the others waiting ("gpu held"), in the log line
            with waits.timed(_wait_name(what).replace(" lock", " held")):
                yield
    finally:
        os.close(fd)


def _wait_name(what: str) -> str:
    """The tally's name of a lock's wait: ``GPU 0`` -> "gpu lock", ``GPU 0 user 5 cap``
    -> "cap lock", the node's -> "node lock" (per kind, not per GPU)."""
    if what.endswith(" cap"):
        return "cap lock"
    return "gpu lock" if what.startswith("GPU ") else "node lock"


class _LockTimeout(Exception):
    """Raised by the alarm handler of :func:`_wait_flock` only."""


def _wait_flock(fd: int, timeout: float) -> bool:
    """Take ``fd``'s exclusive flock within ``timeout`` s; False when it was not taken.

    A blocking ``flock`` bounded by a one-shot interval timer (SIGALRM), in the main
    thread when no other timer runs (the node scripts); elsewhere a sleep loop.
    The handler raises only while the wait is on: a timer that fires as the lock is
    taken makes this answer False, and the caller's close releases the lock.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    if (threading.current_thread() is not threading.main_thread()
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0):
        return _poll_flock(fd, timeout)
    waiting = [True]

    def on_alarm(signum: int, frame: object) -> None:
        if waiting[0]:
            raise _LockTimeout

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, max(timeout, 0.001))
        fcntl.flock(fd, fcntl.LOCK_EX)
        waiting[0] = False
        return True
    except _LockTimeout:
        return False
    finally:
        waiting[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _poll_flock(fd: int, timeout: float) -> bool:
    """The sleep-loop wait, for callers outside the main thread."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def private_group(uid: int) -> int | None:
    """The user's primary gid when it is a group of that user alone, else None.

    Group-readable state (the MPS logs) is readable by the user's group: only a
    private group ("user private groups", Debian's default) keeps it the user's.
    """
    import grp
    import pwd

    try:
        pw = pwd.getpwuid(uid)
        gr = grp.getgrgid(pw.pw_gid)
    except KeyError:
        return None
    others = [m for m in gr.gr_mem if m != pw.pw_name]
    return pw.pw_gid if gr.gr_name == pw.pw_name and not others else None


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

    def job_context_file(self, job_id: int) -> Path:
        return self.root / "ctx" / f"{job_id}.json"

    def job_limits_file(self, job_id: int) -> Path:
        """Root's own copy of the job's env file: the one root reads back."""
        return self.root / "ctx" / f"{job_id}.env"

    @property
    def quarantine_dir(self) -> Path:
        return self.root / "quarantine"

    def daemon_state(self, gpu: int, uid: int) -> Path:
        return self.user_dir(gpu, uid) / "daemon.json"

    @contextlib.contextmanager
    def locked(self, gpu: int, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
        """Serialise prolog/epilog work on one GPU (20 jobs may end at once).

        Bounded: raises TenancyError after ``timeout`` s instead of blocking slurmd.
        """
        ensure_root_dir(self.gpu_dir(gpu))
        with _flocked(self.gpu_dir(gpu) / "lock", f"GPU {gpu}", timeout):
            yield

    @contextlib.contextmanager
    def locked_node(self, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
        """Serialise work on the node's one MPS v3 daemon (start, namespaces).

        Taken before any GPU lock, never inside one (one lock order: no deadlock).
        """
        ensure_root_dir(self.root)
        with _flocked(self.root / "node.lock", "the node's MPS v3 daemon", timeout):
            yield

    @contextlib.contextmanager
    def cap_locked(self, gpu: int, uid: int, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
        """Serialise the (GPU, user) daemon's start and server-cap commits
        (:mod:`slurm_colloc.node.user_cap`), and its stop.

        A prolog takes it without the GPU lock held; what stops the daemon (the epilog,
        reaping) takes it under the GPU lock. No GPU lock is ever taken under it (one
        order: no deadlock).
        """
        ensure_root_dir(self.user_dir(gpu, uid))
        with _flocked(self.user_dir(gpu, uid) / "cap.lock", f"GPU {gpu} user {uid} cap",
                      timeout):
            yield

    def read_counter(self, gpu: int, uid: int, name: str) -> int:
        """Root's counter ``cap.<name>`` of (GPU, user); 0 when missing or unreadable."""
        from slurm_colloc.mps.control import read_small_file

        try:
            text = read_small_file(self.user_dir(gpu, uid) / f"cap.{name}", owner=os.geteuid(),
                                   limit=64).strip()
        except OSError:
            return 0
        return int(text) if text.isdigit() and len(text) < 19 else 0

    def write_counter(self, gpu: int, uid: int, name: str, value: int) -> None:
        """Write root's counter ``cap.<name>`` atomically (root 0600)."""
        d = ensure_root_dir(self.user_dir(gpu, uid))
        _write_root_file(d / f"cap.{name}", f"{value}\n", 0o600, 0)

    def prepare_user_dirs(self, gpu: int, uid: int) -> tuple[Path, Path]:
        """Fresh root-owned pipe dir (0700) and log dir for a daemon about to start.

        Under the GPU lock: whatever the old pipe dir holds is only renamed into the
        quarantine (O(1)); the caller purges it after the lock (:meth:`purge_quarantine`).
        """
        ensure_root_dir(self.user_dir(gpu, uid))
        self.retire_pipe_dir(gpu, uid)
        pipe = ensure_root_dir(self.pipe_dir(gpu, uid), 0o700)
        private = private_group(uid)
        log = ensure_root_dir(self.log_dir(gpu, uid), 0o750 if private is not None else 0o700)
        if private is not None:
            os.chown(log, os.geteuid(), private, follow_symlinks=False)
        ensure_root_dir(self.user_dir(gpu, uid) / "jobs")
        return pipe, log

    def retire_pipe_dir(self, gpu: int, uid: int) -> bool:
        """Move the (GPU, user) pipe dir, whatever it holds, into root's quarantine.

        One ``rename`` (never a walk: safe under the GPU lock); the user can reach
        nothing in it afterwards. Call when the user's daemon on that GPU is stopped.
        True when there was something to move.
        """
        pipe = self.pipe_dir(gpu, uid)
        if not os.path.lexists(pipe):
            return False
        ensure_root_dir(self.root)
        try:
            return safe_tree.quarantine(pipe, self.quarantine_dir,
                                        f"pipe-gpu{gpu}-uid{uid}") is not None
        except (OSError, safe_tree.UnsafeTree) as e:
            raise TenancyError(f"{pipe} could not be retired: {e}") from e

    def purge_quarantine(self, max_entries: int = safe_tree.MAX_ENTRIES,
                         max_seconds: float = safe_tree.MAX_SECONDS) -> safe_tree.Purge:
        """Remove retired pipe dirs, bounded; never under a GPU lock; never raises.

        What one pass leaves is finished by a detached purger (one at a time).
        """
        if not os.path.lexists(self.quarantine_dir):
            return safe_tree.Purge()
        try:
            done = safe_tree.purge(self.quarantine_dir, max_entries=max_entries,
                                   max_seconds=max_seconds)
        except (OSError, safe_tree.UnsafeTree) as e:
            return safe_tree.Purge(left=True, errors=[f"{self.quarantine_dir}: {e}"])
        if done.left and not done.busy:
            try:
                safe_tree.spawn(self.quarantine_dir)
            except OSError as e:
                done.note(f"detached purge not started: {e}")
        return done

    def hand_pipe_dir_to(self, gpu: int, uid: int, gid: int) -> None:
        """After the daemon made its socket: let the job's user (only) reach it.

        The sockets are handed over first, while the directory is still root's (so
        nothing in it can have been put there by the user: a hard link to another
        service's root socket would otherwise be chowned to the user), and only
        sockets root's daemon made (root-owned, one link).
        """
        pipe = self.pipe_dir(gpu, uid)
        for entry in os.scandir(pipe):
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1:
                os.chown(entry.path, uid, gid, follow_symlinks=False)
        os.chown(pipe, uid, gid, follow_symlinks=False)

    def add_job(self, gpu: int, uid: int, job_id: int) -> None:
        marker = ensure_root_dir(self.user_dir(gpu, uid) / "jobs") / str(job_id)
        marker.write_text(f"{job_id}\n")
        self.clear_absent(gpu, uid, job_id)

    def registered_at(self, gpu: int, uid: int, job_id: int) -> float:
        """When the job's marker was written (its prolog); +inf when it has none."""
        try:
            return (self.user_dir(gpu, uid) / "jobs" / str(job_id)).lstat().st_mtime
        except OSError:
            return float("inf")

    def absent_since(self, gpu: int, uid: int, job_id: int, now: float) -> float:
        """When the controller first failed to list this registered job (records now)."""
        d = ensure_root_dir(self.user_dir(gpu, uid) / "absent")
        path = d / str(job_id)
        try:
            return float(path.read_text()[:32])
        except (OSError, ValueError):
            path.write_text(f"{now}\n")
            return now

    def clear_absent(self, gpu: int, uid: int, job_id: int) -> None:
        with contextlib.suppress(OSError):
            (self.user_dir(gpu, uid) / "absent" / str(job_id)).unlink()

    def remove_job(self, job_id: int) -> list[tuple[int, int]]:
        """Drop the job's markers; return the (gpu, uid) daemons it was using."""
        used = []
        for marker in self.root.glob(f"gpu*/uid*/jobs/{job_id}"):
            gpu = int(marker.parents[2].name[3:])
            uid = int(marker.parents[1].name[3:])
            marker.unlink(missing_ok=True)
            self.clear_absent(gpu, uid, job_id)
            used.append((gpu, uid))
        self.forget_job_env(job_id)
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

    def write_job_env(self, job_id: int, values: dict[str, str], uid: int = 0,
                      gid: int = 0) -> None:
        """What the TaskProlog (running as the job's user) exports into its tasks.

        ``jobs/<id>.env`` is the user's (uid:gid 0400): only the job's owner (and root)
        reads it, not the owner's group, nor other users, who would learn each other's
        pipe directories and limits. Being the user's, it may be rewritten by the user,
        so root never reads it back: root keeps its own copy (:meth:`job_limits_file`,
        root 0600) for the sums it makes (``user_total_mib``).
        """
        ensure_root_dir(self.root / "jobs")
        ensure_root_dir(self.root / "ctx", 0o700)
        text = "".join(f"{k}={v}\n" for k, v in sorted(values.items()))
        _write_root_file(self.job_limits_file(job_id), text, 0o600, 0)
        _write_root_file(self.job_env_file(job_id), text, 0o400, gid, uid)

    def read_job_limits(self, job_id: int) -> str | None:
        """Root's copy of the job's env values (or, from a version that kept only the
        shared file, that file while it is still root's); None when there is none."""
        from slurm_colloc.mps.control import read_small_file

        for path in (self.job_limits_file(job_id), self.job_env_file(job_id)):
            try:
                return read_small_file(path, owner=os.geteuid(), limit=8192)
            except OSError:
                continue
        return None

    def forget_job_env(self, job_id: int) -> None:
        """Remove both env files of the job (by name: the user cannot swap ours)."""
        for path in (self.job_env_file(job_id), self.job_limits_file(job_id)):
            with contextlib.suppress(OSError):
                path.unlink()

    def write_job_context(self, job_id: int, text: str) -> None:
        """The prolog's job context for the epilog (root 0600)."""
        ensure_root_dir(self.root / "ctx", 0o700)
        _write_root_file(self.job_context_file(job_id), text, 0o600, 0)

    def read_job_context(self, job_id: int) -> str | None:
        """The saved context, or None (no prolog ran here, or it is not root's file)."""
        from slurm_colloc.mps.control import read_small_file

        try:
            return read_small_file(self.job_context_file(job_id), limit=1 << 16)
        except OSError:
            return None

    def forget_job_context(self, job_id: int) -> None:
        with contextlib.suppress(OSError):
            self.job_context_file(job_id).unlink()


def _write_root_file(path: Path, text: str, mode: int, gid: int, uid: int | None = None) -> None:
    """Atomic write with an explicit mode, owner and group (umask-proof, no link followed).

    ``uid``: the file's owner (default: root). The temporary file is made in root's
    directory and only then given away: the new owner never sees a half-written file.
    """
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fchmod(f.fileno(), mode)
        os.fchown(f.fileno(), os.geteuid() if uid is None else uid, gid)
    os.replace(tmp, path)
