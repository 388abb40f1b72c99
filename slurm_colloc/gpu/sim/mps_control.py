"""``colloc-sim-mps-control``: a stand-in for ``nvidia-cuda-mps-control``.

Same command line and stdin interface as the real program, so the prolog/epilog
drive it exactly as they drive the real one (only ``mps_control`` in the config
changes):

* ``-d`` daemonises (``-f`` stays in the foreground), using
  ``CUDA_MPS_PIPE_DIRECTORY`` for the ``control`` socket and
  ``nvidia-cuda-mps-control.pid``, and ``CUDA_MPS_LOG_DIRECTORY`` for
  ``control.log`` and ``server.log`` (real defaults ``/tmp/nvidia-mps`` and
  ``/var/log/nvidia-mps``). ``-d`` returns once the socket accepts connections.
* Without options it forwards each stdin line to the running daemon and prints the
  answers: ``get_server_list``, ``get_client_list PID``, ``get_server_status PID``,
  ``start_server -uid UID``, ``shutdown_server PID [-f]``,
  ``set_default_device_pinned_mem_limit DEV VALUE``,
  ``get_default_device_pinned_mem_limit DEV``,
  ``set_device_pinned_mem_limit PID DEV VALUE`` / ``get_device_pinned_mem_limit PID DEV``
  (a running server's limit, for clients that connect afterwards),
  ``set_default_active_thread_percentage PCT``,
  ``get_default_active_thread_percentage``, ``quit``.

Semantics kept from the real daemon (its man page): one server per UID; a client of
another UID is queued and the running server is asked to shut down once its clients
are gone, then a server for the queued UID starts; defaults set by ``set_default_*``
apply to servers started afterwards, not to running ones. A client gets the smaller
of its ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and its server's limit: the server-side
limit holds for a client that unset the variable. Each server is a real
(idle) child process running as its UID, so ``get_server_list`` prints live PIDs.

Devices: the daemon keeps the ``CUDA_VISIBLE_DEVICES`` it was started with and
hands it to every client it grants a server (:mod:`.mps_protocol`), because under
MPS a client's device numbers are the server's, not the node's: a job that keeps the
node's index of its GPU fails on a real node, and must fail here too.

Error containment (Volta and later MPS): a client that reports a fatal GPU exception
(``FAULT``, see :mod:`.mps_protocol`) puts its server in recovery: every other client
of the server is told (``FATAL``), new clients of that user are refused
(``NOTREADY``, CUDA's ``cudaErrorMpsServerNotReady``) until all the server's clients
have exited, then the server accepts clients again.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from slurm_colloc.gpu.sim.mps_commands import ControlCommands
from slurm_colloc.gpu.sim.mps_protocol import (
    END,
    FATAL,
    MAX_LINE,
    NOT_READY,
    PID_FILE,
    SOCKET_NAME,
    SOCKET_TYPE,
    VISIBLE_ENV,
    MpsError,
    connect,
    format_ready,
    log_dir_from_env,
    peer_credentials,
    pipe_dir_from_env,
)
from slurm_colloc.gpu.sim.mps_state import Client, ControlLog, Server
from slurm_colloc.gpu.sim.mps_ui import run_ui
from slurm_colloc.units import limit_for

_SERVER_CODE = (
    "import signal, sys\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "while True: signal.pause()\n"
)


def spawn_server(
    uid: int | None = None, log: Callable[[str], None] | None = None
) -> subprocess.Popen[bytes]:
    """Start an idle stand-in server process; as ``uid`` when one is given and we are root.

    If the interpreter cannot be run as that user (a venv under a 0700 home, say),
    the server runs as the daemon's user instead and ``log`` is told: the
    one-server-per-UID bookkeeping, which is what matters here, is unchanged.
    """
    argv = [sys.executable, "-c", _SERVER_CODE, "nvidia-cuda-mps-server(sim)"]
    kw: dict[str, Any] = {
        "stdin": subprocess.DEVNULL,
        "stdout": subprocess.DEVNULL,
        "stderr": subprocess.DEVNULL,
        "close_fds": True,
    }
    if uid is not None and os.geteuid() == 0 and uid != 0:
        try:
            return subprocess.Popen(argv, user=uid, **kw)
        except OSError as e:
            if log is not None:
                log(f"Cannot run server as user {uid} ({e}); running it as uid 0")
    return subprocess.Popen(argv, **kw)


def refuse_if_running(pipe_dir: Path, shown: Path) -> None:
    """Raise :class:`MpsError` when a daemon answers in ``pipe_dir`` (named ``shown``)."""
    try:
        connect(pipe_dir, timeout=1.0).close()
    except MpsError:
        return  # nobody answers: a stale socket at most, to be replaced
    raise MpsError(f"An instance of this daemon is already running ({shown})")


class SelectLoop(ABC):
    """The event loop of both stand-ins: listening sockets, connections, UI peers.

    :meth:`serve` runs until ``running`` is cleared (``quit``) or SIGTERM, then
    :meth:`shutdown`. A UI peer sends commands one a line; each answer ends with ``END``.
    """

    def __init__(self) -> None:
        """No socket yet: a subclass listens with :meth:`_listen_on`."""
        self.ui: dict[socket.socket, tuple[int, bytes]] = {}  # UI peer: (uid, partial line)
        self.running = True
        self.sel = selectors.DefaultSelector()

    def _listen_on(self, path: Path) -> socket.socket:
        """A listening socket at ``path`` (a stale one replaced), mode 0666, selected."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, SOCKET_TYPE)
        sock.bind(os.fspath(path))
        # clients of any user connect, as to the real socket (v3: a stand-in choice)
        os.chmod(path, 0o666)  # noqa: S103
        sock.listen(64)
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ)
        return sock

    def serve(self) -> None:
        """Run until ``quit`` or SIGTERM, then :meth:`shutdown`."""
        signal.signal(signal.SIGTERM, lambda *a: setattr(self, "running", False))
        try:
            while self.running:
                for key, _ in self.sel.select(timeout=0.2):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if self._listens(sock):
                        self._accept(sock)
                    else:
                        self._readable(sock)
                self._after_events()
        finally:
            self.shutdown()

    def _ui_data(self, conn: socket.socket, data: bytes) -> None:
        """Answer the complete lines a UI peer sent (while running); keep a partial one."""
        uid, buf = self.ui[conn]
        buf += data
        while b"\n" in buf and self.running:
            line, buf = buf.split(b"\n", 1)
            answer = self._answer(line, uid)
            try:
                conn.sendall(answer + END)
            except OSError:
                self._close(conn)
                return
        if len(buf) > MAX_LINE:
            self._close(conn)
            return
        self.ui[conn] = (uid, buf)

    @abstractmethod
    def _listens(self, sock: socket.socket) -> bool:
        """``sock`` is one of the daemon's listening sockets."""

    @abstractmethod
    def _accept(self, listener: socket.socket) -> None:
        """A connection is waiting on ``listener``."""

    @abstractmethod
    def _readable(self, conn: socket.socket) -> None:
        """``conn`` has data (or EOF)."""

    @abstractmethod
    def _after_events(self) -> None:
        """After each round of events (and each 0.2 s)."""

    @abstractmethod
    def _answer(self, line: bytes, uid: int) -> bytes:
        """The answer to one command line of a UI peer of ``uid``."""

    @abstractmethod
    def _close(self, conn: socket.socket) -> None:
        """Forget and close a connection."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop servers, close every connection, remove what the daemon made."""


