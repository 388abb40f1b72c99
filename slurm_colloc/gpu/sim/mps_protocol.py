"""The wire between the MPS stand-in daemon and its clients (UI and CUDA clients).

The real ``nvidia-cuda-mps-control`` listens on a UNIX socket named ``control`` in
``CUDA_MPS_PIPE_DIRECTORY``; CUDA programs and the interactive control program both
connect there. The stand-in does the same with a small line protocol:

* first line ``UI``: then one command per line; each answer is its text followed by
  a NUL byte (so an empty answer is just ``\\0``).
* first line ``CLIENT <device>``: a CUDA client (a simjob) asking for an MPS
  server. The daemon answers ``WAIT <uid> <server_pid> <n_clients>`` lines while
  another user's server still has clients, then ``READY <server_pid> <limit_mib|->
  <active_thread_pct> <visible|->``. The client keeps the connection open for its
  lifetime; the daemon learns of its end (even SIGKILL) when the socket closes. The
  client's uid and pid come from ``SO_PEERCRED``, never from the client's word.
  ``<device>`` is the device as the server numbers it (below); the limit is that
  device's.

Device remapping: the MPS server sees the devices of the control daemon's
``CUDA_VISIBLE_DEVICES`` (as it was when the daemon started) and numbers them from
0; a client's ``CUDA_VISIBLE_DEVICES`` then selects among *those* (NVIDIA's MPS
documentation: a daemon started with ``0,2`` gives clients devices 0 and 1, so a
client keeping ``0,2`` fails). ``<visible>`` is the daemon's raw value, whitespace
removed, so that the client can resolve it: ``-`` when unset (every device), ``,``
when set but empty (no device). A four-field READY (an older daemon) means ``-``.

Fatal GPU exceptions (error containment of Volta and later MPS): after READY a
client may send the line ``FAULT``: it hit a fatal GPU exception (an illegal memory
access, a device-side assert). The daemon then marks that client's server faulted
and sends ``FATAL`` to every *other* client of the server (the real MPS reports the
exception to all clients of the server on that GPU and does not say whose it was;
the faulting client knows already). A client must exit on ``FATAL``. While the
server is faulted, a new ``CLIENT <device>`` connection of the server's user is
answered ``NOTREADY`` and closed (CUDA's ``cudaErrorMpsServerNotReady``); a client of
another user is answered ``WAIT`` as usual. When the faulted server's last client
has disconnected, the daemon logs the recovery and clears the fault; the server
keeps running and accepts clients again. Other daemons (other GPUs) are unaffected.
The daemon ignores any other line a client sends.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

SOCKET_NAME = "control"
PID_FILE = "nvidia-cuda-mps-control.pid"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
DEFAULT_LOG_DIR = "/var/log/nvidia-mps"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
END = b"\0"
MAX_LINE = 4096
FAULT = "FAULT"
FATAL = "FATAL"
NOT_READY = "NOTREADY"


class MpsError(RuntimeError):
    """The MPS stand-in cannot be reached or answered nonsense."""


class ServerNotReady(MpsError):
    """The user's MPS server is recovering from a fatal GPU exception (``NOTREADY``).

    CUDA returns ``cudaErrorMpsServerNotReady`` (807) to a new client in that state.
    """


def pipe_dir_from_env() -> Path:
    """``CUDA_MPS_PIPE_DIRECTORY`` or the real default ``/tmp/nvidia-mps``."""
    return Path(os.environ.get(PIPE_ENV) or DEFAULT_PIPE_DIR)


def log_dir_from_env() -> Path:
    """``CUDA_MPS_LOG_DIRECTORY`` or the real default ``/var/log/nvidia-mps``."""
    return Path(os.environ.get(LOG_ENV) or DEFAULT_LOG_DIR)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a UNIX socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


SOCKET_TYPE = socket.SOCK_SEQPACKET
"""The control socket's type: NVIDIA's daemon listens on a SEQPACKET socket (an H100,
driver 580: ``/proc/net/unix`` type 0005; a stream connect fails with EPROTOTYPE).
Every message the stand-in sends is one record of whole lines, so the readers below
work unchanged; root's identity check (``slurm_colloc.mps.control``) must speak it."""


