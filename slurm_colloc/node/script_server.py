"""The node's resident script server: colloc's Prolog and Epilog without an interpreter each.

Why (issue 28, prolog p99 under a burst): every Prolog paid ~0.25 s of CPU for its
interpreter and colloc's imports before it did anything, and a burst's ~40 prologs on
a node's busy cores queued behind each other's start-ups. This process imports that
code once and forks a worker per request (:mod:`slurm_colloc.node.script_client`); the
worker runs the very same script body as a script run by slurmd itself
(:func:`slurm_colloc.node.scripts.run_here`), with slurmd's environment and stdio, and
sends back its exit status. A fork of a warm process costs milliseconds.

Trust (docs/security.md): it runs as root and serves root only. Its socket is in
root's 0700 :data:`~slurm_colloc.node.script_client.RUN_DIR`, a peer whose credentials
are not root's is dropped before any byte is read, and the parent reads nothing a
client sends: each worker parses and checks its own request (bounded size, script
name from a fixed list, an environment of strings for this server's config and node),
so a malformed one costs only that worker. The worker runs what a Prolog run by slurmd
would, on slurmd's environment only.

Life cycle: started detached by a script that found no server (it hands over the lock
it took, :func:`slurm_colloc.node.script_start.start`), or by hand or systemd
(``python -m slurm_colloc.node.script_server`` with slurmd's ``COLLOC_CONF`` and
``SLURMD_NODENAME``). It exits after
``script_server_idle_s`` without a request, when colloc.conf sets that to 0, and when
any of colloc's module files changed since it started (an upgrade): the client then
runs the script itself, and that run starts a new server.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurm_colloc import config as cfgmod
from slurm_colloc import priority, root_lock
from slurm_colloc.detach import PASSED_FD
from slurm_colloc.node import script_client as client
from slurm_colloc.node.script_start import ensure_run_dir

MAX_ENV = 4096
"""Most variables a request's environment may hold."""
PRELOAD = (
    "slurm_colloc.node.entry", "slurm_colloc.node.prolog", "slurm_colloc.node.epilog",
    "slurm_colloc.node.controller_wait", "slurm_colloc.node.metrics_launch",
    "slurm_colloc.node.epilog_once", "slurm_colloc.accounting.spool",
    "slurm_colloc.mps.control", "slurm_colloc.gpu.select",
)
"""What a worker would otherwise import itself (the point of the server)."""

log = logging.getLogger("colloc.node.script-server")

GROUPED = "its CPU group at nice "
"""On the ``serving`` log line when the server weighted its session's CPU group
(:func:`slurm_colloc.priority.raise_session`); the demo reports it."""


class Declined(ValueError):
    """A request this server does not run; the client runs the script itself."""


class Stop(Declined):
    """Declined, and the server must stop (its code changed, or it was switched off)."""


STOP_STATUS = 75
"""A worker's exit status that tells the server to stop. Never a signal to the worker's
parent: a worker whose server already exited has been reparented (to init)."""


def code_stamp() -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every colloc module file loaded: an upgrade changes them."""
    out = {}
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None)
        if name.startswith("slurm_colloc") and path:
            with contextlib.suppress(OSError):
                st = os.stat(path)
                out[path] = (st.st_ino, st.st_mtime_ns)
    return out


def changed(stamp: Mapping[str, tuple[int, int]]) -> bool:
    """True when a module file of ``stamp`` was replaced or removed since."""
    for path, was in stamp.items():
        try:
            st = os.stat(path)
        except OSError:
            return True
        if (st.st_ino, st.st_mtime_ns) != was:
            return True
    return False


def _number(text: str, name: str) -> float | None:
    """A request's ``started``/``cpu`` field: empty (unknown) or 0 <= x < 1e10."""
    if not text:
        return None
    try:
        v = float(text)
    except ValueError:
        raise Declined(f"bad {name}") from None
    if not 0 <= v < 1e10:  # also NaN
        raise Declined(f"bad {name}")
    return v


