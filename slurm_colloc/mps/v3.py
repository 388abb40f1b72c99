"""MPS v3 (NVIDIA driver r615, CUDA 13.4): one root daemon per node, a server per GPU,
a namespace per job.

Why: with the legacy (v2) daemon a server serves one user, so colloc runs a daemon per
(GPU, user) and different users' jobs on a GPU are time-sliced between servers
(:mod:`slurm_colloc.mps.tenancy`). v3 offers a multi-user server whose namespaces
each carry their own pinned memory limit and active thread percentage: every job on a
GPU, of any user, shares that GPU's one server, and the job's limit is the
namespace's, held by the server: unsetting a variable does not lift it (a client can
still escape it, [GD] below: the hard cgroup limit remains the boundary).

Nothing here has run on r615 hardware; every behaviour relied on is NVIDIA's
documentation (below, and docs/mps-v3.md with the open questions), tested against
the stand-in :mod:`slurm_colloc.gpu.sim.mps_v3_control`.

Documented facts used (retrieved 2026-11):

* [IF] https://docs.nvidia.com/deploy/mps/latest/mpsv3-interface.html -- v3 is
  selected by ``-p 3`` or ``CUDA_MPS_PROTOCOL_VERSION=3`` (the variable wins); a new
  invocation follows a running daemon's protocol; options ``-d -f -m -a <file> -p
  -q -v -h``; commands ``nvidia-cuda-mps-control <module> <verb> [positional]
  [--key=value] [--flag]``; ``namespace create <name> --server=<s>``, ``namespace
  delete <name> --server=<s> [--force]`` ("--force allows deletion even with active
  clients"), ``namespace set <name> --server=<s> [--pinned-memory-limit=]
  [--active-thread-percentage=]``, ``namespace get <name> <server> <field>`` (fields
  include ``pipe-directory``, ``pinned-memory-limit``, ``active-thread-percentage``),
  ``server list --format=csv,noheader`` (name, uid, pid, status, pipe-directory,
  allowed-devices, context-ids), ``server delete <name> --force`` (terminates active
  clients first), ``client list --server=<s> --format=csv,noheader`` (example rows:
  pid, server, device, namespace, cmd), ``client terminate <pid>``; memory values
  with unit suffixes (``512M``); names lowercase letters, digits, underscores, up to
  64 characters; in multiuser mode servers may only be ``--uid=0``; each server and
  namespace gets a subdirectory of the pipe directory holding its ``control``
  socket; ``-q`` quits the daemon and all running servers.
* [NS] https://docs.nvidia.com/deploy/mps/latest/mpsv3-namespaces.html -- a client
  selects its namespace by the socket it connects to,
  ``$CUDA_MPS_PIPE_DIRECTORY/<server>/<namespace>/control``; ``<server>/control``
  routes to the default namespace; ``$CUDA_MPS_PIPE_DIRECTORY/control`` routes by
  UID for legacy clients; "A client sets CUDA_MPS_PIPE_DIRECTORY to the namespace's
  directory".
* [CF] https://docs.nvidia.com/deploy/mps/latest/mpsv3-configuration-file.html --
  ``-a file.toml`` is applied once at start; ``[servers.<name>]`` accepts exactly
  ``allowed_devices, pinned_memory_limit, active_thread_percentage,
  client_priority, uid, locality_domains`` (others are errors); server-level values
  are the ``default`` namespace's.
* [EV] https://docs.nvidia.com/deploy/mps/latest/appendix-environment-variables.html
  -- under v3 the enforced pinned limit comes from the client's namespace and the
  client's ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` can only lower it; a namespace's
  active thread percentage overrides the client's variable; ``CUDA_VISIBLE_DEVICES``
  accepts UUIDs (recommended: indices are remapped by the server).
* [GD] https://docs.nvidia.com/dynamo/dev/many-model-serving/per-gpu-compute-and-memory-limits-with-mps
  (NVIDIA's measured guide, driver 615.71.09) -- ``-p 3 -h`` lists ``server`` and
  ``namespace`` on r615; multi-user MPS needs root; server-level limits apply only
  to the default namespace and a named namespace without limits gets the whole GPU;
  a server whose ``allowed_devices`` is not on the node is accepted, then exits and
  vanishes from ``server list`` (its clients run without MPS and without limits); a
  client whose ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` names a device it cannot see
  drops every pinned limit, the namespace's included.
* [TS] https://docs.nvidia.com/deploy/mps/latest/troubleshooting.html -- a uid
  mismatch without multi-user mode keeps a client out. It names the option
  ``-multiuser-server`` and [GD] ``--multiuser-server``, where [IF] lists ``-m,
  --multiuser``: ``-m`` is used here, an acceptance-kit item.
* [MP] https://docs.nvidia.com/deploy/mps/latest/mpsv3-memory-partitioning.html --
  the hard per-cgroup limit (:mod:`slurm_colloc.gpu.nvml`) is what a job cannot
  escape; a namespace limit is a second layer (see [GD] above).

Security (docs/security.md): the pipe directory, the state directory and the
directories the daemon makes stay root's; the daemon's identity is learnt from its
pid file once, in the root-owned pipe directory, and kept in root state
(:class:`~slurm_colloc.mps.control.DaemonIdentity`), verified in ``/proc`` before any
signal; servers are signalled only when verifiably its children. The documentation
says nothing about who may connect to which socket, so root decides it: a job's
namespace socket is handed to the job's user (owner, mode 0600) inside a directory
that stays root's and that no one else can write, walked with ``O_NOFOLLOW`` from
the pipe directory; the daemon's, the servers' and the default namespaces' sockets
are made root-only (0600), and the default namespaces get a tiny limit as well
([GD]), so that no user reaches a GPU through a route without a job's limit. A
client that connected to the namespace before its socket was handed over (a user
polling for a predictable name) is terminated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from slurm_colloc import priority, procfs
from slurm_colloc.mps.control import DaemonIdentity, read_small_file, write_root_file
from slurm_colloc.mps.tenancy import ensure_root_dir
from slurm_colloc.units import SizeError, parse_size_mib

V3_DIR = "v3"
"""The node's v3 daemon lives under ``mps_root/v3`` (its state in ``v3/state``)."""
PROTOCOL_ENV = "CUDA_MPS_PROTOCOL_VERSION"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
CONTROL = "control"
PID_FILE = "nvidia-cuda-mps-control.pid"
"""As the legacy daemon writes it in its pipe directory; not documented for v3."""
DEFAULT_NAMESPACE = "default"
CONFIG_FILE = "mps-v3.toml"
IDENTITY_FILE = "daemon.json"
NODE_FILE = "node.json"
SERVERS_FILE = "servers.json"
JOBS_DIR = "jobs"
MAX_OUTPUT = 64 * 1024
NAME_RE = re.compile(r"[a-z0-9_]{1,64}")
UUID_RE = re.compile(r"GPU-[0-9A-Za-z-]{1,80}")
PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
DAEMON_UMASK = 0o077
"""The daemon (and every command) runs with a private umask: what it makes (its logs,
pid file, sockets, server and namespace directories) is root's alone unless root
opens it on purpose. What users must reach is set explicitly: the directories on
the way to a job's namespace socket 0755 and that socket the job user's 0600
(:meth:`MpsV3Node._hand_socket`); the pipe directory itself is made 0755 by root."""
ROUTE_DIR_MODE = 0o755


