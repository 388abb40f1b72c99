"""The CUDA-client side of MPS as a simjob lives it: connect, maybe wait, get a server.

Real CUDA connects to the control daemon at context creation and blocks there while
another user's server still has clients; a job then looks hung while its time limit
runs. The simjob reproduces that wait (and says what it waits for) so the node
scripts' multi-user policy can be tested against it. A server recovering from a
client's fatal GPU exception refuses new clients of its user: :class:`ServerNotReady`
(CUDA's ``cudaErrorMpsServerNotReady``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

from slurm_colloc.gpu.sim.mps_protocol import (
    NOT_READY,
    SOCKET_NAME,
    ExactLineReader,
    MpsError,
    ServerGrant,
    ServerNotReady,
    connect,
    parse_ready,
)

__all__ = ["MpsError", "ServerNotReady", "Stopped", "daemon_present", "request_server"]


class Stopped(Exception):
    """The caller asked to stop while waiting for a server (SIGTERM)."""


def daemon_present(pipe_dir: Path) -> bool:
    """True if a control socket exists in ``pipe_dir`` (CUDA checks the same)."""
    return (pipe_dir / SOCKET_NAME).exists()


def request_server(
    pipe_dir: Path,
    device: int,
    on_wait: Callable[[int, int, int], None],
    should_stop: Callable[[], bool],
    poll_s: float = 0.2,
) -> tuple[socket.socket, ServerGrant]:
    """Register as a client on ``device``; returns the open connection and the grant.

    ``on_wait(uid, server_pid, n_clients)`` is called for every WAIT the daemon sends.
    Keep the returned socket open for as long as the process uses the GPU: closing it
    is how the daemon learns the client is gone. Nothing after the READY line is
    read, so a later ``FATAL`` is still there for the caller to find.

    Raises :class:`ServerNotReady` if the daemon answers ``NOTREADY`` (the server is
    recovering from a fatal GPU exception), :class:`Stopped` if ``should_stop()``
    turns true while waiting, :class:`MpsError` on anything else unexpected.
    """
    sock = connect(pipe_dir)
    try:
        sock.sendall(f"CLIENT {device}\n".encode())
        sock.settimeout(poll_s)
        reader = ExactLineReader(sock)
        while True:
            if should_stop():
                raise Stopped
            try:
                line = reader.read_line()
            except TimeoutError:
                continue
            if line is None:
                raise MpsError("MPS control daemon closed the connection before granting a server")
            words = line.split()
            if words == [NOT_READY]:
                raise ServerNotReady(
                    "MPS server is not ready to accept new MPS client requests "
                    "(it is recovering from a fatal GPU exception)"
                )
            if words and words[0] == "WAIT" and len(words) == 4:
                on_wait(int(words[1]), int(words[2]), int(words[3]))
                continue
            grant = parse_ready(line)
            sock.settimeout(None)
            return sock, grant
    except BaseException:
        sock.close()
        raise
