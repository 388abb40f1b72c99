"""The UI commands of the simulated MPS control daemon (``start_server``,
``set_default_device_pinned_mem_limit``, ...), as NVIDIA's documentation lists them.

A mixin of :class:`~slurm_colloc.gpu.sim.mps_control.Daemon`: the commands read and
change the daemon's state through the attributes and the few server operations
declared here; the event loop and the scheduling stay in the daemon.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from slurm_colloc.gpu.sim.mps_state import ControlLog, Server
from slurm_colloc.units import SizeError, limit_for, parse_size_mib


class ControlCommands(ABC):
    """``command(line, uid)`` and one handler per UI command."""

    log: ControlLog
    owner: int
    servers: list[Server]
    default_limits: dict[int | None, int]
    default_pct: float
    running: bool

    @abstractmethod
    def _active(self) -> Server | None: ...

    @abstractmethod
    def _start_server(self, uid: int) -> Server: ...

    @abstractmethod
    def _stop_server(self, server: Server, force: bool = False) -> None: ...

    @abstractmethod
    def _schedule(self) -> None: ...

    def command(self, line: str, uid: int) -> str:
        """Run one UI command; returns its output (may be empty)."""
        words = line.split()
        if not words:
            return ""
        cmd, args = words[0], words[1:]
        self.log.ctl(f"Cmd:{line.strip()}")
        privileged = uid in (0, self.owner)
        handler = self._handlers().get(cmd)
        if handler is None:
            return f"Unrecognized command: {cmd}"
        if not cmd.startswith("get_") and not privileged:
            return f"{cmd}: permission denied (uid {uid} does not own this daemon)"
        try:
            return handler(args)
        except (ValueError, IndexError, SizeError) as e:
            return f"{cmd}: invalid arguments {' '.join(args)!r}: {e}"

    def _handlers(self) -> dict[str, Callable[[list[str]], str]]:
        return {
            "get_server_list": lambda a: "\n".join(str(s.pid) for s in self.servers),
            "get_client_list": self._get_client_list,
            "get_server_status": self._get_server_status,
            "start_server": self._start_server_cmd,
            "shutdown_server": self._shutdown_server_cmd,
            "set_default_device_pinned_mem_limit": self._set_limit,
            "get_default_device_pinned_mem_limit": self._get_limit,
            "set_device_pinned_mem_limit": self._set_server_limit,
            "get_device_pinned_mem_limit": self._get_server_limit,
            "set_default_active_thread_percentage": self._set_pct,
            "get_default_active_thread_percentage": lambda a: f"{self.default_pct:.1f}",
            "quit": self._quit,
        }

    def _server_by_pid(self, text: str) -> Server:
        pid = int(text)
        for s in self.servers:
            if s.pid == pid:
                return s
        raise ValueError(f"no server with PID {pid}")

    def _get_client_list(self, args: list[str]) -> str:
        return "\n".join(str(c.pid) for c in self._server_by_pid(args[0]).clients)

    def _get_server_status(self, args: list[str]) -> str:
        return "TERMINATING" if self._server_by_pid(args[0]).terminating else "ACTIVE"

    def _start_server_cmd(self, args: list[str]) -> str:
        if len(args) != 2 or args[0] != "-uid":
            raise ValueError("usage: start_server -uid UID")
        uid = int(args[1])
        active = self._active()
        if active is not None and active.uid == uid:
            return ""
        if active is not None:
            return (
                f"A server for user {active.uid} is running (PID {active.pid}); one server per UID"
            )
        self._start_server(uid)
        return ""

    def _shutdown_server_cmd(self, args: list[str]) -> str:
        server = self._server_by_pid(args[0])
        if "-f" in args[1:]:
            self._stop_server(server, force=True)
        else:
            server.terminating = True
        self._schedule()
        return ""

    def _set_limit(self, args: list[str]) -> str:
        if len(args) != 2:
            raise ValueError("usage: set_default_device_pinned_mem_limit DEV VALUE (e.g. 0 8G)")
        dev = int(args[0])
        if dev < 0:
            raise ValueError("device index must not be negative")
        self.default_limits[dev] = parse_size_mib(args[1])
        return ""

    def _set_server_limit(self, args: list[str]) -> str:
        """``set_device_pinned_mem_limit PID DEV VALUE``: a running server's limit.

        Applies to clients that connect to that server afterwards (connected clients
        keep the limit they were granted), as the server-side default does.
        """
        if len(args) != 3:
            raise ValueError("usage: set_device_pinned_mem_limit PID DEV VALUE (e.g. 4242 0 8G)")
        server = self._server_by_pid(args[0])
        dev = int(args[1])
        if dev < 0:
            raise ValueError("device index must not be negative")
        server.limits[dev] = parse_size_mib(args[2])
        return ""

    def _get_server_limit(self, args: list[str]) -> str:
        if len(args) != 2:
            raise ValueError("usage: get_device_pinned_mem_limit PID DEV")
        limit = limit_for(self._server_by_pid(args[0]).limits, int(args[1]))
        return "0" if limit is None else f"{limit}M"

    def _get_limit(self, args: list[str]) -> str:
        limit = limit_for(self.default_limits, int(args[0]))
        return "0" if limit is None else f"{limit}M"

    def _set_pct(self, args: list[str]) -> str:
        pct = float(args[0])
        if not 0 < pct <= 100:
            raise ValueError("percentage must be in (0, 100]")
        self.default_pct = pct
        return ""

    def _quit(self, args: list[str]) -> str:
        self.running = False
        return ""