def parse_request(data: bytes, key: str) -> dict[str, Any]:
    """The checked request (script, env, started, cpu, stdio); :class:`Declined` if not."""
    try:
        (script, started, cpu, stdio_text), env = client.decode_request(data)
    except ValueError as e:
        raise Declined(f"not a request: {e}") from None
    if script not in client.SCRIPTS:
        raise Declined("unknown script")
    if len(env) > MAX_ENV:
        raise Declined("the environment has too many variables")
    if client.server_key(env) != key:
        raise Declined("another colloc.conf or node than this server's")
    try:
        stdio = [int(n) for n in stdio_text.split(",")] if stdio_text else []
    except ValueError:
        raise Declined("bad stdio") from None
    if len(stdio) > 3 or any(n not in (0, 1, 2) for n in stdio) or len(set(stdio)) != len(stdio):
        raise Declined("bad stdio")
    return {"script": script, "env": env, "started": _number(started, "started"),
            "cpu": _number(cpu, "cpu"), "stdio": stdio}


def _receive(conn: socket.socket) -> tuple[bytes, list[int]]:
    """The request's bytes and the stdio descriptors sent with its first byte."""
    conn.settimeout(client.ACK_WAIT_S)
    head, fds, _, _ = socket.recv_fds(conn, client._HEADER.size, 3)
    while len(head) < client._HEADER.size:
        more = conn.recv(client._HEADER.size - len(head))
        if not more:
            raise Declined("short request")
        head += more
    (size,) = client._HEADER.unpack(head)
    if size > client.MAX_REQUEST:
        raise Declined("request too large")
    data = b""
    while len(data) < size:
        more = conn.recv(min(65536, size - len(data)))
        if not more:
            raise Declined("short request")
        data += more
    return data, fds


def _send(conn: socket.socket, kind: str, value: object = "") -> None:
    conn.sendall(client.reply(kind, value))


def _configured_on() -> bool:
    try:
        return cfgmod.load().script_server_idle_s > 0
    except cfgmod.ConfigError:
        return False


def worker(conn: socket.socket, key: str, stamp: Mapping[str, tuple[int, int]]) -> int:
    """One request, in a forked child: check it, take it, run it, answer its status."""
    from slurm_colloc.node.scripts import run_here

    fds: list[int] = []
    try:
        data, fds = _receive(conn)
        req = parse_request(data, key)
        if len(fds) != len(req["stdio"]):
            raise Declined("stdio descriptors missing")
        if changed(stamp):
            raise Stop("colloc's code changed since the server started")
        os.environ.clear()
        os.environ.update(req["env"])
        if not _configured_on():
            raise Stop("script_server_idle_s is 0 in colloc.conf")
    except (Declined, OSError) as e:
        with contextlib.suppress(OSError):
            _send(conn, "declined", e)
        return STOP_STATUS if isinstance(e, Stop) else 0
    _send(conn, "taken")
    if conn.recv(3) != b"go\n":  # the client gave up waiting: it runs the script itself
        return 0
    conn.settimeout(None)
    for fd, number in zip(fds, req["stdio"], strict=True):
        os.dup2(fd, number)
        if fd != number:
            os.close(fd)
    status = run_here(req["script"], dict(req["env"]), req["started"], req["cpu"] or 0.0)
    _send(conn, "status", status)
    return 0


def _child(conn: socket.socket, listener: socket.socket, lock: int | None, key: str,
           stamp: Mapping[str, tuple[int, int]]) -> None:
    """The forked worker's whole life; it never returns. It lets go of the server's
    socket and lock at once: a server killed while its workers run (an epilog may
    take minutes) is then seen as gone, and the next script starts another."""
    status = 1
    try:
        listener.close()
        if lock is not None:
            os.close(lock)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        if os.getpriority(os.PRIO_PROCESS, 0) < priority.SCRIPT_NICE:
            os.setpriority(os.PRIO_PROCESS, 0, priority.SCRIPT_NICE)  # a script, as served
        status = worker(conn, key, stamp)
    except BaseException:  # noqa: BLE001 - the client sees no status and runs it itself
        status = 1
    finally:
        os._exit(status)