class Daemon(SelectLoop, ControlCommands):
    """The control daemon's state machine; one instance per pipe directory (= per GPU)."""

    def __init__(self, pipe_dir: Path, log: ControlLog) -> None:
        """Bind the control socket; refuses if another daemon answers on it."""
        super().__init__()
        self.pipe_dir = pipe_dir
        self.log = log
        self.owner = os.geteuid()
        # the devices its servers see, fixed at start as in MPS; None: every GPU
        self.visible = os.environ.get(VISIBLE_ENV)
        self.default_pct = 100.0
        self.default_limits: dict[int | None, int] = {}
        self.servers: list[Server] = []
        self.waiting: list[Client] = []
        self.clients: dict[socket.socket, Client] = {}
        self.pending: dict[socket.socket, bytes] = {}
        sock_path = pipe_dir / SOCKET_NAME
        refuse_if_running(pipe_dir, sock_path)
        self.listener = self._listen_on(sock_path)
        (pipe_dir / PID_FILE).write_text(f"{os.getpid()}\n")
        log.ctl(f"Starting control daemon using socket {sock_path}")
        log.ctl(
            "To connect CUDA applications to this daemon, "
            f"set env CUDA_MPS_PIPE_DIRECTORY={pipe_dir}"
        )
        log.ctl(
            f"{VISIBLE_ENV}="
            + ("<unset>: servers see every device" if self.visible is None else self.visible)
        )

    # --- servers ---------------------------------------------------------------
    def _active(self) -> Server | None:
        return self.servers[0] if self.servers else None

    def _start_server(self, uid: int) -> Server:
        proc = spawn_server(uid, self.log.ctl)
        server = Server(uid, proc, self.default_pct, dict(self.default_limits))
        self.servers.append(server)
        self.log.ctl(f"Starting new server {proc.pid} for user {uid}")
        self.log.ctl(f"NEW SERVER {proc.pid}: Ready")
        return server

    def _stop_server(self, server: Server, force: bool = False) -> None:
        server.faulted = False  # the server goes away: no recovery to report
        for c in list(server.clients):
            self._drop_client(c)
        with contextlib.suppress(ProcessLookupError):
            server.proc.send_signal(signal.SIGKILL if force else signal.SIGTERM)
        try:
            status = server.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            status = server.proc.wait()
        self.log.ctl(f"Server {server.pid} exited with status {status}")
        if server in self.servers:
            self.servers.remove(server)

    def _grant(self, server: Server, client: Client) -> None:
        server.clients.append(client)
        limit = limit_for(server.limits, client.device)
        msg = format_ready(server.pid, limit, server.active_thread_pct, self.visible) + "\n"
        self.log.srv(server.pid, f"New client {client.pid} connected")
        try:
            client.conn.sendall(msg.encode())
        except OSError:
            self._drop_client(client)

    def _schedule(self) -> None:
        """Apply the one-server-per-UID rule after any change."""
        for server in list(self.servers):
            if server.proc.poll() is not None:
                self.log.ctl(f"Server {server.pid} exited with status {server.proc.returncode}")
                server.faulted = False
                for c in list(server.clients):
                    self._drop_client(c)
                self.servers.remove(server)
        active = self._active()
        if active is not None and self.waiting and any(c.uid != active.uid for c in self.waiting):
            active.terminating = True
        if active is not None and active.terminating and not active.clients:
            self._stop_server(active)
            active = None
        if active is None and self.waiting:
            uid = self.waiting[0].uid
            server = self._start_server(uid)
            for c in [c for c in self.waiting if c.uid == uid]:
                self.waiting.remove(c)
                self._grant(server, c)
            if self.waiting:
                server.terminating = True

    def _new_client(self, conn: socket.socket, device: int) -> None:
        pid, uid, _ = peer_credentials(conn)
        active = self._active()
        if active is not None and active.uid == uid and active.faulted:
            self.log.ctl(
                f"NEW CLIENT {pid} from user {uid}: Server {active.pid} is recovering "
                "from a fatal exception: not ready"
            )
            with contextlib.suppress(OSError):
                conn.sendall(f"{NOT_READY}\n".encode())
            self._close(conn)
            return
        client = Client(conn, pid, uid, device)
        self.clients[conn] = client
        if active is not None and active.uid == uid and not active.terminating:
            self.log.ctl(f"NEW CLIENT {pid} from user {uid}: Server already exists")
            self._grant(active, client)
            return
        if active is None:
            self.log.ctl(
                f"NEW CLIENT {pid} from user {uid}: "
                "Server is not ready, push client to pending list"
            )
            self.waiting.append(client)
            self._schedule()
            return
        self.log.ctl(
            f"NEW CLIENT {pid} from user {uid}: Server {active.pid} of user {active.uid} "
            "is running, push client to pending list"
        )
        self.waiting.append(client)
        msg = f"WAIT {active.uid} {active.pid} {len(active.clients)}\n"
        with contextlib.suppress(OSError):
            conn.sendall(msg.encode())
        self._schedule()

    def _drop_client(self, client: Client) -> None:
        self.clients.pop(client.conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(client.conn)
        client.conn.close()
        if client in self.waiting:
            self.waiting.remove(client)
        for s in self.servers:
            if client in s.clients:
                s.clients.remove(client)
                self.log.srv(s.pid, f"Client {client.pid} disconnected")
                if s.faulted and not s.clients:
                    s.faulted = False
                    self.log.srv(s.pid, "All clients exited: recovered")

    def _client_data(self, client: Client, data: bytes) -> None:
        """Lines a connected CUDA client sends: only ``FAULT`` means anything."""
        for _ in range(client.take_faults(data)):
            self._fault(client)

    def _fault(self, client: Client) -> None:
        """``client`` hit a fatal GPU exception: the whole server recovers (Volta+ MPS)."""
        server = next((s for s in self.servers if client in s.clients), None)
        if server is None:
            self.log.ctl(
                f"Client {client.pid} reported a fatal GPU exception before it had a server: "
                "ignored"
            )
            return
        if server.faulted:
            self.log.srv(
                server.pid,
                f"Client {client.pid} encountered a fatal GPU exception; "
                "already recovering from a fatal exception",
            )
            return
        server.faulted = True
        others = [c for c in server.clients if c is not client]
        for c in others:  # a client that is gone shows up as EOF in the event loop
            with contextlib.suppress(OSError):
                c.conn.sendall(f"{FATAL}\n".encode())
        self.log.srv(
            server.pid,
            f"Client {client.pid} encountered a fatal GPU exception; reported to "
            f"{len(others)} other client(s); new clients refused until all have exited",
        )

    # --- event loop ---------------------------------------------------------------
    def _listens(self, sock: socket.socket) -> bool:
        return sock is self.listener

    def _accept(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        conn.settimeout(2.0)
        self.log.ctl("Accepting connection...")
        self.pending[conn] = b""
        self.sel.register(conn, selectors.EVENT_READ)

    def _readable(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if conn in self.clients:
            if not data:  # EOF: the client is gone (even if SIGKILLed)
                self._drop_client(self.clients[conn])
                self._schedule()
            else:
                self._client_data(self.clients[conn], data)
            return
        if not data:
            self._close(conn)
            return
        if conn in self.pending:
            buf = self.pending[conn] + data
            if b"\n" not in buf:
                if len(buf) > MAX_LINE:
                    self._close(conn)
                else:
                    self.pending[conn] = buf
                return
            first, rest = buf.split(b"\n", 1)
            del self.pending[conn]
            words = first.decode("utf-8", "replace").split()
            if words == ["UI"]:
                self.log.ctl("NEW UI")
                self.ui[conn] = (peer_credentials(conn)[1], b"")
                data = rest
            elif len(words) == 2 and words[0] == "CLIENT" and words[1].isdigit():
                self._new_client(conn, int(words[1]))
                if rest and conn in self.clients:
                    self._client_data(self.clients[conn], rest)
                return
            else:
                self.log.ctl("Unable to read new connection type information")
                self._close(conn)
                return
        self._ui_data(conn, data)

    def _answer(self, line: bytes, uid: int) -> bytes:
        return self.command(line.decode("utf-8", "replace"), uid).encode()

    def _close(self, conn: socket.socket) -> None:
        if conn in self.ui:
            self.log.ctl("UI closed")
        self.ui.pop(conn, None)
        self.pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn)
        conn.close()

    def _after_events(self) -> None:
        self._schedule()

    def shutdown(self) -> None:
        """Stop servers, close every connection, remove socket and pid file."""
        for server in list(self.servers):
            self._stop_server(server)
        for conn in list(self.ui) + list(self.pending) + list(self.clients):
            with contextlib.suppress(OSError):
                conn.close()
        self.sel.close()
        self.listener.close()
        for name in (SOCKET_NAME, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.pipe_dir / name)
        self.log.ctl("Exit")
        self.log.close()


def _start_daemon() -> Daemon:
    pipe_dir = pipe_dir_from_env()
    pipe_dir.mkdir(parents=True, exist_ok=True)
    log = ControlLog(log_dir_from_env())
    try:
        return Daemon(pipe_dir, log)
    except MpsError:
        log.close()
        raise


class Servable(Protocol):
    """What :func:`run_foreground` and :func:`daemonize` run: a daemon bound to its socket."""

    pipe_dir: Path

    def serve(self) -> None:
        """Run until told to quit, then clean up."""


def run_foreground(
    make: Callable[[], Servable],
    *,
    refused: tuple[type[Exception], ...] = (MpsError,),
    on_ready: Callable[[str], None] | None = None,
) -> int:
    """``-f``: serve in this process (used by tests and for debugging).

    ``make`` binds the daemon; when it raises one of ``refused`` the message goes to
    stderr and the status is 1. ``on_ready`` is given the pipe directory before serving.
    """
    try:
        daemon = make()
    except refused as e:
        sys.stderr.write(f"{e}\n")
        return 1
    if on_ready is not None:
        on_ready(str(daemon.pipe_dir))
    daemon.serve()
    return 0


def daemonize(
    make: Callable[[], Servable],
    *,
    refused: tuple[type[Exception], ...] = (MpsError,),
    on_ready: Callable[[str], None] | None = None,
    failed: str = "MPS stand-in failed to start",
) -> int:
    """``-d``: double-fork, detach, and return only once ``make`` has bound the daemon.

    The detached process runs ``make`` and reports ``OK<pipe dir>`` or ``ERR <why>``
    (``why`` from an OSError or one of ``refused``) through a pipe; this process then
    passes the pipe directory to ``on_ready`` and returns 0, or prints why (``failed``
    when the detached process said nothing) and returns 1.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid > 0:
        os.close(write_fd)
        os.waitpid(pid, 0)
        with os.fdopen(read_fd, "rb") as r:
            status = r.read()
        if status.startswith(b"OK"):
            if on_ready is not None:
                on_ready(status[2:].decode(errors="replace"))
            return 0
        msg = status.decode(errors="replace").removeprefix("ERR ").strip()
        sys.stderr.write((msg or failed) + "\n")
        return 1
    os.close(read_fd)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    os.chdir("/")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    code = 1
    try:
        try:
            daemon = make()
        except refused as e:
            os.write(write_fd, f"ERR {e}".encode())
            os._exit(1)
        os.write(write_fd, b"OK" + os.fsencode(daemon.pipe_dir))
        os.close(write_fd)
        daemon.serve()
        code = 0
    except OSError as e:
        with contextlib.suppress(OSError):
            os.write(write_fd, f"ERR {e}".encode())
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``colloc-sim-mps-control`` (same options as the real one)."""
    parser = argparse.ArgumentParser(
        prog="colloc-sim-mps-control",
        description="Simulated nvidia-cuda-mps-control (slurm-colloc sim backend only).",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("-d", action="store_true", help="start the daemon in the background")
    mode.add_argument("-f", action="store_true", help="run the daemon in the foreground")
    args = parser.parse_args(argv)
    if args.d:
        return daemonize(_start_daemon)
    if args.f:
        return run_foreground(_start_daemon)
    return run_ui(sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
