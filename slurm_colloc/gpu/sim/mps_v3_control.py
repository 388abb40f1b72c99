"""``colloc-sim-mps-control-v3``: a stand-in for ``nvidia-cuda-mps-control`` with MPS v3.

MPS v3 (driver r615, CUDA 13.4) cannot be tried here: no such GPU. This stand-in
follows NVIDIA's documentation so that :mod:`slurm_colloc.mps.v3` can be tested
against something that behaves as documented, and so that the simulated jobs
(:mod:`.simjob`) can be clients of a namespace. What the documentation does not say
is marked *stand-in choice* below; docs/mps-v3.md lists those as open questions.

Command line (https://docs.nvidia.com/deploy/mps/latest/mpsv3-interface.html,
"Control Daemon Options"): ``-h``, ``-d``, ``-f``, ``-m`` (multi-user), ``-a FILE``
(TOML, parsed with :mod:`tomllib`, https://docs.nvidia.com/deploy/mps/latest/mpsv3-configuration-file.html),
``-p 2|3``, ``-q``, ``-v``. ``CUDA_MPS_PROTOCOL_VERSION`` wins over ``-p``. Protocol 2
(the default) is the legacy stand-in, :mod:`.mps_control`, unchanged. With protocol
3, ``-h`` lists the modules (what ``nvidia-cuda-mps-control -p 3 -h`` is documented to
show on r615) and anything after the options is a ``module verb [args]`` command sent
to the running daemon: on success its output goes to stdout and the exit status is
0; on an error the message goes to stderr and the status is 1 (*stand-in choice*: the
documentation gives no exit statuses).

Commands (documented syntax; arguments positional, ``--key=value``, ``key=value`` or
``--flag``; names lowercase letters, digits, underscores, at most 64 characters):

* ``server create NAME [--uid=N] [--allowed-devices=IDS]``; ``server delete NAME
  [--force]`` (without ``--force`` refused while clients remain; with it they are
  terminated first); ``server list [NAME] [--format=table|csv[,noheader]]`` (name,
  uid, pid, status, pipe-directory, allowed-devices, context-ids); ``server set NAME
  [--pinned-memory-limit=] [--active-thread-percentage=] [--client-priority=]``
  (the server's ``default`` namespace; at least one option); ``server get NAME FIELD``.
* ``namespace create NAME --server=S``; ``namespace delete NAME --server=S [--force]``
  (refused while clients remain unless ``--force``; forced: its clients are
  terminated, *stand-in choice*: the documentation only says that it "allows
  deletion even with active clients"); ``namespace list [NAME] [--server=S]
  [--format=...]`` (name, server, server-status, pinned-memory-limit,
  active-thread-percentage, client-priority, pipe-directory); ``namespace set NAME
  --server=S [...]``; ``namespace get NAME SERVER FIELD``.
* ``client list [--server=S] [--all] [--format=...]`` (pid, server, device,
  namespace, cmd, as in the documented example); ``client get PID FIELD``;
  ``client terminate PID``.

In multi-user mode (``-m``, root only) servers are root's (``--uid`` may only be 0,
as documented) and serve clients of every user at once: no user waits for another,
unlike the legacy one-server-per-UID rule. Without ``-m`` a client whose uid is not
the server's is refused, as NVIDIA's measured guide reports
(``CUDA_ERROR_NOT_PERMITTED``, https://docs.nvidia.com/dynamo/dev/many-model-serving/per-gpu-compute-and-memory-limits-with-mps).

Pipe directory (https://docs.nvidia.com/deploy/mps/latest/mpsv3-namespaces.html)::

    $CUDA_MPS_PIPE_DIRECTORY/control               daemon; UI and UID auto-routing
    $CUDA_MPS_PIPE_DIRECTORY/<server>/control      the server's default namespace
    $CUDA_MPS_PIPE_DIRECTORY/<server>/default/control
    $CUDA_MPS_PIPE_DIRECTORY/<server>/<namespace>/control
    $CUDA_MPS_PIPE_DIRECTORY/<server>/log          the server's log pipe (a FIFO here)

A CUDA client picks its namespace by setting ``CUDA_MPS_PIPE_DIRECTORY`` to the
namespace's directory and speaks the client protocol of :mod:`.mps_protocol` on its
``control`` socket: ``CLIENT <device>`` is answered ``READY <server_pid> <limit|->
<pct> <visible>`` at once (limit and percentage of the namespace; ``<visible>`` the
server's ``allowed_devices``, which is what a client's device numbers refer to), or
``NOTREADY`` while the server recovers from a client's fatal GPU exception, or
``NOTPERMITTED`` (a uid mismatch without ``-m``). After READY: ``FATAL`` when another
client of the same server (any namespace, any user) reported ``FAULT``; ``TERMINATED``
then EOF when ``client terminate``, a forced delete or ``quit`` ended the client
(CUDA: ``CUDA_ERROR_MPS_CLIENT_TERMINATED`` on its next call). Sockets are made
mode 0666 and directories 0755 (*stand-in choice*, the modes of the real ones are not
documented): whoever starts the daemon decides who may reach which socket. A client's
own ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` can only lower the namespace's limit
(https://docs.nvidia.com/deploy/mps/latest/appendix-environment-variables.html); the
client applies that itself, as CUDA does.

``-a`` is applied once at start (documented); unknown keys in a ``[servers.<name>]``
or ``[servers.<name>.namespaces.<name>]`` table are configuration errors, and the
daemon does not start. Under a sim state (``COLLOC_SIM_STATE``), a server whose
``allowed_devices`` names no simulated GPU is created, logs ``no CUDA-capable device
is detected`` and vanishes from ``server list``, as the guide above warns a real one
does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from slurm_colloc.gpu.sim import mps_control as legacy
from slurm_colloc.gpu.sim.mps_control import spawn_server
from slurm_colloc.gpu.sim.mps_protocol import (
    FATAL,
    MAX_LINE,
    NOT_READY,
    PID_FILE,
    PIPE_ENV,
    SOCKET_NAME,
    LineReader,
    MpsError,
    connect,
    format_ready,
    log_dir_from_env,
    peer_credentials,
    ui_command,
)
from slurm_colloc.gpu.sim.mps_state import Client, log_line
from slurm_colloc.units import SizeError, parse_size_mib

PROTOCOL_ENV = "CUDA_MPS_PROTOCOL_VERSION"
SIM_STATE_ENV = "COLLOC_SIM_STATE"
NOT_PERMITTED = "NOTPERMITTED"
TERMINATED = "TERMINATED"
DEFAULT_NS = "default"
VERSION = "615.00 (slurm-colloc simulated MPS v3)"
NAME_RE = re.compile(r"[a-z0-9_]{1,64}")
SERVER_KEYS = frozenset(
    {
        "allowed_devices",
        "pinned_memory_limit",
        "active_thread_percentage",
        "client_priority",
        "uid",
        "locality_domains",
    }
)
NAMESPACE_KEYS = frozenset({"pinned_memory_limit", "active_thread_percentage", "client_priority"})
MODULES = (
    "server",
    "namespace",
    "client",
    "device",
    "sm-partition",
    "feature",
    "memacct",
    "context-share",
)
SIMULATED = ("server", "namespace", "client")
SERVER_COLUMNS = (
    "name",
    "uid",
    "pid",
    "status",
    "pipe-directory",
    "allowed-devices",
    "context-ids",
)
NS_COLUMNS = (
    "name",
    "server",
    "server-status",
    "pinned-memory-limit",
    "active-thread-percentage",
    "client-priority",
    "pipe-directory",
)
CLIENT_COLUMNS = ("pid", "server", "device", "namespace", "cmd")

HELP_V3 = f"""Usage: nvidia-cuda-mps-control [options] [<module> <verb> [args]]