class Server:
    """The accept loop: one forked worker per root connection; idle and upgrade exits."""

    def __init__(self, listener: socket.socket, key: str, idle_s: float,
                 lock: int | None = None) -> None:
        self.listener = listener
        self.lock = lock
        self.key = key
        self.idle_s = idle_s
        self.stamp = code_stamp()
        self.children: set[int] = set()
        self.stop = False
        self.last = time.monotonic()

    def reap(self) -> None:
        """Collect ended workers; one that ended with :data:`STOP_STATUS` stops the server."""
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if not done:
                    continue
                if os.waitstatus_to_exitcode(status) == STOP_STATUS:
                    self.stop = True
            self.children.discard(pid)

    def serve_one(self, conn: socket.socket) -> None:
        """Fork a worker for a root peer; drop anyone else unread."""
        with conn:
            if client.peer_uid(conn) != os.geteuid():
                log.warning("dropped a connection of uid %s",
                            client.peer_uid(conn))
                return
            pid = os.fork()
            if pid == 0:
                _child(conn, self.listener, self.lock, self.key, self.stamp)
            self.children.add(pid)
        self.last = time.monotonic()

    def run(self) -> str:
        """Serve until told to stop; returns why it stopped."""
        while not self.stop:
            self.reap()
            if not self.children and time.monotonic() - self.last > self.idle_s:
                return f"no request for {self.idle_s:.0f}s"
            try:
                ready, _, _ = select.select([self.listener], [], [], 1.0)
            except InterruptedError:
                continue
            if ready:
                try:
                    conn, _ = self.listener.accept()
                    self.serve_one(conn)
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as e:  # EMFILE, ECONNABORTED, a fork's ENOMEM: that
                    log.warning("accept: %s", e)  # client runs its script itself
                    time.sleep(0.1)
        return "told to stop (SIGTERM, an upgrade or colloc.conf)"


def _listen(path: Path) -> socket.socket:
    """The server's socket at ``path`` (its lock is held: any file there is stale)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        s.bind(str(path))
    finally:
        os.umask(old)
    s.listen(128)
    s.setblocking(False)
    return s


def handed_lock(path: Path) -> int | None:
    """:data:`~slurm_colloc.detach.PASSED_FD` when it is the lock file at ``path`` (the
    starter's, held across the hand-over); None when the server was started otherwise
    (by hand, by systemd), whatever that descriptor is."""
    try:
        held, there = os.fstat(PASSED_FD), os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return PASSED_FD if (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino) else None


def main(argv: list[str] | None = None) -> int:
    """``python -m slurm_colloc.node.script_server [--run-dir DIR]`` (root; slurmd's env)."""
    from slurm_colloc.node.logging_setup import node_logger

    args = sys.argv[1:] if argv is None else argv
    run_dir = Path(args[1]) if args[:1] == ["--run-dir"] and len(args) > 1 else client.RUN_DIR
    env = dict(os.environ)
    ensure_run_dir(run_dir)
    lock = handed_lock(client.lock_path(env, run_dir))  # before any other file is opened
    for _ in range(20):  # a client's probe holds it shared for an instant
        if lock is not None:
            break
        lock = root_lock.try_lock(client.lock_path(env, run_dir))
        time.sleep(0.05 if lock is None else 0)
    if lock is None:
        return 0  # another server holds it
    cfg = cfgmod.load()
    slog = node_logger("script-server", "-", cfg.log_file)
    # it only accepts and forks, but every script waits for that: on a node's busy
    # cores a server at nice 0 handed out a burst's workers seconds late (issue 28);
    # workers drop to the scripts' nice, and what they start long-lived gets nice 0
    # back (priority.py)
    priority.raise_process(priority.SERVER_NICE)
    # ...and its session's group, which the kernel may share the CPUs by before any
    # nice value counts: its workers are every script the node runs (priority.py)
    grouped = priority.raise_session(priority.SERVER_NICE)
    from slurm_colloc.gpu.select import BACKEND_MODULES

    for name in (*PRELOAD, *BACKEND_MODULES.get(cfg.gpu_backend, ())):
        with contextlib.suppress(ImportError):  # the worker reports it, as a script would
            __import__(name)
    listener = _listen(client.socket_path(env, run_dir))
    server = Server(listener, client.server_key(env), cfg.script_server_idle_s, lock)
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "stop", True))
    gc.collect()
    gc.freeze()  # workers' pages stay shared: reference counts no longer touch them
    slog.info("serving %s (pid %d%s)", listener.getsockname(), os.getpid(),
              f", {GROUPED}{priority.SERVER_NICE}" if grouped else "")
    why = server.run()
    with contextlib.suppress(OSError):
        os.unlink(listener.getsockname())
    listener.close()
    slog.info("exiting: %s", why)
    return 0


if __name__ == "__main__":
    sys.exit(main())
