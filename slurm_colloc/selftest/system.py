"""The real machine behind :class:`~slurm_colloc.selftest.gpu_kit.KitDeps`.

Kept apart from the kit's logic so that the logic is tested against fakes and this
module stays a thin layer over NVML, subprocess, pwd and /proc, run only on a GPU
node (docs/selftest.md).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import queue
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, cast

from slurm_colloc import procfs
from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuBackend
from slurm_colloc.mps.tenancy import Tenancy, ensure_root_dir
from slurm_colloc.node.epilog import EpilogResult
from slurm_colloc.node.job import JobContext
from slurm_colloc.node.prolog import PrologDecision
from slurm_colloc.selftest.gpu_kit import (
    ClientGone,
    CmdResult,
    DaemonSeen,
    KitDeps,
    MpsProc,
    User,
)
from slurm_colloc.slurm.adapter import SlurmAdapter

SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MPS_NAMES = frozenset({"nvidia-cuda-mps-control", "nvidia-cuda-mps-server"})
WORK_ROOT = Path("/run/colloc-selftest")
LOG_TAIL = 4096


class SystemCommands:
    """Programs run as root with a fixed PATH (no shell)."""

    def which(self, name: str) -> str | None:
        found = shutil.which(name, path=SBIN_PATH + ":" + os.environ.get("PATH", ""))
        return os.path.realpath(found) if found else None

    def run(self, argv: Sequence[str], timeout: float) -> CmdResult:
        try:
            cp = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                                check=False, env={"PATH": SBIN_PATH, "LANG": "C"},
                                stdin=subprocess.DEVNULL)
        except FileNotFoundError as e:
            return CmdResult(127, "", str(e))
        except (OSError, subprocess.TimeoutExpired) as e:
            return CmdResult(124, "", str(e))
        return CmdResult(cp.returncode, cp.stdout, cp.stderr)


def _tail(path: Path, limit: int = LOG_TAIL) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class ProcessClient:
    """A torch_client child: commands on its stdin, JSON lines read by a thread.

    The reading thread lets every wait have a deadline: a client stuck in CUDA
    initialisation (an MPS server that never answers) must not hang the kit.
    """

    def __init__(self, argv: list[str], user: User, env: dict[str, str], cwd: str,
                 stderr_path: Path) -> None:
        self._stderr_path = stderr_path
        self._err: IO[bytes] = stderr_path.open("wb")
        kw: dict[str, Any] = {}
        if os.geteuid() == 0 and user.uid != 0:
            kw = {"user": user.uid, "group": user.gid, "extra_groups": []}
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env,
            cwd=cwd, text=True, bufsize=1, start_new_session=True, **kw,
        )
        self.pid = self.proc.pid
        self.noise: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:
            raise ClientGone(f"client {self.pid} does not take commands: {e}") from e

    def read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ClientGone(f"client {self.pid}: no answer in {timeout:.0f}s") from None
            if line is None:
                self._lines.put(None)
                rc = self.proc.poll()
                raise ClientGone(f"client {self.pid} exited (status {rc}): "
                                 + " ".join(_tail(self._stderr_path, 600).split()[-60:]))
            text = line.strip()
            if text.startswith("{"):
                with contextlib.suppress(ValueError):
                    obj = json.loads(text)
                    if isinstance(obj, dict):
                        return obj
            self.noise.append(text[:500])

    def close(self, timeout: float) -> dict[str, Any]:
        with contextlib.suppress(ClientGone):
            self.send("exit")
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        killed = False
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(30)
            killed = True
        self._err.close()
        return {"returncode": rc, "killed": killed, "stderr_tail": _tail(self._stderr_path),
                "noise": self.noise[-20:]}


class ProcessClientRunner:
    """Starts torch_client processes; probes the interpreter as root."""

    def probe(self, python: str, script: str) -> dict[str, Any]:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            cp = subprocess.run([python, script, "probe"], capture_output=True, text=True,
                                timeout=300, check=False, env=env, stdin=subprocess.DEVNULL,
                                cwd="/")
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"torch": None, "error": f"{python}: {e}"}
        for line in reversed(cp.stdout.splitlines()):
            with contextlib.suppress(ValueError):
                obj = json.loads(line)
                if isinstance(obj, dict):
                    return obj
        return {"torch": None, "error": f"{python} exited {cp.returncode}: "
                + " ".join(cp.stderr.split()[-40:])}

    def start(self, name: str, python: str, script: str, user: User, env: dict[str, str],
              cwd: str) -> ProcessClient:
        return ProcessClient([python, script], user, env, cwd,
                             Path(cwd) / f"client-{name}.stderr")


class SystemUsers:
    """pwd lookups; useradd/userdel for ``--create-users``."""

    def __init__(self, commands: SystemCommands) -> None:
        self.commands = commands

    def lookup(self, name: str) -> User | None:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            return None
        return User(pw.pw_name, pw.pw_uid, pw.pw_gid, pw.pw_dir)

    def create(self, name: str) -> User:
        r = self.commands.run(["useradd", "--system", "--user-group", "--no-create-home",
                               "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
                               name], timeout=60)
        user = self.lookup(name)
        if r.returncode != 0 or user is None:
            raise RuntimeError(f"useradd {name}: exit {r.returncode}: {r.stderr.strip()}")
        return user

    def remove(self, name: str) -> None:
        r = self.commands.run(["userdel", name], timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"userdel {name}: exit {r.returncode}: {r.stderr.strip()}")
        with contextlib.suppress(KeyError):
            grp.getgrnam(name)
            self.commands.run(["groupdel", name], timeout=60)


class _NoController:
    """Slurm is not asked anything: the kit's jobs exist only on this node."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the self-test has no Slurm controller ({name} called)")