class MpsV3Error(RuntimeError):
    """The v3 daemon refused a command, answered nonsense, or is not ours."""


@dataclass(frozen=True)
class MpsCapability:
    """What the node's ``nvidia-cuda-mps-control`` offers."""

    protocol: int
    """3: MPS v3 (servers, namespaces); 2: legacy only."""
    multiuser: bool
    """Multi-user servers are possible: the help offers ``-m`` and we are root."""
    detail: str


def server_name(gpu_index: int) -> str:
    """One server per GPU, named after its index (a valid v3 name)."""
    return f"gpu{int(gpu_index)}"


def namespace_name(job_id: int) -> str:
    """One namespace per job (a valid v3 name)."""
    return f"job{int(job_id)}"


QUIT_TIMEOUT_S = 5.0
"""Least time a failed start gives the unrecognised daemon's ``-q`` (the node's
``timeout`` when longer): a failed start can hold the node lock about twice ``timeout``."""
SOCKET_GRACE_S = 1.0
"""How long a failed start waits for a slow daemon's control socket before giving up."""


def run_bounded(argv: list[str], env: Mapping[str, str], timeout: float,
                limit: int = MAX_OUTPUT, new_session: bool = False) -> tuple[int, str, str]:
    """Run without a shell; (status, stdout, stderr), each at most ``limit`` bytes.

    A daemonising program's grandchild may keep the pipes open: once the program
    itself has exited, what is left is read for a moment and then abandoned.
    ``new_session``: the program (and the daemon it leaves) in a session of its own
    (:func:`slurm_colloc.priority.raise_session`).
    Raises OSError (cannot run) or :class:`subprocess.TimeoutExpired`.
    """
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(env), cwd="/", close_fds=True, umask=DAEMON_UMASK,
        start_new_session=new_session,
    )
    assert proc.stdout is not None and proc.stderr is not None
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    deadline = time.monotonic() + timeout
    exited_at: float | None = None
    sel = selectors.DefaultSelector()
    try:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if now > deadline:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(argv, timeout)
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.5:
                break
            for key, _ in sel.select(min(0.1, max(0.0, deadline - now))):
                fd = int(key.fd)
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                if len(buf) < limit:
                    buf += chunk[: limit - len(buf)]
        rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    out, err = bufs.values()  # stdout's first: registered in that order
    return rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def _base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {"PATH": PATH}
    env.update(extra or {})
    return env