Options:
  -h, --help              Print this message.
  -d, --daemon            Setup the daemon in the background.
  -f, --foreground        Setup the daemon in the foreground.
  -m, --multiuser         Enable multiuser mode.
  -a, --apply <file>      Apply configuration from a TOML file.
  -p, --protocol <2|3>    Protocol 2 (legacy, default) or 3.
  -q, --quit              Quit and stop the control daemon and all running servers.
  -v, --version           Print the version.

Modules: {", ".join(MODULES)}
Use '<module> help' or '<module> <verb> help' for details.
(simulated: {", ".join(SIMULATED)})
"""
HELP_V2 = """Usage: nvidia-cuda-mps-control [-d | -f]
  -d   Start the daemon in the background.
  -f   Start the daemon in the foreground.
Without options, commands are read from stdin (legacy interactive shell).
"""
MODULE_HELP = {
    "server": (
        "server create <name> [--uid=<n>] [--allowed-devices=<devices>]\n"
        "server delete <name> [--force]\n"
        "server list [<name>] [--format=<table|csv>[,noheader]]\n"
        "server set <name> [--pinned-memory-limit=<limit>] [--active-thread-percentage=<pct>]"
        " [--client-priority=<priority>]\n"
        "server get <name> <field>"
    ),
    "namespace": (
        "namespace create <name> --server=<s>\n"
        "namespace delete <name> --server=<s> [--force]\n"
        "namespace list [<name>] [--server=<s>] [--format=<table|csv>[,noheader]]\n"
        "namespace set <name> --server=<s> [--pinned-memory-limit=<limit>]"
        " [--active-thread-percentage=<pct>] [--client-priority=<priority>]\n"
        "namespace get <name> <server> <field>"
    ),
    "client": (
        "client list [--server=<s>] [--all] [--format=<table|csv>[,noheader]]\n"
        "client get <pid> <field>\n"
        "client terminate <pid>"
    ),
}


class CommandError(Exception):
    """A command the daemon refuses; its text is what the user is told."""


class ConfigError(ValueError):
    """A ``-a`` file the daemon refuses to start with."""


def default_pipe_dir() -> Path:
    """``CUDA_MPS_PIPE_DIRECTORY``, else ``/run/nvidia-mps`` for root, ``/tmp/nvidia-mps``."""
    value = os.environ.get(PIPE_ENV)
    if value:
        return Path(value)
    return Path("/run/nvidia-mps" if os.geteuid() == 0 else "/tmp/nvidia-mps")


def _fmt_mib(mib: int | None) -> str:
    if mib is None:
        return "-"
    return f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M"


def _fmt_pct(pct: float | None) -> str:
    return "-" if pct is None else f"{pct:.2f}"


def _parse_limit(text: object) -> int:
    try:
        mib = parse_size_mib(str(text))
    except SizeError as e:
        raise CommandError(f"invalid pinned memory limit {text!r}: {e}") from None
    if mib <= 0:
        raise CommandError(f"invalid pinned memory limit {text!r}: must be positive")
    return mib


def _parse_pct(text: object) -> float:
    try:
        pct = float(str(text))
    except ValueError:
        raise CommandError(f"invalid active thread percentage {text!r}") from None
    if not 1 <= pct <= 100:
        raise CommandError(f"invalid active thread percentage {text!r}: must be 1-100")
    return pct


def _parse_priority(text: object) -> int:
    if str(text) not in ("0", "1"):
        raise CommandError(f"invalid client priority {text!r}: 0 (normal) or 1 (below normal)")
    return int(str(text))


def _check_name(kind: str, name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise CommandError(
            f"invalid {kind} name {name!r}: lowercase letters, digits and underscores, "
            "at most 64 characters"
        )
    return name


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()[:4096]
    except OSError:
        return "-"
    return " ".join(a.decode("utf-8", "replace") for a in raw.split(b"\0") if a) or "-"


def _table(columns: tuple[str, ...], rows: list[list[str]], fmt: str | None) -> str:
    """Render ``rows`` as ``--format=table|csv[,noheader]`` asks (table by default)."""
    parts = (fmt or "table").split(",")
    kind, noheader = parts[0], "noheader" in parts[1:]
    if kind not in ("table", "csv") or any(p != "noheader" for p in parts[1:]):
        raise CommandError(f"invalid format {fmt!r}: table or csv, optionally ,noheader")
    lines: list[list[str]] = (
        []
        if noheader
        else [[c.upper().replace("-", " ") for c in columns] if kind == "table" else list(columns)]
    )
    lines += rows
    if kind == "csv":
        return "\n".join(",".join(r) for r in lines)
    widths = [max((len(r[i]) for r in lines), default=0) for i in range(len(columns))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in lines
    )


@dataclass
class Args:
    """A ``module verb`` command's arguments, as the documentation allows them."""

    positional: list[str]
    options: dict[str, str]
    flags: set[str]

    @classmethod
    def parse(cls, tokens: Iterable[str]) -> Args:
        pos: list[str] = []
        opts: dict[str, str] = {}
        flags: set[str] = set()
        for tok in tokens:
            if tok.startswith("--"):
                key, eq, value = tok[2:].partition("=")
                if eq:
                    opts[key] = value
                else:
                    flags.add(key)
            elif "=" in tok:
                key, _, value = tok.partition("=")
                opts[key] = value
            else:
                pos.append(tok)
        if len(pos) > 3:
            raise CommandError("too many positional arguments (at most 3)")
        return cls(pos, opts, flags)

    def allow(self, options: Iterable[str] = (), flags: Iterable[str] = (), npos: int = 0) -> None:
        """Refuse options, flags and positional arguments the verb does not take."""
        extra = set(self.options) - set(options)
        if extra:
            raise CommandError(f"unknown option --{sorted(extra)[0]}")
        extra = self.flags - set(flags)
        if extra:
            raise CommandError(f"unknown flag --{sorted(extra)[0]}")
        if len(self.positional) > npos:
            raise CommandError(f"unexpected argument {self.positional[npos]!r}")

    def need(self, index: int, what: str) -> str:
        if len(self.positional) <= index:
            raise CommandError(f"missing {what}")
        return self.positional[index]


