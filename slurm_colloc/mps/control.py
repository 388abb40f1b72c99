"""Drive one MPS control daemon: start it, send it commands, stop it, and know it.

The same code drives the real ``nvidia-cuda-mps-control`` and the simulation's
stand-in; only the binary in ``CollocConfig.mps_control`` differs. Commands go over
the program's stdin exactly as an admin would type them, never through a shell.

One daemon serves one (GPU, user) pair, with its own pipe and log directory (see
:mod:`slurm_colloc.mps.tenancy`). The pipe directory is handed to the user once the
daemon runs, so everything in it is the user's to replace: a job once removed the
``control`` socket and the pid file there and wrote another user's pid into
``nvidia-cuda-mps-control.pid``; the epilog then sent that process SIGTERM. So root
learns the daemon's identity once, while the pipe directory is still root's, and
keeps it in root-owned state (:class:`DaemonIdentity`: pid, kernel start time,
program, pipe directory). Every later signal goes only to a process that still
matches that identity in ``/proc``; nothing in the pipe directory is read again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from slurm_colloc import priority, procfs, waits

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_SOCKET = "control"
CONTROL_SOCKET_TYPES = (socket.SOCK_SEQPACKET, socket.SOCK_STREAM)
"""What NVIDIA's daemon listens on (SEQPACKET, seen on hardware), then the other kind."""
STATE_FILE = "daemon.json"
"""In the (GPU, user) directory (root 0755), beside ``pipe/``: root 0600."""
MAX_SMALL_FILE = 64


class MpsControlError(RuntimeError):
    """The control daemon could not be started or did not answer."""


def read_small_file(path: Path, *, owner: int | None = 0, limit: int = MAX_SMALL_FILE) -> str:
    """Read a tiny regular file without following links or blocking on a FIFO.

    Raises OSError for anything but a regular file of ``owner`` (None: any owner)
    that fits in ``limit`` bytes.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file")
        if owner is not None and st.st_uid != owner:
            raise OSError(f"{path}: owned by uid {st.st_uid}, not {owner}")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(f"{path}: larger than {limit} bytes")
    return data.decode("ascii", errors="replace")


def write_root_file(path: Path, text: str, mode: int = 0o600) -> None:
    """Atomic, umask-proof, never through a link (root state)."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), mode)
        f.write(text)
    os.replace(tmp, path)


NVIDIA_PROGRAMS = frozenset({"nvidia-cuda-mps-control", "nvidia-cuda-mps-server"})


def _runs_program(pid: int, binary: str) -> bool:
    """The process is ``binary``: its executable, or the script an interpreter runs.

    NVIDIA's own programs also match by name: a node may reach the driver's
    ``nvidia-cuda-mps-control`` through a wrapper or a second copy (container images
    put the driver's tools under ``/usr/local/nvidia/bin`` and a launcher in
    ``/usr/bin``), and the process then runs the driver's file, not the configured
    one. The other checks (root's uid, the pipe directory in its environment, the
    start time) still tie the process to the daemon root started.
    """
    want = os.path.realpath(binary)
    with contextlib.suppress(OSError):
        exe = os.path.realpath(os.readlink(f"/proc/{pid}/exe"))
        if exe == want:
            return True
        name = os.path.basename(want)
        if name in NVIDIA_PROGRAMS and os.path.basename(exe) == name:
            return True
    argv = (procfs.read(f"/proc/{pid}/cmdline", 1 << 16) or b"").split(b"\0")
    return any(os.path.realpath(a.decode("utf-8", "replace")) == want for a in argv[:2] if a)


