"""Drive one MPS control daemon: start it, send it commands, stop it.

The same code drives the real ``nvidia-cuda-mps-control`` and the simulation's
stand-in; only the binary in ``CollocConfig.mps_control`` differs. Commands go over
the program's stdin exactly as an admin would type them, never through a shell.

One daemon serves one (GPU, user) pair, with its own pipe and log directory (see
:mod:`slurm_colloc.mps.layout`): the pipe directory belongs to the user and is 0700,
so no other user's process can even reach the daemon.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_SOCKET = "control"


class MpsControlError(RuntimeError):
    """The control daemon could not be started or did not answer."""


@dataclass(frozen=True)
class MpsDaemon:
    """Handle on the control daemon of one pipe directory."""

    binary: str
    gpu: int
    pipe_dir: Path
    log_dir: Path

    def _env(self) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "CUDA_VISIBLE_DEVICES": str(self.gpu),
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    def pid(self) -> int | None:
        """Pid of the running daemon, None if it is not running (stale files ignored)."""
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return None
        except (OSError, IndexError):
            return None
        return pid

    def running(self) -> bool:
        """True when the daemon answers on its control socket."""
        return self.pid() is not None and (self.pipe_dir / CONTROL_SOCKET).exists()

    def start(self, timeout: float = 10) -> None:
        """Start the daemon (``-d``) unless it runs; wait until it accepts commands."""
        if self.running():
            return
        with contextlib.suppress(FileNotFoundError):
            (self.pipe_dir / CONTROL_SOCKET).unlink()
        try:
            cp = subprocess.run(
                [self.binary, "-d"], env=self._env(), capture_output=True, text=True,
                timeout=timeout, check=False, stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsControlError(f"{self.binary} -d: {e}") from e
        if cp.returncode != 0:
            raise MpsControlError(
                f"{self.binary} -d exited {cp.returncode}: {cp.stderr.strip()[:500]}"
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.running():
                return
            time.sleep(0.02)
        raise MpsControlError(
            f"MPS control daemon for GPU {self.gpu} did not come up in {timeout}s"
        )

    def command(self, *lines: str, timeout: float = 10) -> str:
        """Send commands on stdin (one per line); return what the daemon printed."""
        try:
            cp = subprocess.run(
                [self.binary], input="".join(f"{ln}\n" for ln in lines), env=self._env(),
                capture_output=True, text=True, timeout=timeout, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsControlError(f"{self.binary}: {e}") from e
        if cp.returncode != 0:
            raise MpsControlError(f"{self.binary}: {'; '.join(lines)}: {cp.stderr.strip()[:500]}")
        return cp.stdout

    def set_defaults(self, limit_mib: int | None, thread_pct: int) -> None:
        """Default pinned memory limit (device 0 = the one visible GPU) and SM share."""
        lines = []
        if limit_mib:
            lines.append(f"set_default_device_pinned_mem_limit 0 {limit_mib}M")
        if thread_pct:
            lines.append(f"set_default_active_thread_percentage {thread_pct}")
        if lines:
            self.command(*lines)

    def server_pids(self) -> list[int]:
        """``get_server_list``: pids of the MPS servers this daemon runs."""
        return [int(t) for t in self.command("get_server_list").split() if t.isdigit()]

    def stop(self, timeout: float = 10) -> None:
        """``quit``, then SIGTERM/SIGKILL if the daemon ignores it; idempotent."""
        pid = self.pid()
        if pid is None:
            self._remove_socket()
            return
        with contextlib.suppress(MpsControlError):
            self.command("quit", timeout=timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.pid() is not None:
            time.sleep(0.05)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.pid() is None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            time.sleep(0.3)
        self._remove_socket()

    def _remove_socket(self) -> None:
        for name in (CONTROL_SOCKET, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                (self.pipe_dir / name).unlink()