@dataclass
class Namespace:
    """One namespace of a server: its limits and its ``control`` socket."""

    name: str
    path: Path
    limit_mib: int | None = None
    pct: float | None = None
    priority: int | None = None
    listener: socket.socket | None = None


@dataclass
class Attached:
    """A CUDA client granted by a server, in one namespace."""

    client: Client
    server: str
    namespace: str


@dataclass
class V3Server:
    """One named MPS server: an idle process, its namespaces and their sockets."""

    name: str
    uid: int
    allowed: str | None
    path: Path
    proc: subprocess.Popen[bytes]
    log: TextIO
    namespaces: dict[str, Namespace] = field(default_factory=dict)
    listener: socket.socket | None = None
    faulted: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def srv(self, msg: str) -> None:
        self.log.write(log_line("Server", self.pid, msg))


def parse_config(data: dict[str, Any], multiuser: bool) -> dict[str, dict[str, Any]]:
    """Validate a ``-a`` file as documented; returns its ``servers`` table."""
    unknown = set(data) - {"schema_version", "servers", "features"}
    if unknown:
        raise ConfigError(f"unknown top-level key {sorted(unknown)[0]!r}")
    if "schema_version" in data and data["schema_version"] != "1.0":
        raise ConfigError(f"unsupported schema_version {data['schema_version']!r}")
    servers = data.get("servers", {})
    if not isinstance(servers, dict):
        raise ConfigError("[servers] must be a table")
    for name, table in servers.items():
        if not isinstance(table, dict) or not NAME_RE.fullmatch(name):
            raise ConfigError(f"[servers.{name}]: invalid server name or not a table")
        bad = set(table) - SERVER_KEYS - {"namespaces", "devices"}
        if bad:
            raise ConfigError(f"[servers.{name}]: unknown key {sorted(bad)[0]!r}")
        if "locality_domains" in table and not isinstance(table["locality_domains"], bool):
            raise ConfigError(f"[servers.{name}]: locality_domains must be a boolean")
        if "uid" in table and (not isinstance(table["uid"], int) or table["uid"] < 0):
            raise ConfigError(f"[servers.{name}]: uid must be a non-negative integer")
        if multiuser and table.get("uid", 0) != 0:
            raise ConfigError(f"[servers.{name}]: in multiuser mode only uid 0 is allowed")
        try:
            _server_limits(table)
            for ns_name, ns in table.get("namespaces", {}).items():
                if not isinstance(ns, dict) or not NAME_RE.fullmatch(ns_name):
                    raise ConfigError(f"[servers.{name}.namespaces.{ns_name}]: invalid")
                bad = set(ns) - NAMESPACE_KEYS
                if bad:
                    raise ConfigError(
                        f"[servers.{name}.namespaces.{ns_name}]: unknown key {sorted(bad)[0]!r}"
                    )
                _server_limits(ns)
        except CommandError as e:
            raise ConfigError(f"[servers.{name}]: {e}") from None
        for dev in table.get("devices", []):
            if not isinstance(dev, dict) or "uuid" not in dev:
                raise ConfigError(f"[[servers.{name}.devices]] needs a uuid")
            for part in dev.get("sm_partitions", []):
                if "name" not in part or "chunks" not in part:
                    raise ConfigError(
                        f"[[servers.{name}.devices.sm_partitions]] needs name, chunks"
                    )
    return servers


