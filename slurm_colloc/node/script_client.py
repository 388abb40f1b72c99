"""Prolog/Epilog client: hand slurmd's request to the node's resident script server.

Why (issue 28, prolog p99 under a burst): slurmd starts one Prolog per job, and a burst
puts ~40 of them on a node at once. Each paid its own interpreter and colloc's imports,
~0.25 s of CPU before doing anything, so on a node's busy cores the wave queued for
CPU whatever it waited on. The node's script server
(:mod:`slurm_colloc.node.script_server`) holds those imports once and forks a worker per
request; this client, which slurmd runs as ``colloc-prolog``/``colloc-epilog``, imports
the standard library only, sends slurmd's environment and its own stdio, and waits for
the worker's exit status.

It never decides anything itself and never raises: whenever the server is absent,
declines, or its worker dies before answering, :func:`call` says so and the caller runs
the script in this process exactly as before (:mod:`slurm_colloc.node.scripts`). A
server being started (its lock held, no socket yet) is waited for up to
:data:`START_WAIT_S`, so a cold node's first wave mostly shares one start-up too.

Trust: root talks to root only. The socket lives in :data:`RUN_DIR`, a directory that
must be the caller's (root's) and closed to everyone else, and the peer's credentials
must be the caller's uid, so no user can stand in for the server.

A worker that dies after ``go`` (killed, out of memory) leaves the run to the client,
which runs the script again: colloc's scripts are safe to run again for one job (the
prolog's steps are idempotent under their locks; the epilog holds the job's once-lock,
:mod:`slurm_colloc.node.epilog_once`), and a job must not lose its prolog or epilog.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm_colloc import root_lock

RUN_DIR = Path("/run/colloc-scripts")
"""Root's directory for the servers' sockets and locks (0700). Not ``/run/colloc``:
that is the parent of the default ``mps_root``, which jobs must be able to traverse."""
SCRIPTS = ("prolog", "epilog")
"""What a server runs: the root scripts only (the TaskProlog runs as the job's user)."""
MAX_REQUEST = 1 << 20
"""Largest request: slurmd's environment for one job is a few KiB."""
START_WAIT_S = 5.0
"""How long a client waits for a server that is being started (its lock is held)."""
ACK_WAIT_S = 5.0
"""How long a client waits for a worker to take its request; then it runs here. The
worker starts only on the client's ``go``, so a late worker never runs it too."""
_HEADER = struct.Struct("!I")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAGIC = b"colloc-script/2"
"""The request's first field. The wire is plain bytes so that the C client
(``script_client.c``) speaks it without a JSON encoder: after the 4-byte length, NUL-
terminated fields ``MAGIC, script, started, cpu, stdio`` (``0,1,2``; empty numbers are
unknown), then slurmd's environment as ``NAME=VALUE`` fields, as ``/proc/PID/environ``
holds it. Replies are lines: ``taken``, ``declined <why>``, ``status <n>``."""


@dataclass(frozen=True)
class Outcome:
    """What the server did with a request: ``status`` is the script's exit status, or
    None when the caller must run the script itself, ``why`` says why (for the log)."""

    status: int | None
    why: str = ""

    @property
    def absent(self) -> bool:
        """No server runs or is being started: the caller's run may start one."""
        return self.status is None and self.why == "absent"


def server_key(env: Mapping[str, str]) -> str:
    """One server per (colloc.conf, node): devclusters run several of each on a host.

    FNV-1a (64 bits, hex) of ``COLLOC_CONF``, NUL, ``SLURMD_NODENAME``: a name, not a
    secret (the directory is root's own), and the C client computes the same in a few
    lines."""
    h = 0xCBF29CE484222325
    for byte in os.fsencode(f"{env.get('COLLOC_CONF', '')}\0{env.get('SLURMD_NODENAME', '')}"):
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def encode_request(script: str, env: Mapping[str, str], started: float | None, cpu: float,
                   stdio: list[int]) -> bytes:
    """The request body (:data:`MAGIC`): what the worker needs to run ``script``."""
    fields = [MAGIC, script.encode(), b"" if started is None else repr(started).encode(),
              repr(cpu).encode(), ",".join(map(str, stdio)).encode()]
    fields += [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()]
    return b"".join(f + b"\0" for f in fields)


def decode_request(data: bytes) -> tuple[list[str], dict[str, str]]:
    """The five header fields and the environment of a request body; ValueError when it
    is not one. Names and values are decoded as ``os.environ`` decodes them."""
    if not data.endswith(b"\0"):
        raise ValueError("not NUL-terminated")
    fields = data[:-1].split(b"\0")
    if len(fields) < 5 or fields[0] != MAGIC:
        raise ValueError("not a colloc-script/2 request")
    env = {}
    for item in fields[5:]:
        name, eq, value = item.partition(b"=")
        if not eq or not name:
            raise ValueError("an environment entry is not NAME=VALUE")
        env[os.fsdecode(name)] = os.fsdecode(value)
    if len(env) != len(fields) - 5:
        raise ValueError("an environment name is repeated")
    return [os.fsdecode(f) for f in fields[1:5]], env


def reply(kind: str, value: object = "") -> bytes:
    """A reply line: ``taken``, ``declined <why>`` or ``status <n>`` (one line)."""
    text = " ".join(str(value).split())
    return f"{kind} {text}".rstrip().encode() + b"\n"


def socket_path(env: Mapping[str, str], run_dir: Path = RUN_DIR) -> Path:
    """Where the server for ``env``'s config and node listens."""
    return run_dir / f"script-{server_key(env)}.sock"


def lock_path(env: Mapping[str, str], run_dir: Path = RUN_DIR) -> Path:
    """The lock its one server holds while it starts, serves and stops."""
    return run_dir / f"script-{server_key(env)}.lock"


def private_dir(run_dir: Path) -> bool:
    """True when ``run_dir`` is a real directory of this uid's that nobody else may enter."""
    try:
        st = os.lstat(run_dir)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket."""
    _, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return int(uid)


def process_start() -> float | None:
    """When this process started, on ``CLOCK_BOOTTIME`` (what ``/proc/self/stat`` counts
    in): a script's wall time then includes its interpreter's start-up, as slurmd sees it."""
    try:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _stdio() -> tuple[list[int], list[int]]:
    """This process's open stdio descriptors (slurmd may close any), and their numbers."""
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            continue
        fds.append(fd)
    return fds, list(fds)


def _fill_stdio() -> None:
    """``/dev/null`` on any of fds 0-2 slurmd left closed, so that no socket of ours
    takes one of those numbers and is sent to the worker as its stdio."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            if null != fd:
                os.close(null)


def _connect(path: Path) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(ACK_WAIT_S)  # a stuck server's full backlog ends in running it here
    try:
        s.connect(str(path))
    except OSError:
        s.close()
        return None
    return s


def _starting(lock: Path) -> bool:
    """True while another process holds the server's lock (a server starting or up)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return root_lock.held_elsewhere(fd)
    finally:
        os.close(fd)


def _reach(env: Mapping[str, str], run_dir: Path, start_wait_s: float) -> socket.socket | None:
    """A connection to this node's server, waiting for one being started."""
    path = socket_path(env, run_dir)
    s = _connect(path)
    if s is not None or not _starting(lock_path(env, run_dir)):
        return s
    deadline = time.monotonic() + start_wait_s
    while time.monotonic() < deadline:
        time.sleep(0.02)
        s = _connect(path)
        if s is not None:
            return s
        if not _starting(lock_path(env, run_dir)):
            return None
    return None


def _read_reply(s: socket.socket) -> tuple[str, str]:
    """One reply line from the worker as (kind, rest); ("", "") when it closed first."""
    buf = b""
    while not buf.endswith(b"\n") and len(buf) < 65536:
        chunk = s.recv(4096)
        if not chunk:
            return "", ""
        buf += chunk
    kind, _, rest = buf.decode(errors="replace").strip().partition(" ")
    return kind, rest


def call(script: str, env: Mapping[str, str], started: float | None = None, *,
         run_dir: Path | None = None, start_wait_s: float = START_WAIT_S,
         ack_wait_s: float = ACK_WAIT_S) -> Outcome:
    """Run ``script`` for slurmd's ``env`` on the node's server; never raises.

    ``started``: this process's start (:func:`process_start`), so the worker's log line
    counts the whole run. The worker gets this process's stdio, so what it writes goes
    where slurmd reads it.
    """
    run_dir = RUN_DIR if run_dir is None else run_dir
    try:
        _fill_stdio()
        if not private_dir(run_dir):
            return Outcome(None, "absent")
        s = _reach(env, run_dir, start_wait_s)
        if s is None:
            return Outcome(None, "absent")
        with s:
            if peer_uid(s) != os.geteuid():
                return Outcome(None, "the socket's peer is not root")
            fds, numbers = _stdio()
            body = encode_request(script, env, started, _cpu(), numbers)
            if len(body) > MAX_REQUEST:
                return Outcome(None, f"request of {len(body)} bytes is too large")
            s.settimeout(ack_wait_s)  # sends too: a server that does not read
            socket.send_fds(s, [_HEADER.pack(len(body))], fds)
            s.sendall(body)
            kind, why = _read_reply(s)
            if kind != "taken":
                return Outcome(None, why if kind == "declined" and why
                               else "no answer from the server")
            s.sendall(b"go\n")  # committed: from here the worker runs it, never both
            s.settimeout(None)
            kind, status = _read_reply(s)
        if kind == "status" and status.lstrip("-").isdigit():
            return Outcome(int(status), "served")
        return Outcome(None, "the server's worker ended without a status")
    except Exception as e:  # noqa: BLE001 - the caller runs the script itself
        return Outcome(None, f"{type(e).__name__}: {e}")
