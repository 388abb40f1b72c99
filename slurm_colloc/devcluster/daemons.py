"""Start, check and stop the devcluster's daemons by pid file.

Only processes whose pid file we wrote (or the daemon wrote where we told it to) are
ever signalled, and only if the pid still runs the expected executable, so ``down``
never kills a host daemon or a recycled pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class DaemonError(RuntimeError):
    """A daemon did not come up; the message names it and its log file."""


@dataclass(frozen=True)
class Daemon:
    """One daemon of the devcluster."""

    name: str
    argv: tuple[str, ...]
    pid_file: Path
    log_file: Path
    exe_name: str
    """Basename the running process must have (checked in /proc before signalling)."""
    foreground: bool = False
    """True: we background it ourselves and write the pid file."""
    user: str | None = None
    capture_file: Path | None = None
    """Where the daemon's stdout/stderr go if not into ``log_file`` (munged insists on
    owning its log file)."""
    extra_env: tuple[tuple[str, str], ...] = ()
    """Variables set for this daemon only (slurmdbd's MariaDB client library on
    Debian 13 and newer, see :mod:`slurm_colloc.devcluster.rootfs`)."""


def read_pid(pid_file: Path) -> int | None:
    """The pid in a pid file, or None when absent or unreadable."""
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def pid_runs(pid: int, exe_name: str) -> bool:
    """True if ``pid`` is alive and its command is ``exe_name`` (not a recycled pid)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        return False
    return comm == exe_name[:15] or os.path.basename(cmdline) == exe_name


def running(d: Daemon) -> int | None:
    """The daemon's pid if it is running, else None."""
    pid = read_pid(d.pid_file)
    return pid if pid is not None and pid_runs(pid, d.exe_name) else None


def log_tail(path: Path, lines: int = 15) -> str:
    """The end of a log file, for error messages (bounded read)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:])


def start(d: Daemon, env: dict[str, str], ready: Callable[[], bool], timeout: float = 30) -> int:
    """Start ``d`` and wait until ``ready()``; raise DaemonError naming its log if not."""
    d.log_file.parent.mkdir(parents=True, exist_ok=True)
    argv: list[str] = list(d.argv)
    if d.user:
        argv = ["runuser", "-u", d.user, "--", *argv]
    capture = d.capture_file or d.log_file
    capture.parent.mkdir(parents=True, exist_ok=True)
    with capture.open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, **dict(d.extra_env)},
            start_new_session=True,
        )
    if d.foreground:
        d.pid_file.parent.mkdir(parents=True, exist_ok=True)
        d.pid_file.write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not d.foreground and proc.poll() not in (None, 0):
            break
        if d.foreground and proc.poll() is not None:
            break
        pid = running(d)
        if pid is not None and ready():
            return pid
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        if proc.poll() is None:
            proc.kill()
    stop(d)
    raise DaemonError(
        f"{d.name} did not start (exit {proc.poll()}); see its log {d.log_file}:\n"
        f"{log_tail(d.log_file)}\n{log_tail(d.capture_file) if d.capture_file else ''}".rstrip()
    )


def stop(d: Daemon, timeout: float = 15) -> bool:
    """SIGTERM then SIGKILL the daemon if it is ours and running; True if it was."""
    pid = running(d)
    if pid is None:
        with contextlib.suppress(OSError):
            d.pid_file.unlink()
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_runs(pid, d.exe_name):
        time.sleep(0.1)
    if pid_runs(pid, d.exe_name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    with contextlib.suppress(OSError):
        d.pid_file.unlink()
    return True


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if nothing listens on ``host:port`` (bind test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """True if something accepts connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect((host, port))
        except OSError:
            return False
    return True


def unix_socket_open(path: Path) -> bool:
    """True if something accepts connections on a Unix socket (not a stale file)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()[:4096]
    except OSError:
        return b""


def cluster_processes(conf_var: str, conf_path: str, root: str) -> list[int]:
    """Pids that belong to one devcluster's jobs: never the user's own shell.

    A process counts when its environment names this cluster's config *and* it is a
    job process (``SLURM_JOB_ID`` set), a slurmstepd, the node's metrics collector
    (started by a prolog, it would outlive the cluster by ``collector_idle_exit_s``) or
    its script server (likewise, ``script_server_idle_s``),
    or when it is an MPS daemon whose pipe directory lies under the cluster's root.
    """
    needle = f"{conf_var}={conf_path}".encode()
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        ours = needle in env
        is_job = any(v.startswith(b"SLURM_JOB_ID=") for v in env) or comm == "slurmstepd"
        mps = any(v.startswith(b"CUDA_MPS_PIPE_DIRECTORY=" + root.encode()) for v in env)
        cmd = _cmdline(entry) if ours else b""
        collector = (b"slurm_colloc.metrics.collector" in cmd
                     or b"slurm_colloc.node.script_server" in cmd)
        if (ours and is_job) or mps or collector:
            found.append(int(entry.name))
    return found