def _program_of(pid: int) -> str:
    """What ``pid`` runs, for an error message: its executable and first two arguments."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError as e:
        exe = f"<exe unreadable: {e.strerror}>"
    argv = (procfs.read(f"/proc/{pid}/cmdline", 1 << 12) or b"").split(b"\0")[:2]
    return f"{exe} (argv {[a.decode('utf-8', 'replace')[:200] for a in argv]})"


def readback(line: str) -> tuple[str, str, str]:
    """The ``get_*`` command that reads back what the ``set_*`` ``line`` sets.

    (getter, expected value, kind: ``size`` or ``pct``). Raises
    :class:`MpsControlError` for a line that cannot be verified.
    """
    words = line.split()
    cmd, args = (words[0], words[1:]) if words else ("", [])
    if cmd == "set_default_device_pinned_mem_limit" and len(args) == 2:
        return f"get_default_device_pinned_mem_limit {args[0]}", args[1], "size"
    if cmd == "set_device_pinned_mem_limit" and len(args) == 3:
        return f"get_device_pinned_mem_limit {args[0]} {args[1]}", args[2], "size"
    if cmd == "set_default_active_thread_percentage" and len(args) == 1:
        return "get_default_active_thread_percentage", args[0], "pct"
    if cmd == "set_active_thread_percentage" and len(args) == 2:
        return f"get_active_thread_percentage {args[0]}", args[1], "pct"
    raise MpsControlError(f"{line!r} cannot be verified: not sent")


def _same_value(kind: str, got: str, want: str) -> bool:
    """A read-back value (``4G``, ``4096M``, ``50.0``) equals the one set.

    The reply's format is not documented: its last word is taken, after any
    ``DEV=`` or ``DEV:`` prefix. Anything unreadable is not a match (an error, never
    a silent pass): an acceptance-kit item on real hardware.
    """
    import re

    from slurm_colloc.units import SizeError, parse_size_mib

    words = re.split(r"[\s=:]+", got.strip())
    token = words[-1] if words else ""
    try:
        if kind == "size":
            return _size_shown(token, parse_size_mib(want))
        return abs(float(token) - float(want)) < 0.01
    except (SizeError, ValueError):
        return False


_SHOWN_UNIT_MIB = {"M": 1, "G": 1024, "T": 1024 * 1024}


def _size_shown(token: str, want_mib: int) -> bool:
    """``token`` is how the daemon shows a limit of ``want_mib``.

    The driver shows a limit in whole units of the unit it prints, rounded down:
    ``set_default_device_pinned_mem_limit 0 1536M`` reads back ``1G`` and ``2560M``
    reads ``2G`` (H100, driver 580; ``2048M`` reads ``2G``). So a read-back in ``G``
    confirms the limit to the GiB only; the acceptance kit's ``oom_at_limit`` check
    measures where the limit really is.
    """
    import re

    from slurm_colloc.units import parse_size_mib

    m = re.fullmatch(r"(\d+)([MGT])", token)
    if m is None:
        return parse_size_mib(token) == want_mib
    unit = _SHOWN_UNIT_MIB[m.group(2)]
    return int(m.group(1)) == want_mib // unit


@dataclass(frozen=True)
class DaemonIdentity(procfs.Process):
    """Who root started: checked against /proc before any signal (:meth:`signal`)."""

    binary: str
    pipe_dir: str

    def matches(self) -> bool:
        """The live process ``pid`` is still the daemon root started (not a reused pid)."""
        return self.mismatch() is None

    def mismatch(self) -> str | None:
        """Why the live process ``pid`` is not this daemon (one line), or None when it is.

        Named so a daemon that starts but is never recognised (a wrapper script in
        ``mps_control``, a pid file written before the fork) says which check failed.
        """
        if not super().matches():
            return f"pid {self.pid} is gone or was reused"
        if (uid := procfs.uid(self.pid)) != os.geteuid():
            return f"pid {self.pid} runs as uid {uid}"
        if (pipe := procfs.environ(self.pid, "CUDA_MPS_PIPE_DIRECTORY")) != self.pipe_dir:
            return f"pid {self.pid} has CUDA_MPS_PIPE_DIRECTORY={pipe!r}"
        if not _runs_program(self.pid, self.binary):
            return f"pid {self.pid} is {_program_of(self.pid)}, not {self.binary}"
        return None

    @classmethod
    def learn(cls, pid: int, binary: str, pipe_dir: Path) -> DaemonIdentity | None:
        """The live process ``pid`` as the daemon of ``binary`` in ``pipe_dir``, if it matches."""
        ident, _ = cls.learn_or_why(pid, binary, pipe_dir)
        return ident

    @classmethod
    def learn_or_why(cls, pid: int, binary: str,
                     pipe_dir: Path) -> tuple[DaemonIdentity | None, str]:
        """:meth:`learn`, with why not when it is None."""
        ticks = procfs.start_ticks(pid)
        if ticks is None:
            return None, f"the pid file names pid {pid}, which does not run"
        ident = cls(pid, ticks, binary, str(pipe_dir))
        why = ident.mismatch()
        return (None, why) if why else (ident, "")

    @classmethod
    def load(cls, path: Path) -> DaemonIdentity | None:
        """The identity saved in ``path`` (root's own file), whether or not the process lives."""
        try:
            d = json.loads(read_small_file(path, owner=os.geteuid(), limit=4096))
            return cls(int(d["pid"]), int(d["start_ticks"]), str(d["binary"]), str(d["pipe_dir"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def answers_on(self, sock_path: Path) -> bool:
        """The socket ``sock_path`` is answered by this daemon's pid, as root (``SO_PEERCRED``).

        NVIDIA's control daemon listens on a ``SOCK_SEQPACKET`` socket (seen on an H100,
        driver 580: ``/proc/net/unix`` type 0005; a stream connect fails with
        EPROTOTYPE), so that type is tried first and a stream socket second. A connect
        that times out (a busy daemon whose backlog is full) counts while the process
        still :meth:`matches`; a refused one (nobody listens) does not.
        """
        for kind in CONTROL_SOCKET_TYPES:
            sock = socket.socket(socket.AF_UNIX, kind)
            try:
                sock.settimeout(2.0)
                sock.connect(str(sock_path))
                pid, uid, _ = struct.unpack(
                    "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            except (TimeoutError, BlockingIOError, InterruptedError):
                return self.matches()  # could not tell: a busy daemon, not a stranger
            except OSError as e:
                if e.errno == errno.EPROTOTYPE:
                    continue  # the other socket type
                return False  # refused: nobody listens there (a dead or planted socket)
            finally:
                sock.close()
            return bool(pid == self.pid and uid == os.geteuid())
        return False

    def save(self, path: Path) -> None:
        """Keep the identity in root state (``path``, 0600), for :meth:`load`."""
        write_root_file(path, json.dumps(asdict(self)))


@dataclass(frozen=True)
class ServerIdentity(procfs.Process):
    """An MPS server child of our daemon, seen by ``get_server_list``."""

    daemon_pid: int

    def matches(self) -> bool:
        return super().matches() and procfs.parent(self.pid) == self.daemon_pid


@dataclass(frozen=True)
class MpsDaemon:
    """Handle on the control daemon of one pipe directory."""

    binary: str
    gpu: int
    pipe_dir: Path
    log_dir: Path
    state_file: Path | None = None
    """Root-owned identity record; default: ``pipe_dir/../daemon.json``."""
    device: str | None = None
    """What the daemon's ``CUDA_VISIBLE_DEVICES`` names: the GPU's UUID. MPS remaps
    the devices a daemon sees for its clients (NVIDIA MPS docs, Appendix: Environment
    Variables), and an index is no identity (CUDA orders devices fastest-first unless
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; Slurm orders them by device file). None: the
    index ``gpu`` (the simulation's and old callers' way; not for real nodes)."""

    @property
    def _state(self) -> Path:
        return self.state_file or self.pipe_dir.parent / STATE_FILE

    def _env(self) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "CUDA_VISIBLE_DEVICES": self.device or str(self.gpu),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    # --- identity -----------------------------------------------------------------
    def identity(self) -> DaemonIdentity | None:
        """The recorded identity (root state), whether or not the process lives."""
        return DaemonIdentity.load(self._state)

    def _forget_identity(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._state.unlink()

    def pid(self) -> int | None:
        """Pid of our running daemon, from root state verified in /proc; else None."""
        ident = self.identity()
        return ident.pid if ident is not None and ident.matches() else None

    def _socket_present(self) -> bool:
        try:
            return stat.S_ISSOCK((self.pipe_dir / CONTROL_SOCKET).lstat().st_mode)
        except OSError:
            return False

    def _socket_is_ours(self) -> bool:
        """The control socket is not answered by someone else (``SO_PEERCRED``).

        The pipe directory is the user's: ``control`` may have been replaced by the
        user's own listener (every root command to it would then wait out its timeout
        under the GPU lock) or by a link to another service's socket. Only a peer that
        is positively not our daemon counts against it: a busy daemon whose backlog is
        full (a connect that times out) is still ours, or a healthy daemon under load
        would be restarted under its running clients.
        """
        ident = self.identity()
        if ident is None or not self._socket_present():
            return False
        return ident.answers_on(self.pipe_dir / CONTROL_SOCKET) and ident.matches()

    def running(self) -> bool:
        """Our daemon lives and answers on its control socket (a job may replace it)."""
        return self.pid() is not None and self._socket_is_ours()

    # --- life cycle ---------------------------------------------------------------
    def start(self, timeout: float = 10) -> None:
        """Start the daemon (``-d``) unless it runs; wait until it accepts commands.

        Call only while the pipe directory is root's (Tenancy.prepare_user_dirs): the
        pid file is read once, here, to learn the identity root keeps.
        """
        if self.running():
            return
        if self.pid() is not None:  # alive but its socket is gone: replace, never orphan
            self.stop(timeout=timeout)
        with contextlib.suppress(FileNotFoundError):
            (self.pipe_dir / CONTROL_SOCKET).unlink()
        try:
            with waits.timed("mps start"):
                cp = subprocess.run(  # its session: priority.raise_session
                    [self.binary, "-d"], env=self._env(), capture_output=True, text=True,
                    timeout=timeout, check=False, stdin=subprocess.DEVNULL, cwd="/",
                    start_new_session=True,
                )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsControlError(f"{self.binary} -d: {e}") from e
        if cp.returncode != 0:
            raise MpsControlError(
                f"{self.binary} -d exited {cp.returncode}: {cp.stderr.strip()[:500]}"
            )
        deadline = time.monotonic() + timeout
        why = ""
        while time.monotonic() < deadline:
            ident, why = self._learn_identity()
            if ident is not None:
                if self._socket_present():
                    ident.save(self._state)
                    priority.give_back(ident.pid)  # started by a raised lock holder
                    return
                why = f"no control socket in {self.pipe_dir}"
            time.sleep(0.02)
        left = self._quit_unrecognised()
        raise MpsControlError(
            f"MPS control daemon for GPU {self.gpu} did not come up in {timeout}s: {why}"
            f"{left}"
        )

    def _quit_unrecognised(self) -> str:
        """Ask whatever daemon answers in our pipe directory to quit (a failed start).

        A daemon that started but was never recognised (seen on an H100: a wrapper in
        ``mps_control``) has no identity in root state, so no later epilog or reap could
        stop it: it would outlive the job with its pipe directory. The directory is
        root's here (``start``'s precondition), so what listens in it is root's daemon.
        Returns a note for the error message.
        """
        if not self._socket_present():
            return ""
        try:
            subprocess.run([self.binary], input="quit\n", env=self._env(), capture_output=True,
                           text=True, timeout=5, check=False, cwd="/")
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"; asking it to quit failed ({e}): it may still run"
        return "; it was asked to quit"

    def _learn_identity(self) -> tuple[DaemonIdentity | None, str]:
        """Identity from the daemon's pid file while the pipe directory is root's.

        (identity, "") or (None, why not yet).
        """
        try:
            st = self.pipe_dir.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise MpsControlError(f"{self.pipe_dir} is not root's: identity not learned")
            pid = int(read_small_file(self.pipe_dir / PID_FILE).split()[0])
        except (OSError, ValueError, IndexError) as e:
            return None, f"pid file {self.pipe_dir / PID_FILE}: {e}"
        return DaemonIdentity.learn_or_why(pid, self.binary, self.pipe_dir)

    def command(self, *lines: str, timeout: float = 10) -> str:
        """Send commands on stdin (one per line); return what the daemon printed.

        Refused at once (no timeout wait) when the control socket is not our daemon's.
        """
        if not self._socket_is_ours():
            raise MpsControlError(
                f"MPS control socket in {self.pipe_dir} is not our daemon's: not used")
        try:
            with waits.timed("mps control"):
                cp = subprocess.run(
                    [self.binary], input="".join(f"{ln}\n" for ln in lines), env=self._env(),
                    capture_output=True, text=True, timeout=timeout, check=False, cwd="/",
                )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsControlError(f"{self.binary}: {e}") from e
        if cp.returncode != 0:
            raise MpsControlError(f"{self.binary}: {'; '.join(lines)}: {cp.stderr.strip()[:500]}")
        return cp.stdout[:65536]

    def _send_silent(self, *lines: str, timeout: float = 10) -> None:
        """Send commands that print nothing when carried out; any reply is an error.

        The control program prints nothing for a command it carried out and a message
        for one it refused (bad value, unknown server pid, not permitted).
        """
        out = self.command(*lines, timeout=timeout).strip()
        if out:
            raise MpsControlError(
                f"MPS control daemon (GPU {self.gpu}) refused {'; '.join(lines)!r}: "
                f"{out[:300]}"
            )

    def set_checked(self, *lines: str, timeout: float = 10) -> None:
        """Send ``set_*`` commands, then read each value back: silence is not success.

        A refused limit must not go unnoticed (the job would run without the cap it
        was promised), and neither must one that was taken silently but not applied
        (another daemon version, a command the program ignores): every line is read
        back with its ``get_*`` twin (:func:`readback`) and compared. A line that
        has no twin cannot be verified and is refused before anything is sent.
        """
        checks = [readback(ln) for ln in lines]
        self._send_silent(*lines, timeout=timeout)
        for line, (getter, want, kind) in zip(lines, checks, strict=True):
            got = self.command(getter, timeout=timeout).strip()
            if not _same_value(kind, got, want):
                raise MpsControlError(
                    f"MPS control daemon (GPU {self.gpu}) did not take {line!r}: "
                    f"{getter} reads {got[:100]!r}"
                )

    def set_defaults(self, limit_mib: int | None, thread_pct: int) -> None:
        """Default pinned memory limit (device 0 = the one visible GPU) and SM share."""
        lines = []
        if limit_mib:
            lines.append(f"set_default_device_pinned_mem_limit 0 {limit_mib}M")
        if thread_pct:
            lines.append(f"set_default_active_thread_percentage {thread_pct}")
        if lines:
            self.set_checked(*lines)

    def cap_user(self, limit_mib: int) -> None:
        """Server-side pinned limit for this (GPU, user): new servers and running ones.

        ``set_default_device_pinned_mem_limit`` binds only servers started later, so
        each running server also gets ``set_device_pinned_mem_limit PID`` (it binds
        the clients that connect afterwards). A client that drops its own variable
        then gets its user's share of the GPU, not the whole GPU.

        The default goes first and the servers are listed after it: a server the
        daemon starts between a listing and the new default would keep the old one,
        and the job that raised the cap would die of OOM inside its own reservation
        (issue 24, a philly90h replay: its user's server started 0.15 s after the
        listing, with the previous job's 2,560 MiB, and the 4,608 MiB job that raised
        the default to 7,168 MiB was refused at 3.4 GiB).

        Two runs of the control program, not 3 + 2n (issue 28: under a burst the one
        prolog per GPU that commits the cap ran five, each a process start on the
        node's busy CPUs, while the GPU's other prologs waited for it): the default,
        its read-back and the server listing in one session (``set_*`` prints nothing
        when carried out; the getter's line comes before the listing's pids), then,
        only when servers run, their limits and read-backs in a second
        (:meth:`_set_and_read_back`). A fresh daemon has no server until its user's
        first client connects, so a burst's commits mostly take one run. An answer of
        another shape falls back to a listing of its own and the checked path.
        """
        if limit_mib <= 0:
            return
        default = f"set_default_device_pinned_mem_limit 0 {limit_mib}M"
        getter, want, kind = readback(default)
        answers = [a.strip() for a in self.command(default, getter, "get_server_list")
                   .splitlines() if a.strip()]
        if answers and _same_value(kind, answers[0], want) and all(
                t.isdigit() and len(t) < 10 for t in answers[1:]):
            pids = [int(t) for t in answers[1:]]
        else:
            pids = self.server_pids()  # nothing guessed from an unexpected reply
        if not pids and answers and _same_value(kind, answers[0], want):
            return  # the default is read back and no server runs: one run
        running = [f"set_device_pinned_mem_limit {pid} 0 {limit_mib}M" for pid in pids]
        self._set_and_read_back(default, running)

    def _set_and_read_back(self, already_set: str, lines: list[str],
                           timeout: float = 10) -> None:
        """Send ``lines`` (``set_*``) and read back ``already_set`` and each of them in
        one session; every answer must match (:func:`_same_value`).

        The answers are paired with their getters line by line when the daemon
        printed exactly one line per getter (the stand-in does; a refusal adds lines);
        otherwise nothing is guessed: :meth:`set_checked`'s one-read-back-per-run
        path decides, so an undocumented reply format costs runs, never a check.
        """
        checks = [readback(ln) for ln in (already_set, *lines)]
        out = self.command(*lines, *(getter for getter, _, _ in checks), timeout=timeout)
        answers = [a for a in out.splitlines() if a.strip()]
        if len(answers) != len(checks):
            if lines:
                self._send_silent(*lines, timeout=timeout)  # idempotent: same values
            for getter, want, kind in checks:
                got = self.command(getter, timeout=timeout).strip()
                if not _same_value(kind, got, want):
                    raise MpsControlError(f"MPS control daemon (GPU {self.gpu}) did not "
                                          f"take the cap: {getter} reads {got[:100]!r}")
            return
        for (getter, want, kind), got in zip(checks, answers, strict=True):
            if not _same_value(kind, got, want):
                raise MpsControlError(f"MPS control daemon (GPU {self.gpu}) did not take "
                                      f"the cap: {getter} reads {got.strip()[:100]!r}")

    def server_pids(self) -> list[int]:
        """``get_server_list``: pids of the MPS servers this daemon runs."""
        return [int(t) for t in self.command("get_server_list").split()
                if t.isdigit() and len(t) < 10]

    def _servers(self, daemon_pid: int) -> list[ServerIdentity]:
        """Servers that are verifiably children of our daemon (others are ignored)."""
        out = []
        with contextlib.suppress(MpsControlError):
            for pid in self.server_pids():
                ticks = procfs.start_ticks(pid)
                if ticks is not None and procfs.parent(pid) == daemon_pid:
                    out.append(ServerIdentity(pid, ticks, daemon_pid))
        return out

    def stop(self, timeout: float = 10) -> list[int]:
        """Shut our servers down, then the daemon; verify; signal only what lingers.

        A real ``quit`` waits for the servers' clients to exit, and a server left
        behind runs as the user outside the job's cgroup, holding GPU memory. So the
        servers go first and by name (``get_server_list``, then ``shutdown_server PID
        -f``, which also ends clients still attached: no job of this user is left on
        the GPU when this runs), each checked to be gone in ``/proc``; then ``quit``.
        SIGTERM/SIGKILL follow only for processes that still match the identities root
        recorded (daemon) or saw as the daemon's children (servers). Returns the pids
        that had to be signalled. Idempotent; bounded by ``timeout`` plus the grace.
        """
        ident = self.identity()
        if ident is None or not ident.matches():
            self._forget_identity()
            self._remove_socket()
            return []
        servers = self._servers(ident.pid)
        deadline = time.monotonic() + timeout
        if servers:
            with contextlib.suppress(MpsControlError):  # verified below, in /proc
                self._send_silent(*(f"shutdown_server {s.pid} -f" for s in servers),
                                  timeout=timeout)
            while time.monotonic() < deadline and any(s.matches() for s in servers):
                time.sleep(0.05)
        try:
            self.command("quit", timeout=max(1.0, deadline - time.monotonic()))
        except MpsControlError:
            deadline = time.monotonic()  # no polite way: straight to the signals
        while time.monotonic() < deadline and (
            ident.matches() or any(s.matches() for s in servers)
        ):
            time.sleep(0.05)
        signalled: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for s in servers:
                if s.matches():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(s.pid, sig)
                    signalled.append(s.pid)
            if ident.signal(sig):
                signalled.append(ident.pid)
            grace = time.monotonic() + 2
            while time.monotonic() < grace and (
                ident.matches() or any(s.matches() for s in servers)
            ):
                time.sleep(0.05)
        if ident.matches() or any(s.matches() for s in servers):
            raise MpsControlError(f"MPS daemon {ident.pid} on GPU {self.gpu} survived SIGKILL")
        self._forget_identity()
        self._remove_socket()
        return sorted(set(signalled))

    def _remove_socket(self) -> None:
        """Unlink by name only (unlink never follows a link; nothing is read)."""
        for name in (CONTROL_SOCKET, PID_FILE):
            with contextlib.suppress(OSError):
                (self.pipe_dir / name).unlink()