def connect(pipe_dir: Path, timeout: float = 5.0) -> socket.socket:
    """Connect to the daemon's control socket in ``pipe_dir``."""
    path = pipe_dir / SOCKET_NAME
    sock = socket.socket(socket.AF_UNIX, SOCKET_TYPE)
    sock.settimeout(timeout)
    try:
        sock.connect(os.fspath(path))
    except OSError as e:
        sock.close()
        raise MpsError(f"cannot connect to MPS control daemon at {path}: {e.strerror or e}") from e
    return sock


class LineReader:
    """Buffered reads of ``\\n``- or NUL-terminated messages from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        """Wrap ``sock``; the caller keeps ownership."""
        self.sock = sock
        self.buf = b""

    def read_until(self, sep: bytes) -> str | None:
        """Next message up to ``sep`` (without it); None at EOF."""
        while sep not in self.buf:
            if len(self.buf) > 1 << 20:
                raise MpsError("message from MPS daemon too long")
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        msg, self.buf = self.buf.split(sep, 1)
        return msg.decode("utf-8", "replace")


class ExactLineReader:
    """``\\n``-terminated lines from a socket, never reading past the line returned.

    A CUDA client keeps its connection after the handshake and later watches it for
    ``FATAL``; anything the daemon sent after READY must still be in the socket then,
    not in a reader's buffer. Lines are found with ``MSG_PEEK`` and only their bytes
    are consumed. A socket timeout (``TimeoutError``) keeps a partial line for the
    next call.
    """

    def __init__(self, sock: socket.socket) -> None:
        """Wrap ``sock``; the caller keeps ownership."""
        self.sock = sock
        self.partial = b""

    def read_line(self) -> str | None:
        """Next line (without ``\\n``); None at EOF."""
        while True:
            peek = self.sock.recv(MAX_LINE, socket.MSG_PEEK)
            if not peek:
                return None
            nl = peek.find(b"\n")
            want = len(peek) if nl < 0 else nl + 1
            while want > 0:  # peeked bytes are queued: these reads do not block
                chunk = self.sock.recv(want)
                if not chunk:
                    return None
                self.partial += chunk
                want -= len(chunk)
            if nl >= 0:
                line, self.partial = self.partial[:-1], b""
                return line.decode("utf-8", "replace")
            if len(self.partial) > MAX_LINE:
                raise MpsError("message from MPS daemon too long")


def ui_command(sock: socket.socket, reader: LineReader, command: str) -> str:
    """Send one UI command on an open ``UI`` connection and return the answer text."""
    sock.sendall(command.encode() + b"\n")
    answer = reader.read_until(END)
    if answer is None:
        raise MpsError("MPS control daemon closed the connection")
    return answer


@dataclass(frozen=True)
class ServerGrant:
    """What a CUDA client learns when its MPS server is ready."""

    server_pid: int
    limit_mib: int | None
    active_thread_pct: float
    visible_devices: str | None = None
    """The daemon's ``CUDA_VISIBLE_DEVICES`` (None: unset, the server sees every GPU)."""


def encode_visible(value: str | None) -> str:
    """The READY field for a daemon's ``CUDA_VISIBLE_DEVICES`` (see the module doc)."""
    if value is None:
        return "-"
    packed = "".join(value.split())
    return packed or ","


def decode_visible(field: str) -> str | None:
    """Inverse of :func:`encode_visible` (``,`` comes back as the empty value)."""
    if field == "-":
        return None
    return "" if field == "," else field


def format_ready(server_pid: int, limit_mib: int | None, pct: float, visible: str | None) -> str:
    """The READY line (without its newline) a daemon sends a client it grants."""
    limit = "-" if limit_mib is None else str(limit_mib)
    return f"READY {server_pid} {limit} {pct:g} {encode_visible(visible)}"


def parse_ready(line: str) -> ServerGrant:
    """Parse ``READY <server_pid> <limit_mib|-> <pct> [<visible|->]``."""
    parts = line.split()
    if len(parts) not in (4, 5) or parts[0] != "READY":
        raise MpsError(f"unexpected answer from MPS daemon: {line!r}")
    try:
        limit = None if parts[2] == "-" else int(parts[2])
        visible = decode_visible(parts[4]) if len(parts) == 5 else None
        return ServerGrant(int(parts[1]), limit, float(parts[3]), visible)
    except ValueError:
        raise MpsError(f"unexpected answer from MPS daemon: {line!r}") from None
