"""State of the simulated MPS control daemon: its servers, their clients, its logs.

Plain data and the log files, apart from the event loop (:mod:`.mps_control`) and
the UI commands (:mod:`.mps_commands`), so each of the three reads on its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from slurm_colloc.gpu.sim.mps_protocol import FAULT, MAX_LINE


def log_line(kind: str, pid: int, msg: str) -> str:
    """One log line in the real daemon's format, stamped now.

    ``[2013-08-05 12:50:23.347 Control 13894] Starting new server 13929 for user 500``
    """
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    return f"[{stamp}.{int(now * 1000) % 1000:03d} {kind} {pid}] {msg}\n"


class ControlLog:
    """``control.log`` / ``server.log``, lines as :func:`log_line` writes them."""

    def __init__(self, log_dir: Path) -> None:
        """Open (append) both logs in ``log_dir``."""
        log_dir.mkdir(parents=True, exist_ok=True)
        self.control = open(log_dir / "control.log", "a", buffering=1)  # noqa: SIM115
        self.server = open(log_dir / "server.log", "a", buffering=1)  # noqa: SIM115

    def ctl(self, msg: str) -> None:
        """A control daemon event."""
        self.control.write(log_line("Control", os.getpid(), msg))

    def srv(self, server_pid: int, msg: str) -> None:
        """An event of one server (new client, client gone)."""
        self.server.write(log_line("Server", server_pid, msg))

    def close(self) -> None:
        """Flush and close both files."""
        self.control.close()
        self.server.close()


@dataclass
class Client:
    """A CUDA client connection (a simjob)."""

    conn: socket.socket
    pid: int
    uid: int
    device: int
    buf: bytes = b""  # a partial line the client sent after READY

    def take_faults(self, data: bytes) -> int:
        """Buffer ``data``: how many ``FAULT`` lines it completes (no other line means anything)."""
        self.buf += data
        faults = 0
        while b"\n" in self.buf:
            raw, self.buf = self.buf.split(b"\n", 1)
            if raw.decode("utf-8", "replace").split() == [FAULT]:
                faults += 1
        if len(self.buf) > MAX_LINE:
            self.buf = b""
        return faults


@dataclass
class Server:
    """One MPS server (one UID)."""

    uid: int
    proc: subprocess.Popen[bytes]
    active_thread_pct: float
    limits: dict[int | None, int]
    clients: list[Client] = field(default_factory=list)
    terminating: bool = False
    faulted: bool = False  # a client hit a fatal GPU exception; recovering until empty

    @property
    def pid(self) -> int:
        """The server process's PID (what ``get_server_list`` prints)."""
        return self.proc.pid