def _running_protocol(binary: str, pipe_dir: Path) -> int | None:
    """The protocol a running daemon answers in, where this colloc can ask (v3 module)."""
    try:
        from slurm_colloc.mps import v3  # type: ignore[attr-defined,unused-ignore]

        protocol: int | None = v3.running_protocol(binary, pipe_dir)
        return protocol
    except Exception:  # noqa: BLE001 - a fact for the JSON, never a reason to stop
        return None


class CollocNodeOps:
    """The node scripts' library calls, exactly as prolog/, TaskProlog and epilog/ make.

    The kit holds the collector's lock on its private metrics directory, so the
    prolog records its jobs' meta but starts no collector: the kit samples NVML
    itself, with the same backend call the collector makes.
    """

    def __init__(self, cfg: CollocConfig) -> None:
        from slurm_colloc.metrics.collector import acquire_lock

        self.cfg = cfg
        self.mps_root = cfg.mps_root
        ensure_root_dir(Path(cfg.mps_root))
        self._lock = acquire_lock(cfg.metrics_dir)

    def prolog(self, ctx: JobContext) -> PrologDecision:
        from slurm_colloc.node import prolog

        return prolog.run(ctx, self.cfg, cast(SlurmAdapter, _NoController()), jobs=None)

    def exports(self, job_id: int) -> list[str]:
        from slurm_colloc.node.task_prolog import export_lines

        return export_lines(self.cfg.mps_root, job_id)

    def release(self, job_id: int) -> EpilogResult:
        from slurm_colloc.node import epilog

        result = epilog.release_first(job_id, self.cfg)
        Tenancy(Path(self.cfg.mps_root)).forget_job_context(job_id)
        return result

    def _pairs(self) -> list[tuple[int, int]]:
        t = Tenancy(Path(self.mps_root))
        gpus = sorted(int(p.name[3:]) for p in Path(self.mps_root).glob("gpu*")
                      if p.name[3:].isdigit())
        return [(g, uid) for g in gpus for uid in t.users_on(g)]

    def daemons(self) -> list[DaemonSeen]:
        from slurm_colloc.mps.control import MpsControlError
        from slurm_colloc.node.prolog import daemon_for

        t = Tenancy(Path(self.mps_root))
        out = []
        for gpu, uid in self._pairs():
            d = daemon_for(self.cfg, t, gpu, uid)
            ident = d.identity()
            servers: list[tuple[int, int | None]] = []
            if ident is not None and ident.matches():
                with contextlib.suppress(MpsControlError):
                    servers = [(p, procfs.start_ticks(p)) for p in d.server_pids()]
            out.append(DaemonSeen(gpu, uid, ident.pid if ident else None,
                                  ident.start_ticks if ident else None, tuple(servers),
                                  _running_protocol(self.cfg.mps_control, t.pipe_dir(gpu, uid))))
        return out

    def stop_all(self) -> list[str]:
        from slurm_colloc.node.prolog import daemon_for

        t = Tenancy(Path(self.mps_root))
        errors = []
        for gpu, uid in self._pairs():
            try:
                daemon_for(self.cfg, t, gpu, uid).stop()
            except Exception as e:  # noqa: BLE001 - report every daemon's outcome
                errors.append(f"GPU {gpu} uid {uid}: {type(e).__name__}: {e}")
        return errors

    def logs(self) -> dict[str, str]:
        t = Tenancy(Path(self.mps_root))
        out = {}
        for gpu, uid in self._pairs():
            for name in ("control.log", "server.log"):
                text = _tail(t.log_dir(gpu, uid) / name)
                if text:
                    out[f"gpu{gpu}/uid{uid}/{name}"] = text
        return out

    def close(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _argv0(pid: int) -> str:
    raw = procfs.read(f"/proc/{pid}/cmdline", 4096) or b""
    return os.path.basename(raw.split(b"\0")[0].decode("utf-8", "replace"))


class ProcTable:
    """MPS processes from /proc (``comm`` is cut at 15 characters, so argv[0])."""

    def __init__(self, names: frozenset[str] = MPS_NAMES) -> None:
        self.names = names

    def mps_processes(self) -> list[MpsProc]:
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            name = _argv0(pid)
            if name not in self.names:
                continue
            out.append(MpsProc(pid, name, procfs.uid(pid),
                               procfs.environ(pid, "CUDA_MPS_PIPE_DIRECTORY"),
                               procfs.start_ticks(pid)))
        return out

    def alive(self, pid: int, start_ticks: int | None) -> bool:
        if not procfs.alive(pid):
            return False
        return start_ticks is None or procfs.start_ticks(pid) == start_ticks


def make_workdir(root: Path = WORK_ROOT) -> Path:
    """``/run/colloc-selftest/<pid>``: root's, 0755 (the clients read the script)."""
    ensure_root_dir(root, 0o755)
    path = root / str(os.getpid())
    if path.exists() and not path.is_symlink():
        shutil.rmtree(path)
    return ensure_root_dir(path, 0o755)


def remove_workdir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def nvml_backend() -> GpuBackend:
    from slurm_colloc.gpu.nvml import NvmlBackend

    return NvmlBackend()


def real_deps() -> KitDeps:
    """The kit wired to this machine."""
    commands = SystemCommands()
    return KitDeps(
        backend_factory=nvml_backend,
        commands=commands,
        clients=ProcessClientRunner(),
        users=SystemUsers(commands),
        node_factory=CollocNodeOps,
        procs=ProcTable(),
        workdir_factory=make_workdir,
        cleanup_workdir=remove_workdir,
        is_root=lambda: os.geteuid() == 0,
        cgroup_v2=lambda: os.path.exists("/sys/fs/cgroup/cgroup.controllers"),
        hostname=socket.gethostname,
    )