def detect(binary: str, timeout: float = 5) -> MpsCapability:
    """Whether ``binary`` speaks MPS v3: its ``-p 3 -h`` lists ``server`` and ``namespace``.

    That is the check NVIDIA's guide gives ([GD]). An older driver rejects ``-p``
    (or prints a help without modules), a missing binary cannot run: protocol 2,
    with the reason. The pipe directory is an empty private one, so that no running
    daemon's protocol is followed ([IF]).
    """
    with tempfile.TemporaryDirectory(prefix="colloc-mps-detect-") as empty:
        env = _base_env({PIPE_ENV: empty, LOG_ENV: empty})
        try:
            rc, out, err = run_bounded([binary, "-p", "3", "-h"], env, timeout)
        except OSError as e:
            return MpsCapability(2, False, f"cannot run {binary}: {e.strerror or e}")
        except subprocess.TimeoutExpired:
            return MpsCapability(2, False, f"{binary} -p 3 -h did not finish in {timeout:g} s")
    text = out + "\n" + err
    first = (err.strip() or out.strip()).splitlines()[:1]
    if rc != 0:
        why = first[0][:200] if first else "no output"
        return MpsCapability(2, False, f"{binary} -p 3 -h exited {rc} (no MPS v3): {why}")
    modules = [m for m in ("server", "namespace") if re.search(rf"\b{m}\b", text)]
    if len(modules) < 2:
        return MpsCapability(2, False, f"{binary} -p 3 -h lists no server and namespace "
                                       "modules: legacy MPS only")
    offers_m = bool(re.search(r"(^|[\s,])(-m\b|--multiuser)", text, re.MULTILINE))
    root = os.geteuid() == 0
    multiuser = offers_m and root
    why = ("multiuser possible" if multiuser else
           "no multiuser option in the help" if not offers_m else "multiuser needs root")
    return MpsCapability(3, multiuser, f"{binary}: MPS v3 (server and namespace modules); {why}")