def _server_limits(table: dict[str, Any]) -> tuple[int | None, float | None, int | None]:
    limit = _parse_limit(table["pinned_memory_limit"]) if "pinned_memory_limit" in table else None
    pct = (
        _parse_pct(table["active_thread_percentage"])
        if "active_thread_percentage" in table
        else None
    )
    prio = _parse_priority(table["client_priority"]) if "client_priority" in table else None
    return limit, pct, prio


def _sim_devices() -> tuple[set[str], int] | None:
    """The simulated GPUs' UUIDs and count when a sim state is named, else None."""
    state = os.environ.get(SIM_STATE_ENV)
    if not state:
        return None
    from slurm_colloc.gpu.sim.state import load_spec

    try:
        spec = load_spec(state)
    except Exception:  # noqa: BLE001 - no readable state: no device check
        return None
    return {spec.uuid(i) for i in range(spec.gpu_count)}, spec.gpu_count


class V3Daemon(legacy.SelectLoop):
    """The v3 control daemon's state machine (one per pipe directory, i.e. per node)."""

    def __init__(
        self,
        pipe_dir: Path,
        log_dir: Path,
        multiuser: bool,
        servers: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Bind ``control``, apply the configuration (if any); refuse a second daemon."""
        self.owner = os.geteuid()
        if multiuser and self.owner != 0:
            raise MpsError("multiuser mode requires root")
        super().__init__()
        self.pipe_dir, self.log_dir, self.multiuser = pipe_dir, log_dir, multiuser
        self.servers: dict[str, V3Server] = {}
        self.routes: dict[socket.socket, tuple[str | None, str | None]] = {}
        self.pending: dict[socket.socket, tuple[tuple[str | None, str | None], bytes]] = {}
        self.clients: dict[socket.socket, Attached] = {}
        legacy.refuse_if_running(pipe_dir, pipe_dir)
        pipe_dir.mkdir(parents=True, exist_ok=True)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.control = open(log_dir / "control.log", "a", buffering=1)  # noqa: SIM115
        self.listener = self._listen(pipe_dir, (None, None))
        (pipe_dir / PID_FILE).write_text(f"{os.getpid()}\n")
        self.ctl(f"Starting control daemon (protocol 3{', multiuser' if multiuser else ''})")
        self.ctl(f"To connect CUDA applications to this daemon, set {PIPE_ENV}={pipe_dir}")
        for name, table in (servers or {}).items():
            limit, pct, prio = _server_limits(table)
            server = self._create_server(
                name, int(table.get("uid", self.owner)), table.get("allowed_devices")
            )
            if server is None:
                continue
            self._set(server.namespaces[DEFAULT_NS], limit, pct, prio)
            for ns_name, ns in table.get("namespaces", {}).items():
                target = server.namespaces.get(ns_name) or self._create_namespace(server, ns_name)
                self._set(target, *_server_limits(ns))

    def ctl(self, msg: str) -> None:
        self.control.write(log_line("Control", os.getpid(), msg))

    # --- sockets ------------------------------------------------------------------
    def _listen(self, directory: Path, route: tuple[str | None, str | None]) -> socket.socket:
        sock = self._listen_on(directory / SOCKET_NAME)  # mode 0666: see the module doc
        self.routes[sock] = route
        return sock

    def _unlisten(self, sock: socket.socket | None, directory: Path) -> None:
        if sock is None:
            return
        self.routes.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(sock)
        sock.close()
        with contextlib.suppress(OSError):
            (directory / SOCKET_NAME).unlink()

    @staticmethod
    def _mkdir(path: Path) -> Path:
        path.mkdir(exist_ok=True)
        os.chmod(path, 0o755)  # noqa: S103 - stand-in choice: see module doc
        return path

    # --- servers and namespaces ---------------------------------------------------
    def _create_server(self, name: str, uid: int, allowed: str | None) -> V3Server | None:
        """Start a named server; None when it died at once (no such device)."""
        if name in self.servers:
            raise CommandError(f"server '{name}' already exists")
        path = self._mkdir(self.pipe_dir / name)
        (self.log_dir / name).mkdir(exist_ok=True)
        log = open(self.log_dir / name / "server.log", "a", buffering=1)  # noqa: SIM115
        proc = spawn_server()  # the daemon's user: a server's uid is bookkeeping here
        server = V3Server(name, uid, allowed, path, proc, log)
        self.ctl(
            f"Starting new server {proc.pid} '{name}' for user {uid}"
            f" (allowed devices: {allowed or 'all'})"
        )
        if not self._devices_exist(allowed):
            server.srv("no CUDA-capable device is detected")
            self.ctl(f"Server {proc.pid} '{name}' exited: no CUDA-capable device is detected")
            proc.terminate()
            proc.wait()
            log.close()
            shutil.rmtree(path, ignore_errors=True)
            return None
        with contextlib.suppress(OSError):
            os.mkfifo(path / "log", 0o600)
        server.listener = self._listen(path, (name, None))
        self.servers[name] = server
        self._create_namespace(server, DEFAULT_NS)
        server.srv(f"Server {name} ready")
        return server

    @staticmethod
    def _devices_exist(allowed: str | None) -> bool:
        sim = _sim_devices()
        if sim is None or not allowed:
            return True
        uuids, count = sim
        for dev in (d.strip() for d in allowed.split(",")):
            if dev.isdigit():
                ok = int(dev) < count
            else:
                ok = dev.startswith("GPU-") and any(u.startswith(dev) for u in uuids)
            if not ok:
                return False
        return True

    def _create_namespace(self, server: V3Server, name: str) -> Namespace:
        if name in server.namespaces:
            raise CommandError(f"namespace '{name}' already exists on server '{server.name}'")
        path = self._mkdir(server.path / name)
        ns = Namespace(name, path)
        ns.listener = self._listen(path, (server.name, name))
        server.namespaces[name] = ns
        self.ctl(f"Namespace '{name}' created on server '{server.name}'")
        return ns

    def _delete_namespace(self, server: V3Server, ns: Namespace) -> None:
        for att in self._attached(server.name, ns.name):
            self._terminate(att, f"namespace '{ns.name}' deleted")
        self._unlisten(ns.listener, ns.path)
        with contextlib.suppress(OSError):
            ns.path.rmdir()
        server.namespaces.pop(ns.name, None)
        self.ctl(f"Namespace '{ns.name}' deleted from server '{server.name}'")

    def _delete_server(self, server: V3Server) -> None:
        for ns in list(server.namespaces.values()):
            self._delete_namespace(server, ns)
        self._unlisten(server.listener, server.path)
        if server.proc.poll() is None:
            server.proc.terminate()
            try:
                server.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()
        server.srv("Server exited")
        server.log.close()
        shutil.rmtree(server.path, ignore_errors=True)
        self.servers.pop(server.name, None)
        self.ctl(f"Server {server.pid} '{server.name}' deleted")

    @staticmethod
    def _set(ns: Namespace, limit: int | None, pct: float | None, prio: int | None) -> None:
        if limit is not None:
            ns.limit_mib = limit
        if pct is not None:
            ns.pct = pct
        if prio is not None:
            ns.priority = prio

    def _attached(self, server: str, namespace: str | None = None) -> list[Attached]:
        return [
            a
            for a in self.clients.values()
            if a.server == server and namespace in (None, a.namespace)
        ]

    # --- clients ------------------------------------------------------------------
    def _route(self, route: tuple[str | None, str | None], uid: int) -> tuple[str, str] | None:
        """(server, namespace) a new client reaches through the socket it used."""
        server, ns = route
        if server is not None:
            return server, ns or DEFAULT_NS
        # $PIPE/control: UID-based auto-routing (documented for legacy clients). Which
        # server a uid reaches is not documented: its own, else (multiuser) the first.
        mine = sorted(n for n, s in self.servers.items() if s.uid == uid)
        if mine:
            return mine[0], DEFAULT_NS
        if self.multiuser and self.servers:
            return sorted(self.servers)[0], DEFAULT_NS
        return None

    def _new_client(
        self, conn: socket.socket, route: tuple[str | None, str | None], device: int
    ) -> None:
        pid, uid, _ = peer_credentials(conn)
        target = self._route(route, uid)
        server = self.servers.get(target[0]) if target else None
        ns = server.namespaces.get(target[1]) if server and target else None
        if server is None or ns is None:
            self.ctl(f"NEW CLIENT {pid} from user {uid}: no server for it")
            self._refuse(conn, NOT_PERMITTED)
            return
        if not self.multiuser and uid != server.uid:
            self.ctl(
                f"NEW CLIENT {pid} from user {uid}: server '{server.name}' is user "
                f"{server.uid}'s and the daemon is not multiuser: not permitted"
            )
            self._refuse(conn, NOT_PERMITTED)
            return
        if server.faulted:
            self.ctl(
                f"NEW CLIENT {pid} from user {uid}: server '{server.name}' is recovering "
                "from a fatal exception: not ready"
            )
            self._refuse(conn, NOT_READY)
            return
        client = Client(conn, pid, uid, device)
        self.clients[conn] = Attached(client, server.name, ns.name)
        line = format_ready(
            server.pid, ns.limit_mib, ns.pct if ns.pct is not None else 100.0, server.allowed
        )
        server.srv(f"New client {pid} of user {uid} connected (namespace {ns.name})")
        try:
            conn.sendall(line.encode() + b"\n")
        except OSError:
            self._drop(conn)

    def _refuse(self, conn: socket.socket, word: str) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(f"{word}\n".encode())
        self._close(conn)

    def _terminate(self, att: Attached, why: str) -> None:
        with contextlib.suppress(OSError):
            att.client.conn.sendall(f"{TERMINATED}\n".encode())
        server = self.servers.get(att.server)
        if server is not None:
            server.srv(f"Client {att.client.pid} terminated ({why})")
        self._drop(att.client.conn)

    def _drop(self, conn: socket.socket) -> None:
        att = self.clients.pop(conn, None)
        self._close(conn)
        if att is None:
            return
        server = self.servers.get(att.server)
        if server is None:
            return
        server.srv(f"Client {att.client.pid} disconnected")
        if server.faulted and not self._attached(server.name):
            server.faulted = False
            server.srv("All clients exited: recovered")

    def _client_data(self, att: Attached, data: bytes) -> None:
        for _ in range(att.client.take_faults(data)):
            self._fault(att)

    def _fault(self, att: Attached) -> None:
        """A client's fatal GPU exception: every other client of the *server* hears of it.

        The server is shared by every user's namespaces on the GPU, so in multiuser
        mode one user's fault reaches every co-tenant (legacy containment semantics,
        carried over: the v3 pages say nothing else).
        """
        server = self.servers.get(att.server)
        if server is None or server.faulted:
            return
        server.faulted = True
        others = [a for a in self._attached(server.name) if a is not att]
        for a in others:
            with contextlib.suppress(OSError):
                a.client.conn.sendall(f"{FATAL}\n".encode())
        server.srv(
            f"Client {att.client.pid} encountered a fatal GPU exception; reported to "
            f"{len(others)} other client(s); new clients refused until all have exited"
        )

    # --- commands -----------------------------------------------------------------
    def command(self, argv: list[str], uid: int) -> tuple[int, str]:
        """Run one ``module verb ...`` command for a UI peer of ``uid``: (status, text)."""
        self.ctl(f"Cmd (user {uid}): {' '.join(argv)}")
        try:
            if argv == ["quit"]:
                self._privileged(uid, "quit")
                self.running = False
                return 0, ""
            if len(argv) < 2:
                module = argv[0] if argv else ""
                if module in MODULE_HELP:
                    return 0, MODULE_HELP[module]
                raise CommandError(f"usage: <module> <verb> [args]; modules: {', '.join(MODULES)}")
            module, verb, rest = argv[0], argv[1], argv[2:]
            if module not in MODULES:
                raise CommandError(f"unknown module '{module}'")
            if module not in SIMULATED:
                raise CommandError(f"module '{module}' is not simulated by this stand-in")
            if verb == "help" or rest[-1:] == ["help"]:
                return 0, MODULE_HELP[module]
            handler = getattr(self, f"_{module}_{verb}", None)
            if handler is None:
                raise CommandError(f"unknown verb '{verb}' for module '{module}'")
            if verb not in ("list", "get"):
                self._privileged(uid, f"{module} {verb}")
            out: str = handler(Args.parse(rest))
            return 0, out
        except CommandError as e:
            self.ctl(f"Cmd failed: {e}")
            return 1, str(e)

    def _privileged(self, uid: int, what: str) -> None:
        if uid not in (0, self.owner):
            raise CommandError(f"{what}: permission denied (uid {uid} does not own this daemon)")

    def _server(self, name: str) -> V3Server:
        server = self.servers.get(name)
        if server is None:
            raise CommandError(f"server '{name}' not found")
        return server

    def _namespace(self, server: V3Server, name: str) -> Namespace:
        ns = server.namespaces.get(name)
        if ns is None:
            raise CommandError(f"namespace '{name}' not found on server '{server.name}'")
        return ns

    def _limits(self, a: Args) -> tuple[int | None, float | None, int | None]:
        table = {
            k.replace("-", "_"): v
            for k, v in a.options.items()
            if k in ("pinned-memory-limit", "active-thread-percentage", "client-priority")
        }
        if not table:
            raise CommandError("at least one option flag is required")
        return _server_limits(table)

    def _server_create(self, a: Args) -> str:
        a.allow(("uid", "allowed-devices", "locality-domains"), npos=1)
        if not a.positional:
            raise CommandError("server create: the stand-in needs a <name>")
        name = _check_name("server", a.positional[0])
        uid = self.owner
        if "uid" in a.options:
            if not a.options["uid"].isdigit():
                raise CommandError(f"invalid uid {a.options['uid']!r}")
            uid = int(a.options["uid"])
        if self.multiuser and uid != 0:
            raise CommandError("in multiuser mode only --uid=0 is allowed")
        self._create_server(name, uid, a.options.get("allowed-devices"))
        return ""

    def _server_delete(self, a: Args) -> str:
        a.allow(flags=("force",), npos=1)
        server = self._server(a.need(0, "<name>"))
        busy = self._attached(server.name)
        if busy and "force" not in a.flags:
            raise CommandError(
                f"server '{server.name}' has {len(busy)} active client(s); "
                "use --force to terminate them"
            )
        self._delete_server(server)
        return ""

    def _server_row(self, s: V3Server) -> list[str]:
        status = "Ready" if s.proc.poll() is None else "Exited"
        return [s.name, str(s.uid), str(s.pid), status, str(s.path), s.allowed or "all", "-"]

    def _server_list(self, a: Args) -> str:
        a.allow(("format",), npos=1)
        names = [self._server(a.positional[0]).name] if a.positional else sorted(self.servers)
        rows = [self._server_row(self.servers[n]) for n in names]
        return _table(SERVER_COLUMNS, rows, a.options.get("format"))

    def _server_get(self, a: Args) -> str:
        a.allow(npos=2)
        row = self._server_row(self._server(a.need(0, "<name>")))
        fields = dict(zip(SERVER_COLUMNS, row, strict=True))
        key = a.need(1, "<field>")
        if key not in fields or key == "context-ids":
            raise CommandError(f"unknown server field '{key}'")
        return fields[key]

    def _server_set(self, a: Args) -> str:
        a.allow(
            (
                "uid",
                "pinned-memory-limit",
                "active-thread-percentage",
                "locality-domains",
                "client-priority",
            ),
            npos=1,
        )
        server = self._server(a.need(0, "<name>"))
        self._set(server.namespaces[DEFAULT_NS], *self._limits(a))
        return ""

    def _namespace_create(self, a: Args) -> str:
        a.allow(("server",), npos=1)
        name = _check_name("namespace", a.need(0, "<name>"))
        server = self._server(a.options.get("server") or "")
        self._create_namespace(server, name)
        return ""

    def _namespace_delete(self, a: Args) -> str:
        a.allow(("server",), flags=("force",), npos=1)
        server = self._server(a.options.get("server") or "")
        ns = self._namespace(server, a.need(0, "<name>"))
        if ns.name == DEFAULT_NS:
            raise CommandError("the default namespace cannot be deleted")
        busy = self._attached(server.name, ns.name)
        if busy and "force" not in a.flags:
            raise CommandError(
                f"namespace '{ns.name}' has {len(busy)} active client(s); use --force"
            )
        self._delete_namespace(server, ns)
        return ""

    def _ns_row(self, server: V3Server, ns: Namespace) -> list[str]:
        status = "Ready" if server.proc.poll() is None else "Exited"
        prio = "-" if ns.priority is None else str(ns.priority)
        return [
            ns.name,
            server.name,
            status,
            _fmt_mib(ns.limit_mib),
            _fmt_pct(ns.pct),
            prio,
            str(ns.path),
        ]

    def _namespace_list(self, a: Args) -> str:
        a.allow(("server", "format"), npos=1)
        servers = (
            [self._server(a.options["server"])]
            if "server" in a.options
            else [self.servers[n] for n in sorted(self.servers)]
        )
        rows = [
            self._ns_row(s, ns)
            for s in servers
            for ns in s.namespaces.values()
            if not a.positional or ns.name == a.positional[0]
        ]
        return _table(NS_COLUMNS, rows, a.options.get("format"))

    def _namespace_set(self, a: Args) -> str:
        a.allow(
            ("server", "pinned-memory-limit", "active-thread-percentage", "client-priority"), npos=1
        )
        server = self._server(a.options.get("server") or "")
        self._set(self._namespace(server, a.need(0, "<name>")), *self._limits(a))
        return ""

    def _namespace_get(self, a: Args) -> str:
        a.allow(npos=3)
        server = self._server(a.need(1, "<server>"))
        ns = self._namespace(server, a.need(0, "<name>"))
        fields = dict(zip(NS_COLUMNS, self._ns_row(server, ns), strict=True))
        key = a.need(2, "<field>")
        if key not in fields:
            raise CommandError(f"unknown namespace field '{key}'")
        return fields[key]

    def _client_row(self, att: Attached) -> list[str]:
        c = att.client
        return [str(c.pid), att.server, str(c.device), att.namespace, _cmdline(c.pid)]

    def _client_list(self, a: Args) -> str:
        a.allow(("server", "format"), flags=("all",))
        if "server" in a.options:
            self._server(a.options["server"])
        rows = [
            self._client_row(att)
            for att in self.clients.values()
            if a.options.get("server") in (None, att.server)
        ]
        return _table(
            CLIENT_COLUMNS, sorted(rows, key=lambda r: int(r[0])), a.options.get("format")
        )

    def _by_pid(self, text: str) -> Attached:
        for att in self.clients.values():
            if str(att.client.pid) == text:
                return att
        raise CommandError(f"no client with PID {text}")

    def _client_get(self, a: Args) -> str:
        a.allow(npos=2)
        att = self._by_pid(a.need(0, "<pid>"))
        fields = dict(zip(CLIENT_COLUMNS, self._client_row(att), strict=True))
        fields.update({"pci-id": "-", "linux-ns": "-", "maws-ns": "-"})
        key = a.need(1, "<field>")
        if key not in fields or key == "namespace":
            raise CommandError(f"unknown client field '{key}'")
        return fields[key]

    def _client_terminate(self, a: Args) -> str:
        a.allow(npos=1)
        self._terminate(self._by_pid(a.need(0, "<pid>")), "client terminate")
        return ""

    # --- event loop -----------------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        conn.settimeout(2.0)
        self.pending[conn] = (self.routes[listener], b"")
        self.sel.register(conn, selectors.EVENT_READ)

    def _readable(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if conn in self.clients:
            if data:
                self._client_data(self.clients[conn], data)
            else:
                self._drop(conn)
            return
        if not data:
            self._close(conn)
            return
        if conn in self.pending:
            route, buf = self.pending.pop(conn)
            buf += data
            if b"\n" not in buf:
                if len(buf) <= MAX_LINE:
                    self.pending[conn] = (route, buf)
                else:
                    self._close(conn)
                return
            first, rest = buf.split(b"\n", 1)
            words = first.decode("utf-8", "replace").split()
            if words == ["UI"] and route == (None, None):
                self.ui[conn] = (peer_credentials(conn)[1], b"")
                data = rest
            elif len(words) == 2 and words[0] == "CLIENT" and words[1].isdigit():
                self._new_client(conn, route, int(words[1]))
                if rest and conn in self.clients:
                    self._client_data(self.clients[conn], rest)
                return
            else:
                self.ctl("Unable to read new connection type information")
                self._close(conn)
                return
        self._ui_data(conn, data)

    def _answer(self, line: bytes, uid: int) -> bytes:
        """A UI line is a JSON list of words; the answer is the status digit, then text."""
        try:
            argv = json.loads(line)
            if not isinstance(argv, list) or not all(isinstance(x, str) for x in argv):
                raise ValueError("not a list of strings")
            status, text = self.command(argv, uid)
        except ValueError as e:
            status, text = 1, f"malformed command: {e}"
        return f"{status}{text}".encode()

    def _close(self, conn: socket.socket) -> None:
        self.ui.pop(conn, None)
        self.pending.pop(conn, None)
        self.clients.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn)
        conn.close()

    def _listens(self, sock: socket.socket) -> bool:
        return sock in self.routes

    def _after_events(self) -> None:
        """Servers whose process exited are deleted."""
        for server in list(self.servers.values()):
            if server.proc.poll() is not None:
                self.ctl(
                    f"Server {server.pid} '{server.name}' exited with status "
                    f"{server.proc.returncode}"
                )
                self._delete_server(server)

    def shutdown(self) -> None:
        """Terminate clients, stop servers, remove what the daemon made in the pipe dir."""
        for server in list(self.servers.values()):
            for att in self._attached(server.name):
                self._terminate(att, "control daemon quit")
            self._delete_server(server)
        for conn in list(self.ui) + list(self.pending):
            self._close(conn)
        self._unlisten(self.listener, self.pipe_dir)
        self.sel.close()
        with contextlib.suppress(OSError):
            (self.pipe_dir / PID_FILE).unlink()
        self.ctl("Exit")
        self.control.close()


# --- the program ------------------------------------------------------------------
@dataclass
class Options:
    """Top-level options, then the ``module verb`` words."""

    help: bool = False
    daemon: bool = False
    foreground: bool = False
    multiuser: bool = False
    apply: str | None = None
    protocol: int = 2
    quit: bool = False
    version: bool = False
    command: list[str] = field(default_factory=list)


def parse_options(argv: list[str]) -> Options:
    """Options as the v3 page lists them; the first non-option word starts a command."""
    o = Options()
    flags = {
        "-h": "help",
        "--help": "help",
        "-d": "daemon",
        "--daemon": "daemon",
        "-f": "foreground",
        "--foreground": "foreground",
        "-m": "multiuser",
        "--multiuser": "multiuser",
        "-q": "quit",
        "--quit": "quit",
        "-v": "version",
        "--version": "version",
    }
    protocol: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in flags:
            setattr(o, flags[arg], True)
        elif arg in ("-a", "--apply", "-p", "--protocol"):
            if i + 1 >= len(argv):
                raise ValueError(f"option {arg} needs a value")
            value, i = argv[i + 1], i + 1
            if arg in ("-a", "--apply"):
                o.apply = value
            else:
                protocol = value
        elif arg.startswith(("--apply=", "--protocol=")):
            key, _, value = arg.partition("=")
            if key == "--apply":
                o.apply = value
            else:
                protocol = value
        elif arg.startswith("-"):
            raise ValueError(f"unknown option {arg}")
        else:
            o.command = argv[i:]
            break
        i += 1
    env = os.environ.get(PROTOCOL_ENV)
    chosen = env if env else protocol  # the variable wins over -p, as documented
    if chosen is not None and chosen not in ("2", "3"):
        raise ValueError(f"invalid protocol {chosen!r}: 2 or 3")
    if not (o.daemon or o.foreground or o.help):
        # documented: a new invocation follows a running daemon's protocol, whatever
        # its own -p or variable say
        chosen = str(running_protocol(default_pipe_dir()) or chosen or 2)
    o.protocol = int(chosen or 2)
    if o.daemon and o.foreground:
        raise ValueError("-d and -f are exclusive")
    return o


def running_protocol(pipe_dir: Path) -> int | None:
    """Protocol of the daemon answering in ``pipe_dir`` (None: no daemon answers).

    A v3 stand-in answers a UI ``server list`` with its status digit; the legacy
    stand-in answers anything it does not know with ``Unrecognized command``.
    """
    try:
        sock = connect(pipe_dir, timeout=2.0)
    except MpsError:
        return None
    with sock:
        try:
            sock.sendall(b"UI\n")
            answer = ui_command(sock, LineReader(sock), json.dumps(["server", "list"]))
        except (MpsError, OSError):
            return None
    return 3 if answer[:1] in ("0", "1") else 2


def _load_config(path: str | None, multiuser: bool) -> dict[str, dict[str, Any]] | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    return parse_config(data, multiuser)


def _make_daemon(o: Options) -> Callable[[], V3Daemon]:
    servers = _load_config(o.apply, o.multiuser)  # refused before any fork

    def make() -> V3Daemon:
        return V3Daemon(default_pipe_dir(), log_dir_from_env(), o.multiuser, servers)

    return make


def _announce(pipe_dir: str) -> None:
    sys.stdout.write(f"To connect CUDA applications to this daemon, set {PIPE_ENV}={pipe_dir}\n")
    sys.stdout.flush()


_REFUSED = (MpsError, CommandError, OSError)


def run_foreground(make: Callable[[], V3Daemon]) -> int:
    """``-f``: serve in this process."""
    return legacy.run_foreground(make, refused=_REFUSED, on_ready=_announce)


def daemonize(make: Callable[[], V3Daemon]) -> int:
    """``-d``: double-fork, detach; return once the sockets listen and servers run."""
    return legacy.daemonize(
        make, refused=_REFUSED, on_ready=_announce, failed="MPS v3 stand-in failed to start"
    )


def run_command(argv: list[str], out: TextIO, err: TextIO) -> int:
    """Send one command to the running daemon; print its answer; 0 or 1."""
    pipe_dir = default_pipe_dir()
    try:
        sock = connect(pipe_dir)
    except MpsError as e:
        err.write(f"Cannot find MPS control daemon process ({e})\n")
        return 1
    with sock:
        try:
            sock.sendall(b"UI\n")
            answer = ui_command(sock, LineReader(sock), json.dumps(argv))
        except (MpsError, OSError) as e:
            err.write(f"MPS control daemon connection lost: {e}\n")
            return 1
    if answer[:1] not in ("0", "1"):
        err.write(f"unexpected answer (is the daemon protocol 3?): {answer[:200]!r}\n")
        return 1
    text = answer[1:]
    stream = out if answer[0] == "0" else err
    if text:
        stream.write(text.rstrip("\n") + "\n")
    return int(answer[0])


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``colloc-sim-mps-control-v3`` (options of the real program)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        o = parse_options(args)
    except ValueError as e:
        sys.stderr.write(f"nvidia-cuda-mps-control: {e}\n")
        return 1
    if o.protocol == 2:
        if o.help:
            sys.stdout.write(HELP_V2)
            return 0
        if o.multiuser or o.apply or o.command or o.quit or o.version:
            sys.stderr.write("nvidia-cuda-mps-control: this option needs protocol 3 (-p 3)\n")
            return 1
        return legacy.main(["-d"] if o.daemon else ["-f"] if o.foreground else [])
    if o.help:
        sys.stdout.write(HELP_V3)
        return 0
    if o.version:
        sys.stdout.write(f"{VERSION}\n")
        return 0
    if o.quit:
        return run_command(["quit"], sys.stdout, sys.stderr)
    if o.daemon or o.foreground:
        try:
            make = _make_daemon(o)
        except ConfigError as e:
            sys.stderr.write(f"nvidia-cuda-mps-control: configuration error: {e}\n")
            return 1
        return daemonize(make) if o.daemon else run_foreground(make)
    if not o.command:
        sys.stderr.write(
            "nvidia-cuda-mps-control: protocol 3 takes '<module> <verb> [args]' (see -h)\n"
        )
        return 1
    return run_command(o.command, sys.stdout, sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
