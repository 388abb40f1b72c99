"""The stand-in control program's client mode: stdin commands to the daemon, answers out.

``colloc-sim-mps-control`` without an option forwards each stdin line to the running
daemon and prints its answers, as ``nvidia-cuda-mps-control`` does. Why it stands
alone (issue 28): NVIDIA's client answered the prolog's cap runs in 0.005-0.007 s on an
H200 (``benchmarks/results/hardware/h200_mps_cap.json``); the stand-in's, a Python
interpreter with the package's imports, spent ~0.075 s of CPU per run, and under a
prolog burst on the lab's two cores the GPU's other prologs waited for those runs: the
simulation, not colloc, made the tail. This file therefore imports the standard
library's ``os``, ``socket`` and ``sys`` only, so the launcher (:mod:`.tools`) runs it by
path in an interpreter started without ``site`` (~0.02 s). It speaks the UI half of
the wire :mod:`.mps_protocol` documents (``UI``, a command per line, each answer ended
by NUL, on the daemon's SEQPACKET socket); the constants below are that module's
(a unit test holds them equal).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import TextIO

SOCKET_NAME = "control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
END = b"\0"
MAX_ANSWER = 1 << 20
CONNECT_TIMEOUT_S = 5.0


def _answer(sock: socket.socket, buf: bytearray) -> str:
    """The next NUL-ended answer (consumed from ``buf``, refilled from ``sock``)."""
    while END not in buf:
        if len(buf) > MAX_ANSWER:
            raise OSError("message from MPS daemon too long")
        chunk = sock.recv(65536)
        if not chunk:
            raise OSError("MPS control daemon closed the connection")
        buf += chunk
    answer, _, rest = bytes(buf).partition(END)
    buf[:] = rest
    return answer.decode("utf-8", "replace")


def run_ui(stdin: TextIO, stdout: TextIO) -> int:
    """No option: forward stdin commands to the daemon, print its answers."""
    path = os.path.join(os.environ.get(PIPE_ENV) or DEFAULT_PIPE_DIR, SOCKET_NAME)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(CONNECT_TIMEOUT_S)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        sys.stderr.write("Cannot find MPS control daemon process (cannot connect to MPS "
                         f"control daemon at {path}: {e.strerror or e})\n")
        return 1
    with sock:
        sock.sendall(b"UI\n")
        buf = bytearray()
        for raw in stdin:
            line = raw.strip()
            if not line:
                continue
            try:
                sock.sendall(line.encode() + b"\n")
                answer = _answer(sock, buf)
            except OSError as e:
                sys.stderr.write(f"MPS control daemon connection lost: {e}\n")
                return 1
            if answer:
                stdout.write(answer.rstrip("\n") + "\n")
                stdout.flush()
            if line.split()[0] == "quit":
                break
    return 0


def main() -> int:
    """The launcher's entry when ``colloc-sim-mps-control`` has no argument."""
    return run_ui(sys.stdin, sys.stdout)