def running_protocol(binary: str, pipe_dir: Path, timeout: float = 5) -> int | None:
    """Protocol of the daemon running in ``pipe_dir``; None when none answers there.

    The documentation gives no query for it, only that a new invocation follows the
    running daemon's protocol ([IF]): so ``server list`` is sent with neither ``-p``
    nor the variable, and only a v3 daemon answers it with server rows. Inferred, not
    documented: an acceptance-kit item.
    """
    try:
        if not stat.S_ISSOCK(os.lstat(pipe_dir / CONTROL).st_mode):
            return None
    except OSError:
        return None
    env = _base_env({PIPE_ENV: str(pipe_dir)})
    try:
        rc, out, _ = run_bounded([binary, "server", "list", "--format=csv,noheader"], env,
                                 timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [r for r in out.splitlines() if r.strip()]
    return 3 if rc == 0 and all(len(r.split(",")) >= 7 for r in rows) else 2


@dataclass(frozen=True)
class JobRecord:
    """What root remembers of a job's namespace (root 0600, ``state_dir/jobs``)."""

    job_id: int
    gpu: int
    uuid: str
    server: str
    namespace: str
    uid: int
    gid: int
    limit_mib: int
    thread_pct: int
    pipe_dir: str


def _toml_str(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.,:-]*", value):
        raise MpsV3Error(f"refusing to write {value!r} into the MPS configuration")
    return f'"{value}"'


@contextlib.contextmanager
def _root_dir_fd(path: Path) -> Iterator[int]:
    """An fd of ``path``: a directory of ours that nobody else can write, not a link."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _check_root_dir(fd, str(path))
        yield fd
    finally:
        os.close(fd)


def _check_root_dir(fd: int, what: str) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise MpsV3Error(f"{what}: owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}: "
                         "not a directory only root can write")


def _open_subdir(parent: int, name: str, what: str) -> int:
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                 dir_fd=parent)
    try:
        _check_root_dir(fd, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


class MpsV3Node:
    """The node's one MPS v3 control daemon: multi-user, a server per GPU, a namespace
    per job.

    ``pipe_dir``, ``log_dir`` and ``state_dir`` are root's (made 0755, 0700, 0700);
    the pipe directory is never handed to a user: only each job's namespace socket is.
    """

    def __init__(self, binary: str, pipe_dir: Path, log_dir: Path, state_dir: Path, *,
                 timeout: float = 10.0, guard_limit_mib: int = 1, guard_thread_pct: int = 1,
                 extra_env: Mapping[str, str] | None = None) -> None:
        """``guard_*``: the default namespaces' limits, for a client that reaches one.

        ``extra_env``: more variables for the daemon and its commands (the simulation's
        ``COLLOC_SIM_STATE``); never ``CUDA_MPS_*``.
        """
        self.binary = binary
        self.pipe_dir = Path(pipe_dir)
        self.log_dir = Path(log_dir)
        self.state_dir = Path(state_dir)
        self.timeout = timeout
        self.guard_limit_mib = guard_limit_mib
        self.guard_thread_pct = guard_thread_pct
        extra = dict(extra_env or {})
        if any(k.startswith("CUDA_") for k in extra):
            raise ValueError("extra_env must not set CUDA_* variables")
        self.extra_env = extra

    # --- plumbing ------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        return _base_env({**self.extra_env, PIPE_ENV: str(self.pipe_dir),
                          LOG_ENV: str(self.log_dir), PROTOCOL_ENV: "3"})

    @property
    def config_file(self) -> Path:
        return self.state_dir / CONFIG_FILE

    def _job_file(self, job_id: int) -> Path:
        return self.state_dir / JOBS_DIR / f"{int(job_id)}.json"

    def command(self, *args: str, silent: bool = False) -> str:
        """Run ``nvidia-cuda-mps-control -p 3 <args>``; its stdout.

        A non-zero status, anything on stderr, or (``silent``: a verb documented to
        print nothing on success) anything on stdout raises :class:`MpsV3Error`.
        Refused at once when the daemon running in the pipe directory is not ours.
        """
        ident = self.identity()
        if ident is None or not ident.matches() or not self._socket_is_ours(ident):
            raise MpsV3Error(f"no MPS v3 daemon of ours in {self.pipe_dir}")
        return self._run(*args, silent=silent)

    def _run(self, *args: str, silent: bool = False, timeout: float | None = None) -> str:
        argv = [self.binary, "-p", "3", *args]
        timeout = self.timeout if timeout is None else timeout
        try:
            rc, out, err = run_bounded(argv, self._env(), timeout)
        except OSError as e:
            raise MpsV3Error(f"cannot run {self.binary}: {e.strerror or e}") from e
        except subprocess.TimeoutExpired as e:
            raise MpsV3Error(f"{' '.join(args)}: no answer in {timeout:g} s") from e
        what = " ".join(args)
        if rc != 0 or err.strip():
            raise MpsV3Error(f"{what}: exit {rc}: {(err.strip() or out.strip())[:500]}")
        if silent and out.strip():
            raise MpsV3Error(f"{what}: unexpected reply: {out.strip()[:500]}")
        return out

    # --- identity ------------------------------------------------------------------
    def identity(self) -> DaemonIdentity | None:
        """The daemon root started, from root state (whether or not it still runs)."""
        return DaemonIdentity.load(self.state_dir / IDENTITY_FILE)

    def _socket_is_ours(self, ident: DaemonIdentity) -> bool:
        """The main control socket is answered by our daemon (``SO_PEERCRED``)."""
        return ident.answers_on(self.pipe_dir / CONTROL)

    def running(self) -> bool:
        """Our daemon lives and answers on its control socket."""
        ident = self.identity()
        return ident is not None and ident.matches() and self._socket_is_ours(ident)

    def _learn_identity(self) -> DaemonIdentity | None:
        """From the pid file, read in the root-owned pipe directory (nobody else writes)."""
        return self._learn_or_why()[0]

    def _learn_or_why(self) -> tuple[DaemonIdentity | None, str]:
        """:meth:`_learn_identity`, with why not when it is None."""
        try:
            with _root_dir_fd(self.pipe_dir):
                pid = int(read_small_file(self.pipe_dir / PID_FILE, owner=os.geteuid()).split()[0])
        except (OSError, ValueError, IndexError, MpsV3Error) as e:
            return None, f"pid file {self.pipe_dir / PID_FILE}: {e}"
        return DaemonIdentity.learn_or_why(pid, self.binary, self.pipe_dir)

    # --- life cycle ----------------------------------------------------------------
    def config_text(self, gpus: Mapping[int, str]) -> str:
        """The ``-a`` file: one root server per GPU, limited to that GPU's UUID ([CF])."""
        lines = ['schema_version = "1.0"', ""]
        for index, uuid in sorted(gpus.items()):
            if not UUID_RE.fullmatch(uuid):
                raise MpsV3Error(f"GPU {index}: {uuid!r} is not a GPU UUID")
            lines += [
                f"[servers.{server_name(index)}]",
                f"allowed_devices = {_toml_str(uuid)}",
                f"pinned_memory_limit = {_toml_str(f'{self.guard_limit_mib}M')}",
                f"active_thread_percentage = {_toml_str(str(self.guard_thread_pct))}",
                "uid = 0",
                "",
            ]
        return "\n".join(lines)

    def start(self, gpus: Mapping[int, str]) -> None:
        """Start the daemon (``-d -p 3 -m -a``) for ``gpus`` ({index: UUID}) unless it runs.

        Call under the node lock (``Tenancy.locked_node``): a failed start asks whatever
        answers in the fresh pipe directory to quit, which is then this start's daemon.

        A daemon of ours already running for the same GPUs is kept (its namespaces are
        the running jobs'); one for other GPUs is an error: configuration is applied
        only at start ([CF]), and stopping it would end running jobs' namespaces.
        """
        if not gpus:
            raise MpsV3Error("no GPUs to serve")
        wanted = {int(k): str(v) for k, v in gpus.items()}
        if self.running():
            if self.node_gpus() != wanted:
                raise MpsV3Error(f"the running MPS v3 daemon serves {self.node_gpus()}, "
                                 f"not {wanted}: stop it first")
            self.lock_shared_sockets()
            return
        self.stop()  # a dead or socket-less daemon of ours: never orphan its servers
        ensure_root_dir(self.state_dir, 0o700)
        ensure_root_dir(self.state_dir / JOBS_DIR, 0o700)
        for stale in (self.state_dir / JOBS_DIR).glob("*.json"):
            stale.unlink()  # namespaces live only as long as the daemon ([CF])
        self._fresh_pipe_dir()
        ensure_root_dir(self.log_dir, 0o700)
        write_root_file(self.config_file, self.config_text(wanted))
        write_root_file(self.state_dir / NODE_FILE,
                         json.dumps({str(k): v for k, v in sorted(wanted.items())}))
        argv = [self.binary, "-d", "-p", "3", "-m", "-a", str(self.config_file)]
        try:
            rc, out, err = run_bounded(argv, self._env(), self.timeout, new_session=True)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsV3Error(f"{' '.join(argv)}: {e}") from e
        if rc != 0:
            raise MpsV3Error(f"{' '.join(argv)} exited {rc}: {(err or out).strip()[:500]}")
        ident = self._await_daemon()
        ident.save(self.state_dir / IDENTITY_FILE)
        priority.give_back(ident.pid)  # started by a raised lock holder (issue 28)
        try:
            listed = {s["name"]: s for s in self.servers()}
            missing = [server_name(i) for i in wanted if server_name(i) not in listed]
            if missing:  # [GD]: a server of a GPU not on the node vanishes from the list
                raise MpsV3Error(f"servers {missing} are not running (is the UUID on this "
                                 f"node? see {self.log_dir}/<server>/server.log)")
            for index, uuid in wanted.items():
                got = listed[server_name(index)]["allowed-devices"]
                if got != uuid:
                    raise MpsV3Error(f"server {server_name(index)} allows {got!r}, not {uuid}")
            self._record_servers(ident, list(listed.values()))
            self.lock_shared_sockets()
        except MpsV3Error:
            self.stop()
            raise

    def _await_daemon(self) -> DaemonIdentity:
        """The identity of the daemon ``start`` ran, once it answers on its socket; or
        MpsV3Error naming the failed check, after asking what answers there to quit."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            ident = self._learn_identity()
            if ident is not None and self._socket_is_ours(ident):
                return ident
            time.sleep(0.02)
        raise MpsV3Error(f"MPS v3 daemon did not come up in {self.pipe_dir} "
                         f"in {self.timeout:g} s: {self._why_unrecognised()}"
                         f"{self._quit_unrecognised()}")

    def _why_unrecognised(self) -> str:
        """Which identity check failed (for the error of a start that timed out)."""
        ident, why = self._learn_or_why()
        if ident is not None and not self._socket_is_ours(ident):
            return f"daemon {ident.pid} does not answer on {self.pipe_dir / CONTROL}"
        return why

    def _quit_unrecognised(self) -> str:
        """Ask whatever daemon answers in our fresh pipe directory to quit (``-q``).

        As for the legacy daemon (:meth:`MpsDaemon._quit_unrecognised`, seen on an H100:
        a wrapper in ``mps_control``): a daemon that started but was never recognised
        has no identity in root state, so no epilog or reap would stop it, and it would
        keep its root servers. The directory was made empty and root's by ``start``, so
        what listens in it is the daemon ``start`` ran. Returns a note for the error.
        """
        end = time.monotonic() + SOCKET_GRACE_S  # a slow daemon may bind just after
        while not (self.pipe_dir / CONTROL).exists():
            if time.monotonic() > end:
                return ""
            time.sleep(0.05)
        try:
            self._run("-q", timeout=max(self.timeout, QUIT_TIMEOUT_S))
        except MpsV3Error as e:
            return f"; asking it to quit failed ({e}): it may still run"
        return "; it was asked to quit"

    def _fresh_pipe_dir(self) -> None:
        """An empty root-owned pipe directory (a dead daemon's sockets removed)."""
        if os.path.lexists(self.pipe_dir):
            with _root_dir_fd(self.pipe_dir):
                pass
            for entry in os.scandir(self.pipe_dir):
                path = Path(entry.path)
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(path)
                else:
                    path.unlink()
        ensure_root_dir(self.pipe_dir, 0o755)

    def node_gpus(self) -> dict[int, str]:
        """{index: UUID} the running daemon was started for (root state)."""
        try:
            raw = json.loads(read_small_file(self.state_dir / NODE_FILE, owner=os.geteuid(),
                                             limit=1 << 16))
            return {int(k): str(v) for k, v in raw.items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def servers(self) -> list[dict[str, str]]:
        """``server list --format=csv,noheader`` as dicts ([IF] columns)."""
        cols = ("name", "uid", "pid", "status", "pipe-directory", "allowed-devices",
                "context-ids")
        out = []
        for line in self.command("server", "list", "--format=csv,noheader").splitlines():
            if line.strip():
                parts = line.split(",", len(cols) - 1)
                if len(parts) < len(cols) - 1:
                    raise MpsV3Error(f"server list: unexpected row {line[:200]!r}")
                out.append(dict(zip(cols, parts, strict=False)))
        return out

    def lock_shared_sockets(self) -> list[str]:
        """Make the daemon's, servers' and default namespaces' sockets root-only.

        Every job reaches its GPU through its own namespace; these routes carry no
        job's limit ([NS]: UID auto-routing; the server socket and ``default`` reach the
        default namespace). Returns the sockets changed.
        """
        changed = []
        with _root_dir_fd(self.pipe_dir) as top:
            if self._lock_socket(top):
                changed.append(str(self.pipe_dir / CONTROL))
            for index in self.node_gpus():
                name = server_name(index)
                try:
                    sfd = _open_subdir(top, name, str(self.pipe_dir / name))
                except FileNotFoundError:
                    continue
                try:
                    if self._lock_socket(sfd):
                        changed.append(str(self.pipe_dir / name / CONTROL))
                    with contextlib.suppress(FileNotFoundError):
                        dfd = _open_subdir(sfd, DEFAULT_NAMESPACE, f"{name}/{DEFAULT_NAMESPACE}")
                        try:
                            if self._lock_socket(dfd):
                                changed.append(str(self.pipe_dir / name / DEFAULT_NAMESPACE))
                        finally:
                            os.close(dfd)
                finally:
                    os.close(sfd)
        return changed

    @staticmethod
    def _lock_socket(dir_fd: int) -> bool:
        try:
            st = os.stat(CONTROL, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise MpsV3Error("a shared control socket is not the daemon's")
        if stat.S_IMODE(st.st_mode) == 0o600:
            return False
        os.chmod(CONTROL, 0o600, dir_fd=dir_fd)  # the directory is root's: no swap possible
        return True

    # --- jobs ----------------------------------------------------------------------
    def add_job(self, gpu_index: int, uuid: str, job_id: int, uid: int, gid: int,
                limit_mib: int, thread_pct: int) -> dict[str, str]:
        """Create the job's namespace with its limits; return the env its tasks need.

        ``thread_pct`` 0: no active thread percentage (the namespace shares all SMs).
        Idempotent for the same job. On any failure the namespace is removed again and
        :class:`MpsV3Error` raised: the job must then run without these settings.
        """
        if limit_mib <= 0:
            raise MpsV3Error(f"job {job_id}: a namespace needs a pinned memory limit ([GD]: "
                             "a named namespace without one gets the whole GPU)")
        if not 0 <= thread_pct <= 100:
            raise MpsV3Error(f"job {job_id}: active thread percentage {thread_pct} not 0-100")
        if uid < 0 or gid < 0:
            raise MpsV3Error(f"job {job_id}: bad uid/gid {uid}/{gid}")
        if self.node_gpus().get(int(gpu_index)) != uuid:
            raise MpsV3Error(f"GPU {gpu_index} ({uuid}) is not served by the MPS v3 daemon "
                             f"(it serves {self.node_gpus()})")
        server, ns = server_name(gpu_index), namespace_name(job_id)
        self.lock_shared_sockets()
        rows = self.servers()
        ident = self.identity()
        if ident is not None:
            self._record_servers(ident, rows)  # a server restarted since: know it too
        listed = {s["name"]: s for s in rows}
        if server not in listed or listed[server]["allowed-devices"] != uuid:
            raise MpsV3Error(f"server {server} for {uuid} is not running ([GD]: its clients "
                             "would run without MPS and without limits)")
        existing = [r for r in self._namespaces(server) if r[0] == ns]
        try:
            if not existing:
                self.command("namespace", "create", ns, f"--server={server}", silent=True)
            opts = [f"--pinned-memory-limit={int(limit_mib)}M"]
            if thread_pct:
                opts.append(f"--active-thread-percentage={int(thread_pct)}")
            self.command("namespace", "set", ns, f"--server={server}", *opts, silent=True)
            self._verify_limits(server, ns, limit_mib, thread_pct)
            ns_dir = self.pipe_dir / server / ns
            got = self.command("namespace", "get", ns, server, "pipe-directory").strip()
            if got != str(ns_dir):
                raise MpsV3Error(f"namespace {ns}: pipe directory {got!r}, expected {ns_dir}")
            self._hand_socket(server, ns, uid, gid)
            swept = self._sweep(server, ns, uid)
        except MpsV3Error:
            with contextlib.suppress(MpsV3Error):
                self.command("namespace", "delete", ns, f"--server={server}", "--force",
                             silent=True)
            raise
        record = JobRecord(int(job_id), int(gpu_index), uuid, server, ns, uid, gid,
                           int(limit_mib), int(thread_pct), str(ns_dir))
        write_root_file(self._job_file(job_id), json.dumps(asdict(record)))
        if swept:
            self._note(f"job {job_id}: terminated foreign clients {swept} of namespace {ns}")
        return {
            PIPE_ENV: str(ns_dir),  # [NS]: the namespace's directory selects it
            LOG_ENV: str(self.log_dir),
            "CUDA_VISIBLE_DEVICES": uuid,  # [EV]: UUIDs, since the server remaps indices
        }

    def _namespaces(self, server: str) -> list[list[str]]:
        out = self.command("namespace", "list", f"--server={server}", "--format=csv,noheader")
        return [line.split(",") for line in out.splitlines() if line.strip()]

    def _verify_limits(self, server: str, ns: str, limit_mib: int, thread_pct: int) -> None:
        """Read the limits back: a namespace without them would get the whole GPU."""
        text = self.command("namespace", "get", ns, server, "pinned-memory-limit").strip()
        try:
            got = parse_size_mib(text)
        except SizeError:
            raise MpsV3Error(f"namespace {ns}: pinned memory limit reads {text!r}") from None
        if got != limit_mib:
            raise MpsV3Error(f"namespace {ns}: pinned memory limit {text}, set {limit_mib}M")
        if thread_pct:
            text = self.command("namespace", "get", ns, server, "active-thread-percentage")
            try:
                pct = float(text.strip())
            except ValueError:
                raise MpsV3Error(f"namespace {ns}: thread percentage reads {text!r}") from None
            if abs(pct - thread_pct) > 0.01:
                raise MpsV3Error(f"namespace {ns}: thread percentage {pct}, set {thread_pct}")

    def _hand_socket(self, server: str, ns: str, uid: int, gid: int) -> None:
        """Only the job's user (and root) may connect: the socket becomes uid's, 0600.

        Walked from the pipe directory through directories only root can write, with
        ``O_NOFOLLOW``; only the daemon's own socket (root's or, on a repeat, already
        the user's; one link) is changed. The directories stay root's; they are made
        0755 (the daemon made them under umask 077), so that the user can reach the
        socket.
        """
        with _root_dir_fd(self.pipe_dir) as top:
            sfd = _open_subdir(top, server, f"{self.pipe_dir}/{server}")
            try:
                os.fchmod(sfd, ROUTE_DIR_MODE)  # the daemon's umask is 077: open the way
                nfd = _open_subdir(sfd, ns, f"{self.pipe_dir}/{server}/{ns}")
                try:
                    os.fchmod(nfd, ROUTE_DIR_MODE)
                    st = os.stat(CONTROL, dir_fd=nfd, follow_symlinks=False)
                    if (not stat.S_ISSOCK(st.st_mode) or st.st_nlink != 1
                            or st.st_uid not in (os.geteuid(), uid)):
                        raise MpsV3Error(f"{server}/{ns}/{CONTROL} is not the daemon's socket")
                    os.chmod(CONTROL, 0o600, dir_fd=nfd)
                    os.chown(CONTROL, uid, gid, dir_fd=nfd, follow_symlinks=False)
                finally:
                    os.close(nfd)
            finally:
                os.close(sfd)

    def clients(self, server: str) -> list[tuple[int, str]]:
        """(pid, namespace) of the clients of ``server`` ([IF] example columns)."""
        out = self.command("client", "list", f"--server={server}", "--format=csv,noheader")
        rows = []
        for line in out.splitlines():
            parts = line.split(",", 4)
            if len(parts) >= 4 and parts[0].strip().isdigit():
                rows.append((int(parts[0]), parts[3].strip()))
        return rows

    def _sweep(self, server: str, ns: str, uid: int) -> list[int]:
        """Terminate clients of another uid that reached the namespace before it was ours."""
        def foreign() -> list[int]:
            return [pid for pid, name in self.clients(server)
                    if name == ns and procfs.uid(pid) not in (None, uid)]

        found = foreign()
        for pid in found:
            with contextlib.suppress(MpsV3Error):  # it may have gone meanwhile
                self.command("client", "terminate", str(pid), silent=True)
        left = foreign() if found else []
        if left:
            raise MpsV3Error(f"namespace {ns}: clients {left} of other users remain")
        return found

    def job(self, job_id: int) -> JobRecord | None:
        """The job's record from root state, or None."""
        try:
            d = json.loads(read_small_file(self._job_file(job_id), owner=os.geteuid(),
                                           limit=4096))
            return JobRecord(**d)
        except (OSError, ValueError, TypeError):
            return None

    def jobs(self) -> list[JobRecord]:
        """Every job with a namespace here (root state)."""
        d = self.state_dir / JOBS_DIR
        ids = sorted(int(p.stem) for p in d.glob("*.json") if p.stem.isdigit()) if d.is_dir() \
            else []
        return [r for r in (self.job(i) for i in ids) if r is not None]

    def remove_job(self, job_id: int) -> str:
        """Delete the job's namespace: ``deleted``, ``forced`` or ``absent``.

        First without ``--force`` (refused while clients remain, [IF]); a job that is
        over must not keep a namespace, so its stragglers are then deleted with
        ``--force``. Whether a forced delete ends the clients or leaves them running
        without a namespace is not documented (docs/mps-v3.md).
        """
        record = self.job(job_id)
        if record is None:
            return "absent"
        result = "absent"
        if self.running() and any(r[0] == record.namespace
                                  for r in self._namespaces(record.server)):
            try:
                self.command("namespace", "delete", record.namespace,
                             f"--server={record.server}", silent=True)
                result = "deleted"
            except MpsV3Error:
                self.command("namespace", "delete", record.namespace,
                             f"--server={record.server}", "--force", silent=True)
                result = "forced"
        self._job_file(job_id).unlink(missing_ok=True)
        return result

    def _record_servers(self, ident: DaemonIdentity, rows: list[dict[str, str]]) -> None:
        """Remember the servers that are verifiably our daemon's children (root state).

        Kept as (pid, start time): the same process even after it outlives the daemon
        and is re-parented, which is when :meth:`stop` needs it most.
        """
        known = {(p.pid, p.start_ticks) for p in self._servers() if p.matches()}
        for row in rows:
            pid = int(row["pid"]) if row["pid"].isdigit() and len(row["pid"]) < 10 else 0
            ticks = procfs.start_ticks(pid) if pid else None
            if ticks is not None and procfs.parent(pid) == ident.pid:
                known.add((pid, ticks))
                priority.give_back(pid)  # a server the start made: not at the holder's priority
        write_root_file(self.state_dir / SERVERS_FILE, json.dumps(sorted(known)))

    def _servers(self) -> list[procfs.Process]:
        try:
            raw = json.loads(read_small_file(self.state_dir / SERVERS_FILE,
                                             owner=os.geteuid(), limit=1 << 16))
            return [procfs.Process(int(pid), int(ticks)) for pid, ticks in raw]
        except (OSError, ValueError, TypeError):
            return []

    def stop(self, timeout: float | None = None) -> list[int]:
        """Delete the servers (``--force``), ``-q``; signal what lingers. Pids signalled.

        Signals go only to the recorded daemon while it matches in ``/proc`` and to the
        servers recorded as its children (same pid and start time). Idempotent.
        """
        timeout = self.timeout if timeout is None else timeout
        ident = self.identity()
        live = ident is not None and ident.matches()
        daemon = (procfs.Process(ident.pid, ident.start_ticks)
                  if ident is not None and live else None)
        deadline = time.monotonic()
        if ident is not None and live:
            try:
                rows = self.servers()
                self._record_servers(ident, rows)
                for row in rows:
                    with contextlib.suppress(MpsV3Error):
                        self.command("server", "delete", row["name"], "--force", silent=True)
                self.command("-q")
                deadline = time.monotonic() + timeout
            except MpsV3Error:
                pass  # no polite way: straight to the signals
        servers = [p for p in self._servers() if p.matches()]

        def lingering() -> bool:
            return (daemon is not None and daemon.matches()) or any(p.matches() for p in servers)

        while time.monotonic() < deadline and lingering():
            time.sleep(0.05)
        signalled: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in servers:
                if p.signal(sig):
                    signalled.append(p.pid)
            if ident is not None and daemon is not None and daemon.matches() and ident.signal(sig):
                signalled.append(ident.pid)
            grace = time.monotonic() + 2
            while time.monotonic() < grace and lingering():
                time.sleep(0.05)
        if lingering():
            raise MpsV3Error(f"MPS v3 daemon or servers survived SIGKILL: {signalled}")
        self._forget()
        return sorted(set(signalled))

    def _forget(self) -> None:
        for name in (IDENTITY_FILE, NODE_FILE, SERVERS_FILE):
            with contextlib.suppress(OSError):
                (self.state_dir / name).unlink()
        jobs = self.state_dir / JOBS_DIR
        if jobs.is_dir() and not jobs.is_symlink():
            for p in jobs.glob("*.json"):
                p.unlink(missing_ok=True)

    @staticmethod
    def _note(msg: str) -> None:
        logging.getLogger("colloc.mps.v3").warning("%s", msg)
