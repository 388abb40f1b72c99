"""``colloc selftest --gpu``: colloc's node path on a real GPU, driver, MPS and PyTorch.

The kit plays Slurm for made-up jobs on one GPU: it builds each job's
:class:`~slurm_colloc.node.job.JobContext`, runs the real prolog (MPS daemon per
(GPU, user), memory limit), takes the job's environment from the real TaskProlog's
``export`` lines, runs a PyTorch client per job as the job's user with that
environment, and releases everything through the epilog's own first step. Between
those it measures what the unit tests can only assume: what CUDA shows a client,
where MPS stops an allocation, what NVML and nvidia-smi attribute to whom, what a
CUDA context and an MPS server cost, and how two users' servers share the GPU.

Everything that touches the machine comes in through :class:`KitDeps` (GPU backend,
client runner, commands, users, node scripts, process table, clock), so every step
and verdict is unit-tested against fakes that follow NVIDIA's documented behaviour;
:mod:`slurm_colloc.selftest.system` has the real ones.

Verdicts: ``pass``/``fail`` for what colloc relies on; ``info`` for facts the team
needs (versions, overheads, throughput, the negative control); ``not-run`` for a
check whose preconditions were missing (never reported as passed). A refusal
(:class:`Refusal`) is one line and exit status 2: the machine cannot run the kit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuBackend, GpuBackendError, GpuInfo, GpuProcess
from slurm_colloc.gpu_settings import effective, local_node
from slurm_colloc.node.epilog import EpilogResult
from slurm_colloc.node.job import JobContext
from slurm_colloc.node.prolog import PrologDecision

PASS, FAIL, INFO, NOT_RUN = "pass", "fail", "info", "not-run"
RESULTS = (PASS, FAIL, INFO, NOT_RUN)
SCHEMA = "colloc-selftest/1"
CLIENT_SCRIPT = Path(__file__).with_name("torch_client.py")
KIT_USERS = ("colloc-kit1", "colloc-kit2")
JOB_ID_BASE = 990_000_000
"""Made-up job ids: far above what a site's slurmctld hands out for years."""

CATALOGUE: dict[str, str] = {
    "driver": "NVIDIA driver and CUDA driver versions (NVML)",
    "gpu": "the GPU under test: Slurm index, NVML index, UUID, minor, PCI, memory",
    "gpu_idle": "no process used the GPU before the kit started",
    "compute_mode": "compute mode is DEFAULT (several MPS servers per GPU need it)",
    "mps_protocol": "MPS protocol generation of nvidia-cuda-mps-control (v2/v3)",
    "cgroup_v2": "the node runs the unified cgroup v2 hierarchy",
    "hard_limit": "the driver offers hard per-cgroup GPU memory limits",
    "nvidia_smi": "nvidia-smi is installed (for the cross-check)",
    "torch": "PyTorch version and CUDA build the clients run",
    "users": "which users the clients run as (two users for the two-user checks)",
    "prolog": "the prolog gave every test job an MPS daemon and a limit",
    "task_prolog": "the TaskProlog exports the pipe dir, limit and the GPU's UUID",
    "visibility": "each client sees exactly one device, the GPU's UUID, as its user",
    "mps_two_users": "two users' MPS daemons and servers run side by side on one GPU",
    "alloc_within_limit": "each client allocates half its limit",
    "nvml_attribution": "NVML lists every client pid with its memory (MPS client flag)",
    "nvidia_smi_match": "nvidia-smi's per-process memory matches the collector's (NVML)",
    "oom_at_limit": "filling past its limit gives PyTorch's OOM text, found by the detector",
    "budget_fits_shards": "a client at its pinned limit stays within its shards in NVML",
    "survivor_same_user": "after the OOM, another client of the same user still allocates",
    "survivor_other_user": "after the OOM, the other user's client still allocates",
    "negative_control": "a client keeping Slurm's global index under a one-device daemon",
    "overhead_context": "CUDA context per client (NVML per-process minus torch reserved)",
    "overhead_mps_server": "memory of one MPS server process",
    "overhead_reserved": "memory the driver reserves on the GPU",
    "throughput_one_user": "two clients of one user (one MPS server) vs one client",
    "throughput_two_users": "two clients of two users (two servers, time-sliced)",
    "epilog_release": "the epilog's release stopped every test daemon",
    "teardown": "no nvidia-cuda-mps-control/-server process of the kit remains",
    "users_cleanup": "users the kit created are removed",
}


class Refusal(Exception):
    """The machine cannot run the kit; the message is the one line the admin sees."""


class ClientGone(RuntimeError):
    """A client did not answer in time, or its stdout closed."""


# --- the machine, as the kit sees it ---------------------------------------------


@dataclass(frozen=True)
class User:
    """A user the clients run as."""

    name: str
    uid: int
    gid: int
    home: str = "/"


ROOT_USER = User("root", 0, 0, "/root")


@dataclass(frozen=True)
class CmdResult:
    """What a command printed (``returncode`` 127: not found)."""

    returncode: int
    stdout: str
    stderr: str = ""


class Commands(Protocol):
    """Programs the kit runs as root (nvidia-smi, useradd)."""

    def which(self, name: str) -> str | None: ...

    def run(self, argv: Sequence[str], timeout: float) -> CmdResult: ...


class ClientHandle(Protocol):
    """A running :mod:`~slurm_colloc.selftest.torch_client`."""

    pid: int

    def send(self, line: str) -> None: ...

    def read(self, timeout: float) -> dict[str, Any]:
        """The next JSON line; raises :class:`ClientGone`."""
        ...

    def close(self, timeout: float) -> dict[str, Any]:
        """Ask it to exit, wait (kill when it will not); returncode and stderr tail."""
        ...


class ClientRunner(Protocol):
    """Starts clients as a given user with a given environment."""

    def probe(self, python: str, script: str) -> dict[str, Any]: ...

    def start(
        self, name: str, python: str, script: str, user: User, env: dict[str, str], cwd: str
    ) -> ClientHandle: ...


class UserDb(Protocol):
    """System users: looked up, and (``--create-users``) created and removed."""

    def lookup(self, name: str) -> User | None: ...

    def create(self, name: str) -> User: ...

    def remove(self, name: str) -> None: ...


@dataclass(frozen=True)
class DaemonSeen:
    """One MPS control daemon of the kit and the servers it reported."""

    gpu: int
    uid: int
    pid: int | None
    start_ticks: int | None
    servers: tuple[tuple[int, int | None], ...] = ()
    """(pid, start ticks) of each server ``get_server_list`` named."""
    protocol: int | None = None
    """MPS protocol the running daemon answers in (2/3); None: not known."""


@dataclass(frozen=True)
class MpsProc:
    """An nvidia-cuda-mps-control/-server process found on the node."""

    pid: int
    name: str
    uid: int | None
    pipe_dir: str | None
    start_ticks: int | None


class NodeOps(Protocol):
    """colloc's node scripts, as Slurm would run them for the kit's jobs."""

    mps_root: str

    def prolog(self, ctx: JobContext) -> PrologDecision: ...

    def exports(self, job_id: int) -> list[str]: ...

    def release(self, job_id: int) -> EpilogResult: ...

    def daemons(self) -> list[DaemonSeen]: ...

    def stop_all(self) -> list[str]:
        """Stop any daemon still recorded (after the verdict); errors as text."""
        ...

    def logs(self) -> dict[str, str]:
        """Tails of the MPS control/server logs, for the JSON."""
        ...

    def close(self) -> None: ...


class ProcessTable(Protocol):
    """The node's MPS processes, from /proc."""

    def mps_processes(self) -> list[MpsProc]: ...

    def alive(self, pid: int, start_ticks: int | None) -> bool: ...


def _lazy_mps_detect(binary: str) -> Any:
    """``slurm_colloc.mps.v3.detect`` when that module exists (it may not yet)."""
    from slurm_colloc.mps import v3  # type: ignore[attr-defined,unused-ignore]

    return v3.detect(binary)


def _lazy_python_trust(python: str) -> str | None:
    """:func:`slurm_colloc.selftest.trust.untrusted_interpreter`."""
    from slurm_colloc.selftest.trust import untrusted_interpreter

    return untrusted_interpreter(python)


@dataclass
class KitDeps:
    """Everything the kit touches; the tests hand in fakes."""

    backend_factory: Callable[[], GpuBackend]
    commands: Commands
    clients: ClientRunner
    users: UserDb
    node_factory: Callable[[CollocConfig], NodeOps]
    procs: ProcessTable
    workdir_factory: Callable[[], Path]
    """A fresh root-owned directory (0755) for the kit's state and the client script."""
    cleanup_workdir: Callable[[Path], None]
    is_root: Callable[[], bool]
    cgroup_v2: Callable[[], bool]
    hostname: Callable[[], str]
    mps_detect: Callable[[str], Any] = _lazy_mps_detect
    python_trust: Callable[[str], str | None] = _lazy_python_trust
    """Why root must not run ``--python`` (None: it may): selftest/trust.py."""
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep


@dataclass(frozen=True)
class KitOptions:
    """What the admin asked for (the CLI's options)."""

    gpu_index: int | None = None
    """Slurm's index of the GPU to test; None: the last one (exercises remapping)."""
    users: tuple[str, ...] = ()
    create_users: bool = False
    python: str = sys.executable
    shard_mib: int | None = None
    """None: the site's shard_mib."""
    shards: tuple[int, int] = (2, 3)
    """Shards of the first and second user's job."""
    tolerance_mib: int = 16
    tolerance_pct: float = 2.0
    fill_chunk_mib: int = 64
    bench_seconds: float = 8.0
    bench_sizes: tuple[int, ...] = (2048, 8192)
    settle_s: float = 1.0
    ready_timeout_s: float = 180.0
    command_timeout_s: float = 120.0


@dataclass
class Check:
    """One line of the verdict table."""

    name: str
    result: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class KitResult:
    """Everything the kit found; :func:`to_json` is the file the team asks for."""

    exit_code: int
    refusal: str | None
    host: str
    started: float
    finished: float
    options: dict[str, Any]
    environment: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)
    suggested_config: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, int]:
        return {r: sum(1 for c in self.checks if c.result == r) for r in RESULTS}


def to_json(res: KitResult) -> dict[str, Any]:
    """The JSON document (schema ``colloc-selftest/1``, keys in docs/selftest.md)."""
    try:
        from importlib.metadata import version

        colloc_version = version("slurm-colloc")
    except Exception:  # noqa: BLE001 - a source checkout has no metadata
        colloc_version = "unknown"
    return {
        "schema": SCHEMA,
        "colloc_version": colloc_version,
        "host": res.host,
        "started": _iso(res.started),
        "finished": _iso(res.finished),
        "duration_s": round(res.finished - res.started, 3),
        "exit_code": res.exit_code,
        "refusal": res.refusal,
        "options": res.options,
        "environment": res.environment,
        "config": res.config,
        "checks": [dataclasses.asdict(c) for c in res.checks],
        "summary": res.summary(),
        "measurements": res.measurements,
        "suggested_config": res.suggested_config,
    }


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def one_line(text: str, limit: int = 400) -> str:
    """A refusal is one line, whatever the error it came from looked like."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


# --- small parsers -------------------------------------------------------------------


def parse_exports(lines: Sequence[str]) -> dict[str, str]:
    """``export K=V`` lines (what Slurm applies from a TaskProlog) as a dict."""
    out = {}
    for line in lines:
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            out[key] = value
    return out


_LIMIT = re.compile(r"^\s*(\d+)\s*=\s*(\d+)\s*([KMGkmg]?)\s*$")


def pinned_mib(value: str | None) -> int | None:
    """Device 0's limit in ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``0=1536M``) in MiB."""
    for part in (value or "").split(","):
        m = _LIMIT.match(part)
        if m and m.group(1) == "0":
            n, unit = int(m.group(2)), m.group(3).upper()
            return {"G": n * 1024, "M": n, "K": n // 1024, "": n >> 20}[unit]
    return None


def norm_uuid(uuid: str | None) -> str:
    """``GPU-xxxx`` (NVML) and ``xxxx`` (torch) name the same device."""
    u = (uuid or "").strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def parse_smi_apps(text: str) -> list[dict[str, Any]]:
    """``--query-compute-apps=gpu_uuid,pid,used_memory,process_name`` rows (nounits)."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",", 3)]
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        used = int(parts[2]) if parts[2].isdigit() else None
        rows.append({"gpu_uuid": parts[0], "pid": int(parts[1]), "used_mib": used,
                     "name": parts[3] if len(parts) > 3 else ""})
    return rows


def round_up(mib: float, step: int = 32) -> int:
    return int(math.ceil(mib / step) * step)


def slurm_order(gpus: Sequence[GpuInfo]) -> tuple[list[GpuInfo], str]:
    """The GPUs in Slurm's index order, and which rule gave it.

    :mod:`slurm_colloc.gpu.identity` is the authority (the prolog uses it); without it
    the kit falls back to its rule (minor-number order, NVML order when no minors).
    """
    try:
        from slurm_colloc.gpu.identity import GpuMap
    except ImportError:
        if all(g.minor_number is not None for g in gpus):
            return sorted(gpus, key=lambda g: g.minor_number or 0), "minor (kit fallback)"
        return sorted(gpus, key=lambda g: g.index), "nvml (kit fallback)"
    gmap = GpuMap.from_gpus(gpus)
    return list(gmap.gpus), "minor" if gmap.by_minor else "nvml"


# --- the kit ---------------------------------------------------------------------------


@dataclass
class KitClient:
    """One made-up job and its client."""

    role: str
    user: User
    job_id: int
    shards: int
    decision: PrologDecision | None = None
    exports: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    handle: ClientHandle | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    answers: dict[str, Any] = field(default_factory=dict)
    exit: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.handle.pid if self.handle is not None else None

    @property
    def pinned(self) -> int | None:
        return pinned_mib(self.exports.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"))

    @property
    def allocation(self) -> int:
        v = self.exports.get("COLLOC_LIMIT_MIB", "")
        return int(v) if v.isdigit() else 0

    @property
    def ok(self) -> bool:
        return self.handle is not None and bool(self.ready.get("ok"))

    def record(self) -> dict[str, Any]:
        d = self.decision
        return {
            "role": self.role, "user": self.user.name, "uid": self.user.uid,
            "job_id": self.job_id, "shards": self.shards, "pid": self.pid,
            "prolog": None if d is None else dataclasses.asdict(d),
            "exports": self.exports, "env": self.env, "ready": self.ready,
            "answers": self.answers, "exit": self.exit,
        }


class Abort(Exception):
    """A step failed in a way later steps depend on; teardown still runs."""


class GpuKit:
    """One run of the kit (see module docstring)."""

    def __init__(self, opts: KitOptions, deps: KitDeps, site: CollocConfig) -> None:
        self.o = opts
        self.d = deps
        self.site = site
        self.checks: dict[str, Check] = {}
        self.env: dict[str, Any] = {}
        self.m: dict[str, Any] = {}
        self.suggest: list[str] = []
        self.cfg: CollocConfig = site
        self.gpu: GpuInfo | None = None
        self.slurm_index = -1
        self.backend: GpuBackend | None = None
        self.mps_binary = ""
        self.users: list[User] = []
        self.created: list[str] = []
        self.clients: dict[str, KitClient] = {}
        self.node: NodeOps | None = None
        self.workdir: Path | None = None
        self.seen_daemons: dict[tuple[int, int], DaemonSeen] = {}

    # --- verdicts ------------------------------------------------------------------
    def check(self, name: str, result: str, detail: str, **data: Any) -> None:
        assert name in CATALOGUE and result in RESULTS, (name, result)
        self.checks[name] = Check(name, result, detail, data)

    def result(self, exit_code: int | None, refusal: str | None, started: float) -> KitResult:
        checks = [self.checks.get(n) or Check(n, NOT_RUN, "not reached") for n in CATALOGUE]
        if refusal is not None:
            checks = [c for c in checks if c.name in self.checks]
        if exit_code is None:
            exit_code = 1 if any(c.result == FAIL for c in checks) else 0
        return KitResult(
            exit_code=exit_code, refusal=refusal, host=self.d.hostname(), started=started,
            finished=self.d.clock(), options=_options(self.o), environment=self.env,
            config=_config_subset(self.cfg), checks=checks, measurements=self.m,
            suggested_config=self.suggest,
        )

    # --- the run ---------------------------------------------------------------------
    def run(self) -> KitResult:
        started = self.d.clock()
        try:
            self.preflight()
        except Refusal as r:
            if self.backend is not None:
                with contextlib.suppress(Exception):
                    self.backend.close()
            return self.result(2, one_line(str(r)), started)
        try:
            self.detect()
            self.exercise()
        finally:
            if self.backend is not None:
                with contextlib.suppress(Exception):
                    self.backend.close()
        return self.result(None, None, started)

    # --- 1. refusals, in order -----------------------------------------------------
    def preflight(self) -> None:
        """Refuse with one line unless this machine can run every step.

        Order: what the hardware lacks first (no NVML, driver not loaded, no GPU, no
        such GPU), then what the admin can fix (root, torch, MPS utilities, a GPU in
        use), users last because ``--create-users`` changes the system: on a laptop
        the answer is "no GPU", not "run as root", and no user is created for a run
        that is refused anyway.
        """
        self._preflight_gpu()
        if not self.d.is_root():
            raise Refusal("colloc selftest --gpu must run as root: the prolog starts MPS "
                          "daemons as root and the clients run as other users "
                          "(sudo colloc selftest --gpu)")
        untrusted = self.d.python_trust(self.o.python)
        if untrusted is not None:
            raise Refusal(f"--python {self.o.python}: root does not run it: {untrusted} "
                          "(use an interpreter and environment only root can change)")
        probe = self.d.clients.probe(self.o.python, str(CLIENT_SCRIPT))
        self.env["torch"] = probe
        if not probe.get("torch"):
            raise Refusal(f"PyTorch is not importable by {self.o.python} "
                          f"({probe.get('error') or 'no answer'}): pip install torch, or "
                          "pass --python an interpreter that has it")
        if not probe.get("cuda_available"):
            raise Refusal(f"PyTorch {probe.get('torch')} (CUDA {probe.get('cuda')}) cannot use "
                          f"the GPU: {probe.get('error') or 'no CUDA device'}; install a CUDA "
                          "build this driver supports (pip install torch)")
        self._preflight_mps_and_idle()
        self.users = self._resolve_users()

    def _preflight_gpu(self) -> None:
        """NVML works, sees GPUs, Slurm's order is known and the chosen GPU exists."""
        try:
            self.backend = self.d.backend_factory()
        except GpuBackendError as e:
            # the backend's own advice about the sim backend is no help to this admin
            why = str(e).split(" colloc never falls back")[0].rstrip(".")
            raise Refusal(f"no usable NVML: {why}") from e
        try:
            gpus = self.backend.gpus()
        except GpuBackendError as e:
            raise Refusal(f"NVML cannot list the GPUs: {e}") from e
        if not gpus:
            raise Refusal("NVML sees no GPU on this node (nvidia-smi -L lists none): "
                          "nothing to test")
        try:
            order, rule = slurm_order(gpus)
        except RuntimeError as e:  # GpuIdentityError: Slurm's order is unknowable
            raise Refusal(f"cannot tell Slurm's GPU order: {e}") from e
        idx = len(order) - 1 if self.o.gpu_index is None else self.o.gpu_index
        if not 0 <= idx < len(order):
            raise Refusal(f"--gpu-index {idx}: this node has Slurm GPU indices "
                          f"0-{len(order) - 1}")
        self.gpu, self.slurm_index = order[idx], idx
        self.env["gpus"] = [dataclasses.asdict(g) for g in gpus]
        self.env["slurm_order"] = {"rule": rule, "uuids": [g.uuid for g in order]}

    def _preflight_mps_and_idle(self) -> None:
        """The MPS control program is there and the chosen GPU runs nothing."""
        binary = self.d.commands.which(self.site.mps_control)
        if binary is None:
            raise Refusal(f"MPS control program {self.site.mps_control!r} not found "
                          "(mps_control in colloc.conf): install the NVIDIA driver's MPS "
                          "utilities (nvidia-cuda-mps-control)")
        self.mps_binary = binary
        assert self.backend is not None and self.gpu is not None  # set by _preflight_gpu
        try:
            busy = self.backend.sample(self.gpu.index).processes
        except GpuBackendError as e:
            raise Refusal(f"NVML cannot sample GPU {self.slurm_index}: {e}") from e
        if busy:
            raise Refusal(f"GPU {self.slurm_index} ({self.gpu.uuid}) is in use by pid(s) "
                          f"{', '.join(str(p.pid) for p in busy)}: drain the node or pick "
                          "another --gpu-index")

    def _resolve_users(self) -> list[User]:
        names = list(dict.fromkeys(u for u in self.o.users if u))
        if self.o.create_users and not names:
            names = list(KIT_USERS)
        users = []
        for name in names[:2]:
            user = self.d.users.lookup(name)
            if user is None and self.o.create_users:
                try:
                    user = self.d.users.create(name)
                except Exception as e:  # useradd's reasons vary
                    self._remove_created()
                    raise Refusal(f"cannot create user {name}: {e}") from e
                self.created.append(name)
            if user is None:
                raise Refusal(f"--users: no user {name!r} on this node "
                              "(or pass --create-users)")
            users.append(user)
        return users or [ROOT_USER]

    # --- 2. detection ----------------------------------------------------------------
    def detect(self) -> None:
        assert self.backend is not None and self.gpu is not None
        b, g = self.backend, self.gpu
        drv = _call(b, "driver_version")
        cuda = _call(b, "cuda_driver_version")
        cuda_s = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None
        self.env.update(driver_version=drv, cuda_driver_version=cuda_s)
        self.check("driver", INFO, f"driver {drv or '?'}, CUDA driver {cuda_s or '?'}")
        self.env["gpu"] = {**dataclasses.asdict(g), "slurm_index": self.slurm_index}
        self.check("gpu", INFO,
                   f"Slurm GPU {self.slurm_index} = NVML {g.index}, {g.name}, {g.uuid}, "
                   f"minor {g.minor_number}, PCI {g.pci_bus_id or '?'}, "
                   f"{g.memory_total_mib} MiB, reserved {g.reserved_mib} MiB")
        self.check("gpu_idle", PASS, "no compute process on the GPU before the run")
        idle = b.sample(g.index)
        self.m["idle"] = {"memory_used_mib": idle.memory_used_mib}
        modes = _call(b, "compute_modes")
        mode = modes.get(g.index) if isinstance(modes, dict) else None
        self.env["compute_mode"] = mode
        if mode is None:
            self.check("compute_mode", INFO, "the backend cannot tell the compute mode")
        elif mode == "DEFAULT":
            self.check("compute_mode", PASS, "DEFAULT")
        else:
            self.check("compute_mode", FAIL, f"{mode}: colloc runs one MPS server per user "
                       f"on a GPU and needs DEFAULT (nvidia-smi -i {g.index} -c DEFAULT)")
        self._detect_mps()
        cg = self.d.cgroup_v2()
        self.env["cgroup_v2"] = cg
        self.check("cgroup_v2", INFO, "yes" if cg else "no (cgroup v1 or hybrid)")
        hard = b.hard_memory_limit_supported(g.index)
        self.env["hard_limit"] = dataclasses.asdict(hard)
        self.check("hard_limit", INFO, f"{'yes' if hard.supported else 'no'}: {hard.reason}")
        smi = self.d.commands.which("nvidia-smi")
        self.env["nvidia_smi"] = smi
        self.check("nvidia_smi", INFO if smi else NOT_RUN,
                   smi or "not installed: the nvidia-smi cross-check is not run")
        t = self.env.get("torch", {})
        self.check("torch", INFO, f"torch {t.get('torch')} (CUDA {t.get('cuda')}) in "
                   f"{self.o.python}, {t.get('device_count')} device(s) as root")
        names = ", ".join(f"{u.name} ({u.uid})" for u in self.users)
        if len(self.users) >= 2:
            self.check("users", INFO, f"{names}" + (" (created)" if self.created else ""))
        else:
            self.check("users", INFO, f"{names} only: two-user checks not run "
                       "(--users A,B or --create-users)")
        self.env["users"] = [dataclasses.asdict(u) for u in self.users]
        self.env["users_created"] = list(self.created)

    def _detect_mps(self) -> None:
        try:
            cap = self.d.mps_detect(self.mps_binary)
        except ImportError:
            self.env["mps"] = {"binary": self.mps_binary, "protocol": "unknown"}
            self.check("mps_protocol", INFO, "unknown (this colloc has no MPS v3 detection)")
            return
        except Exception as e:  # noqa: BLE001 - detection is a fact, not a gate
            self.env["mps"] = {"binary": self.mps_binary, "protocol": "unknown",
                               "error": str(e)}
            self.check("mps_protocol", INFO, f"unknown ({type(e).__name__}: {e})")
            return
        info = dataclasses.asdict(cap) if dataclasses.is_dataclass(cap) and not isinstance(
            cap, type) else {"repr": repr(cap)}
        raw = getattr(cap, "protocol", None)
        protocol = f"v{raw}" if isinstance(raw, int) else str(raw or "unknown")
        self.env["mps"] = {"binary": self.mps_binary, **info, "protocol": protocol}
        why = getattr(cap, "detail", "") or self.mps_binary
        self.check("mps_protocol", INFO, f"{protocol}: {why}")

    # --- 3. the jobs -----------------------------------------------------------------
    def exercise(self) -> None:
        """Jobs up, measure, jobs down; teardown runs whatever happened before it."""
        try:
            self.workdir = self.d.workdir_factory()
            self.cfg = kit_config(self.site, self.workdir, self.mps_binary, self.o.shard_mib)
            if self.gpu is not None:  # this GPU model's and node's overheads (gpu_types, nodes)
                self.cfg = effective(self.cfg, node=local_node(), model=self.gpu.name)
            self.env["kit_config"] = _config_subset(self.cfg)
            self.node = self.d.node_factory(self.cfg)
            self._plan()
            self._prolog()
            self._start_clients()
            self._within_limits()
            self._oom()
            self._negative_control()
            self._throughput()
        except Abort as e:
            self.m.setdefault("aborted", str(e))
        except Exception as e:  # noqa: BLE001 - an unforeseen error still tears down
            self.m["aborted"] = f"{type(e).__name__}: {e}"
        finally:
            self._teardown()

    def _plan(self) -> None:
        a = self.users[0]
        self.clients["a"] = KitClient("a", a, JOB_ID_BASE + 1, self.o.shards[0])
        self.clients["a2"] = KitClient("a2", a, JOB_ID_BASE + 2, self.o.shards[1])
        if len(self.users) >= 2:
            self.clients["b"] = KitClient("b", self.users[1], JOB_ID_BASE + 3, self.o.shards[1])
        self.m["clients"] = {r: c.record() for r, c in self.clients.items()}

    def _ctx(self, c: KitClient) -> JobContext:
        return JobContext(
            job_id=c.job_id, uid=c.user.uid, user=c.user.name, node=self.d.hostname(),
            gpus=(self.slurm_index,), shards=c.shards, gpu_count=0, stdout=None, stderr=None,
            restarts=0, admin_comment="", exit_code="", state="RUNNING",
        )

    def _prolog(self) -> None:
        assert self.node is not None and self.gpu is not None
        problems = []
        for c in self.clients.values():
            try:
                c.decision = self.node.prolog(self._ctx(c))
            except Exception as e:  # noqa: BLE001 - the verdict says what broke
                problems.append(f"job {c.job_id}: {type(e).__name__}: {e}")
                continue
            if c.decision.mode != "shared":
                problems.append(f"job {c.job_id}: {c.decision.mode} ({c.decision.detail})")
            c.exports = parse_exports(self.node.exports(c.job_id))
        self._record()
        if problems:
            self.check("prolog", FAIL, "; ".join(problems))
            raise Abort("prolog failed")
        self.check("prolog", PASS, "; ".join(
            f"{c.role}: {c.decision.detail}" for c in self.clients.values()
            if c.decision is not None))
        missing, wrong, notes = [], [], []
        for c in self.clients.values():
            for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
                if key not in c.exports:
                    missing.append(f"{c.role}: {key}")
            if c.pinned is None and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in c.exports:
                wrong.append(f"{c.role}: limit {c.exports['CUDA_MPS_PINNED_DEVICE_MEM_LIMIT']!r}")
            cvd = c.exports.get("CUDA_VISIBLE_DEVICES")
            if cvd is None:
                notes.append(f"{c.role}: no CUDA_VISIBLE_DEVICES (the job keeps Slurm's)")
            elif norm_uuid(cvd) != norm_uuid(self.gpu.uuid):
                wrong.append(f"{c.role}: CUDA_VISIBLE_DEVICES={cvd}, GPU is {self.gpu.uuid}")
        if missing or wrong:
            self.check("task_prolog", FAIL, "; ".join(missing + wrong + notes))
            raise Abort("task prolog exports unusable")
        self.check("task_prolog", PASS, "; ".join(
            [f"{c.role}: pinned {c.pinned} MiB of {c.allocation or '?'} MiB allocated"
             for c in self.clients.values()] + notes))

    def _client_env(self, c: KitClient, visible: str | None = None) -> dict[str, str]:
        """What a task of the job would have: Slurm's variables, then the exports.

        Slurm sets CUDA_VISIBLE_DEVICES to the job's index (the global one where
        devices are not constrained); the TaskProlog's exports are applied after.
        """
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": c.user.home if c.user.home and Path(c.user.home).is_dir() else "/tmp",
            "USER": c.user.name, "LOGNAME": c.user.name, "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "SLURM_JOB_ID": str(c.job_id), "SLURM_JOB_UID": str(c.user.uid),
            "SLURM_JOB_GPUS": str(self.slurm_index),
            "CUDA_VISIBLE_DEVICES": str(self.slurm_index),
        }
        env.update(c.exports)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        return env

    def _script(self) -> str:
        assert self.workdir is not None
        dst = self.workdir / "torch_client.py"
        if not dst.exists():
            dst.write_bytes(CLIENT_SCRIPT.read_bytes())
            dst.chmod(0o644)
        return str(dst)

    def _launch(self, c: KitClient, env: dict[str, str]) -> None:
        assert self.workdir is not None
        c.env = env
        try:
            c.handle = self.d.clients.start(c.role, self.o.python, self._script(), c.user,
                                            env, str(self.workdir))
        except Exception as e:  # noqa: BLE001 - typically an interpreter the user cannot run
            c.ready = {"ok": False, "error": f"cannot start {self.o.python} as {c.user.name}: "
                       f"{type(e).__name__}: {e} (the interpreter and its packages must be "
                       "readable by the test users: see --python)"}
            return
        try:
            c.ready = c.handle.read(self.o.ready_timeout_s)
        except ClientGone as e:
            c.ready = {"ok": False, "error": str(e)}

    def _start_clients(self) -> None:
        assert self.gpu is not None
        bad: list[str] = []
        good: list[str] = []
        for c in self.clients.values():
            self._launch(c, self._client_env(c))
            r = c.ready
            why = []
            if not r.get("ok"):
                why.append(str(r.get("error")))
            else:
                if r.get("device_count") != 1:
                    why.append(f"sees {r.get('device_count')} devices")
                if r.get("uuid") is None:
                    why.append("torch reports no device UUID (torch >= 2.1 needed)")
                elif norm_uuid(r.get("uuid")) != norm_uuid(self.gpu.uuid):
                    why.append(f"device 0 is {r.get('uuid')}, not {self.gpu.uuid}")
                if r.get("uid") != c.user.uid:
                    why.append(f"runs as uid {r.get('uid')}, not {c.user.uid}")
            (bad if why else good).append(f"{c.role} ({c.user.name}, pid {c.pid}): "
                                          + ("; ".join(why) if why else "1 device, UUID ok"))
        self._snapshot_daemons()
        self._record()
        if bad:
            self.check("visibility", FAIL, "; ".join(bad + good))
        else:
            self.check("visibility", PASS, "; ".join(good))
        if not any(c.ok for c in self.clients.values()):
            raise Abort("no client started")
        self._two_users()

    def _snapshot_daemons(self) -> None:
        assert self.node is not None
        for d in self.node.daemons():
            old = self.seen_daemons.get((d.gpu, d.uid))
            if old is not None and old.pid == d.pid:  # keep servers seen earlier
                d = dataclasses.replace(d, servers=tuple(dict.fromkeys(old.servers + d.servers)))
            self.seen_daemons[(d.gpu, d.uid)] = d
        self.m["daemons"] = [dataclasses.asdict(d) for d in self.seen_daemons.values()]

    def _two_users(self) -> None:
        b = self.clients.get("b")
        if b is None:
            self.check("mps_two_users", NOT_RUN, "one user only")
            return
        uids = {self.clients["a"].user.uid, b.user.uid}
        daemons = [d for d in self.seen_daemons.values() if d.uid in uids and d.pid]
        if not self.seen_daemons:
            self.check("mps_two_users", NOT_RUN, "no per-(GPU, user) daemon recorded by the "
                       "prolog (an MPS v3 prolog keeps another layout)")
            return
        servers = sum(len(d.servers) for d in daemons)
        detail = f"{len(daemons)} daemons, {servers} servers for uids {sorted(uids)}"
        ok = len(daemons) == 2 and all(d.servers for d in daemons) and self.clients["a"].ok \
            and b.ok
        self.check("mps_two_users", PASS if ok else FAIL, detail)

    def _ask(self, c: KitClient, line: str, timeout: float | None = None) -> dict[str, Any]:
        """Send one command and wait for its answer (never raises)."""
        if c.handle is None:
            return {"ok": False, "error": "client not running"}
        try:
            c.handle.send(line)
            ans = c.handle.read(timeout or self.o.command_timeout_s)
        except ClientGone as e:
            ans = {"ok": False, "error": str(e)}
        c.answers.setdefault(line.split()[0], []).append(ans)
        return ans

    def _sample(self, pids: Sequence[int]) -> dict[int, GpuProcess]:
        """NVML's processes once every pid shows (NVML can lag a new context)."""
        assert self.backend is not None and self.gpu is not None
        procs: dict[int, GpuProcess] = {}
        for _ in range(5):
            self.d.sleep(self.o.settle_s)
            s = self.backend.sample(self.gpu.index)
            procs = {p.pid: p for p in s.processes}
            if all(p in procs for p in pids):
                break
        return procs

    def _smi(self) -> list[dict[str, Any]] | None:
        assert self.gpu is not None
        if not self.env.get("nvidia_smi"):
            return None
        r = self.d.commands.run(
            [str(self.env["nvidia_smi"]),
             "--query-compute-apps=gpu_uuid,pid,used_memory,process_name",
             "--format=csv,noheader,nounits"], timeout=60)
        if r.returncode != 0:
            self.m.setdefault("nvidia_smi_errors", []).append(one_line(r.stderr or r.stdout))
            return None
        return [row for row in parse_smi_apps(r.stdout)
                if norm_uuid(row["gpu_uuid"]) == norm_uuid(self.gpu.uuid)]

    def _within_limits(self) -> None:
        live = [c for c in self.clients.values() if c.ok]
        failed = []
        for c in live:
            want = max(1, (c.pinned or self.cfg.shard_mib) // 2)
            ans = self._ask(c, f"alloc {want}")
            if not ans.get("ok"):
                failed.append(f"{c.role}: {want} MiB: {ans.get('error')}")
        self.check("alloc_within_limit", FAIL if failed else PASS,
                   "; ".join(failed) or ", ".join(
                       f"{c.role}: {max(1, (c.pinned or 0) // 2)} MiB" for c in live))
        reports = {c.role: self._ask(c, "report") for c in live}
        procs = self._sample([c.pid for c in live if c.pid is not None])
        smi = self._smi()
        self.m["nvml_hold"] = [dataclasses.asdict(p) for p in procs.values()]
        self.m["nvidia_smi_hold"] = smi
        self._attribution(live, procs, reports)
        self._smi_match(live, procs, smi)
        self._overheads(live, procs, reports, smi)
        self._record()

    def _attribution(self, live: list[KitClient], procs: dict[int, GpuProcess],
                     reports: dict[str, dict[str, Any]]) -> None:
        bad: list[str] = []
        good: list[str] = []
        for c in live:
            p = procs.get(c.pid or -1)
            held = int(reports[c.role].get("reserved_mib") or 0)
            if p is None:
                bad.append(f"{c.role} (pid {c.pid}): not in NVML's process lists")
            elif p.used_mib <= 0:
                bad.append(f"{c.role} (pid {c.pid}): NVML attributes no memory")
            elif p.used_mib < held:
                bad.append(f"{c.role}: NVML {p.used_mib} MiB < torch reserved {held} MiB")
            elif p.mps_client is False:
                bad.append(f"{c.role} (pid {c.pid}): NVML says not an MPS client")
            else:
                flag = {True: "MPS client", None: "MPS client flag unknown"}[p.mps_client]
                good.append(f"{c.role}: {p.used_mib} MiB, {flag}")
        self.check("nvml_attribution", FAIL if bad else PASS, "; ".join(bad + good))

    def _tolerance(self, mib: int) -> float:
        return max(float(self.o.tolerance_mib), mib * self.o.tolerance_pct / 100)

    def _smi_match(self, live: list[KitClient], procs: dict[int, GpuProcess],
                   smi: list[dict[str, Any]] | None) -> None:
        if smi is None:
            self.check("nvidia_smi_match", NOT_RUN, "nvidia-smi not available or failed")
            return
        rows = {r["pid"]: r for r in smi}
        bad: list[str] = []
        good: list[str] = []
        for c in live:
            p, r = procs.get(c.pid or -1), rows.get(c.pid or -1)
            if r is None or r["used_mib"] is None:
                bad.append(f"{c.role} (pid {c.pid}): no figure from nvidia-smi")
            elif p is None:
                bad.append(f"{c.role}: nvidia-smi {r['used_mib']} MiB, NVML none")
            elif abs(p.used_mib - r["used_mib"]) > self._tolerance(r["used_mib"]):
                bad.append(f"{c.role}: NVML {p.used_mib} MiB vs nvidia-smi "
                           f"{r['used_mib']} MiB")
            else:
                good.append(f"{c.role}: {p.used_mib} ~ {r['used_mib']} MiB")
        self.check("nvidia_smi_match", FAIL if bad else PASS, "; ".join(bad + good))

    def _overheads(self, live: list[KitClient], procs: dict[int, GpuProcess],
                   reports: dict[str, dict[str, Any]], smi: list[dict[str, Any]] | None) -> None:
        assert self.gpu is not None
        ctx = {}
        for c in live:
            p = procs.get(c.pid or -1)
            if p is not None and p.used_mib > 0 and reports[c.role].get("ok"):
                ctx[c.role] = p.used_mib - int(reports[c.role].get("reserved_mib") or 0)
        self.m["context_mib"] = ctx
        conf = self.cfg.cuda_context_mib
        if ctx:
            worst = max(ctx.values())
            want = round_up(worst * 1.05)
            line = f"cuda_context_mib = {want}"
            self.suggest.append(line)
            self.check("overhead_context", FAIL if worst > conf else INFO,
                       f"{_fmt(ctx)} MiB (median {statistics.median(ctx.values()):.0f}); "
                       f"config {conf}: set {line}", measured=ctx, configured=conf)
        else:
            self.check("overhead_context", NOT_RUN, "no client memory figure from NVML")
        server_pids = {pid for d in self.seen_daemons.values() for pid, _ in d.servers}
        servers = {pid: p.used_mib for pid, p in procs.items() if pid in server_pids}
        for row in smi or []:
            if row["pid"] not in servers and "mps-server" in row["name"] \
                    and row["used_mib"] is not None:
                servers[row["pid"]] = row["used_mib"]
        self.m["mps_server_mib"] = servers
        conf = self.cfg.mps_server_mib
        if servers:
            worst = max(servers.values())
            line = f"mps_server_mib = {round_up(worst * 1.05, 16)}"
            self.suggest.append(line)
            self.check("overhead_mps_server", FAIL if worst > conf else INFO,
                       f"{_fmt(servers)} MiB; config {conf}: set {line}",
                       measured=servers, configured=conf)
        else:
            self.check("overhead_mps_server", NOT_RUN,
                       "no MPS server process with a memory figure (NVML, nvidia-smi)")
        reserved = self.gpu.reserved_mib
        idle = int(self.m.get("idle", {}).get("memory_used_mib") or 0)
        conf = self.cfg.gpu_reserved_mib
        detail = f"NVML v2 reserved {reserved} MiB; idle GPU 'used' {idle} MiB"
        if reserved == 0 and idle > 0 and conf == 0:
            line = f"gpu_reserved_mib = {round_up(idle, 16)}"
            self.suggest.append(line)
            detail += f"; NVML reports no reserved memory: set {line}"
        elif conf:
            detail += f"; config override {conf}"
        self.check("overhead_reserved", INFO, detail, reserved_mib=reserved, idle_used_mib=idle)

    def _oom(self) -> None:
        a = self.clients["a"]
        if not a.ok:
            for name in ("oom_at_limit", "budget_fits_shards", "survivor_same_user",
                         "survivor_other_user"):
                self.check(name, NOT_RUN, "client a did not start")
            return
        pinned = a.pinned or 0
        most = max(pinned, a.allocation) + 1024
        ans = self._ask(a, f"fill {self.o.fill_chunk_mib} {most}")
        self.m["oom"] = ans
        if not ans.get("ok"):
            self.check("oom_at_limit", FAIL, f"fill failed: {ans.get('error')}")
        elif not ans.get("oom"):
            self.check("oom_at_limit", FAIL,
                       f"allocated {ans.get('reached_mib')} MiB past the pinned limit of "
                       f"{pinned} MiB without an OOM: MPS does not enforce the limit")
        else:
            self._judge_oom(a, ans, pinned)
        procs = self._sample([a.pid] if a.pid else [])
        p = procs.get(a.pid or -1)
        self.m["nvml_at_limit"] = [dataclasses.asdict(q) for q in procs.values()]
        if not ans.get("oom"):
            self.check("budget_fits_shards", NOT_RUN, "the limit did not stop the client")
        elif p is None or p.used_mib <= 0:
            self.check("budget_fits_shards", FAIL, "NVML has no figure for client a")
        elif a.allocation and p.used_mib > a.allocation + self._tolerance(a.allocation):
            self.check("budget_fits_shards", FAIL,
                       f"client a at its limit: NVML {p.used_mib} MiB > {a.allocation} MiB "
                       f"of shards: raise cuda_context_mib")
        else:
            self.check("budget_fits_shards", PASS,
                       f"client a at its limit: NVML {p.used_mib} MiB within "
                       f"{a.allocation or '?'} MiB of shards")
        self._survivor("survivor_same_user", self.clients.get("a2"))
        b = self.clients.get("b")
        if b is None:
            self.check("survivor_other_user", NOT_RUN, "one user only")
        else:
            self._survivor("survivor_other_user", b)
        self._record()

    def _judge_oom(self, a: KitClient, ans: dict[str, Any], pinned: int) -> None:
        from slurm_colloc.oom.detector import scan_file

        assert self.workdir is not None
        text = str(ans.get("error") or "")
        log = self.workdir / "oom.log"
        log.write_text(text + "\n")
        scan = scan_file(log)
        reached = int(ans.get("reached_mib") or 0)
        self.m["oom_scan"] = scan.to_dict()
        where = f"stopped at {reached} MiB, pinned limit {pinned} MiB"
        if scan.cause != "gpu-oom":
            self.check("oom_at_limit", FAIL, f"{where}; the detector did not recognise "
                       f"{one_line(text, 160)!r}")
        elif reached > pinned + self.o.fill_chunk_mib:
            self.check("oom_at_limit", FAIL, f"{where}: the limit let it go further")
        else:
            self.check("oom_at_limit", PASS, f"{where}; {scan.pattern_id}")

    def _survivor(self, name: str, c: KitClient | None) -> None:
        if c is None or not c.ok:
            self.check(name, NOT_RUN, "client did not start")
            return
        ans = self._ask(c, "alloc 64")
        rep = self._ask(c, "report")
        if ans.get("ok") and rep.get("ok"):
            self.check(name, PASS, f"{c.role} ({c.user.name}) allocated 64 MiB more, "
                       f"holds {rep.get('reserved_mib')} MiB")
        else:
            self.check(name, FAIL, f"{c.role} ({c.user.name}): "
                       f"{ans.get('error') or rep.get('error')}")

    def _negative_control(self) -> None:
        """Slurm's global index under a daemon that sees one device (fact-finding)."""
        a = self.clients["a"]
        if self.slurm_index == 0:
            self.check("negative_control", NOT_RUN,
                       "GPU index 0: the global index is also the remapped one")
            return
        if not a.ok:
            self.check("negative_control", NOT_RUN, "client a did not start")
            return
        neg = KitClient("neg", a.user, a.job_id, a.shards, exports=dict(a.exports))
        self._launch(neg, self._client_env(neg, visible=str(self.slurm_index)))
        neg.exit = neg.handle.close(30) if neg.handle is not None else {}
        r = neg.ready
        self.m["negative_control"] = neg.record()
        if r.get("ok"):
            what = (f"unexpected: it saw {r.get('device_count')} device(s), device 0 "
                    f"{r.get('uuid')}")
        else:
            what = f"device_count={r.get('device_count')}, {one_line(str(r.get('error')), 160)}"
        self.check("negative_control", INFO,
                   f"CUDA_VISIBLE_DEVICES={self.slurm_index} under a one-device daemon: {what}")

    def _throughput(self) -> None:
        a, a2, b = self.clients["a"], self.clients.get("a2"), self.clients.get("b")
        for c in (a, a2, b):
            if c is not None and c.ok:
                self._ask(c, "free")
        out: dict[str, Any] = {}
        one_ok = a.ok and a2 is not None and a2.ok
        two_ok = a.ok and b is not None and b.ok
        for n in self.o.bench_sizes:
            row: dict[str, Any] = {}
            if a.ok:
                row["solo"] = self._bench([a], n)
            if one_ok and a2 is not None:
                row["one_user"] = self._bench([a, a2], n)
            if two_ok and b is not None:
                row["two_users"] = self._bench([a, b], n)
            out[str(n)] = row
        self.m["throughput"] = out
        self._throughput_verdict("throughput_one_user", "one_user", one_ok, out)
        self._throughput_verdict("throughput_two_users", "two_users", two_ok, out)

    def _bench(self, clients: list[KitClient], n: int) -> dict[str, Any]:
        secs = self.o.bench_seconds
        start_at = self.d.clock() + 5.0  # after every client's warm-up (cuBLAS set-up)
        answers = []
        for c in clients:
            if c.handle is not None:
                with contextlib.suppress(ClientGone):
                    c.handle.send(f"bench {secs} {n} {start_at:.3f}")
        for c in clients:
            try:
                assert c.handle is not None
                ans = c.handle.read(secs + self.o.command_timeout_s)
            except (ClientGone, AssertionError) as e:
                ans = {"ok": False, "error": str(e)}
            answers.append({"role": c.role, **ans})
        ok = all(x.get("ok") for x in answers)
        total = sum(float(x.get("iters_per_s") or 0) for x in answers) if ok else None
        overlap = None
        if ok and len(answers) > 1:
            lo = max(float(x["t0"]) for x in answers)
            hi = min(float(x["t1"]) for x in answers)
            span = max(float(x["t1"]) for x in answers) - min(float(x["t0"]) for x in answers)
            overlap = max(0.0, hi - lo) / span if span > 0 else 0.0
        return {"clients": answers, "ok": ok, "iters_per_s": total, "overlap": overlap}

    def _throughput_verdict(self, name: str, key: str, possible: bool,
                            out: dict[str, Any]) -> None:
        if not possible:
            self.check(name, NOT_RUN, "one user only" if key == "two_users"
                       else "clients did not start")
            return
        parts, failed = [], []
        for n, row in out.items():
            pair, solo = row.get(key) or {}, row.get("solo") or {}
            if not pair.get("ok") or not solo.get("ok"):
                failed.append(f"n={n}: " + "; ".join(
                    str(x.get("error")) for x in pair.get("clients", []) + solo.get("clients", [])
                    if not x.get("ok")))
                continue
            ratio = pair["iters_per_s"] / solo["iters_per_s"] if solo["iters_per_s"] else 0
            parts.append(f"n={n}: {ratio:.2f}x one client (overlap {pair['overlap']:.0%})")
            row[f"{key}_vs_solo"] = ratio
            other = row.get("one_user" if key == "two_users" else "two_users") or {}
            if key == "two_users" and other.get("ok") and other.get("iters_per_s"):
                row["two_users_vs_one_user"] = pair["iters_per_s"] / other["iters_per_s"]
                parts[-1] += f", {row['two_users_vs_one_user']:.2f}x one user's pair"
        self.check(name, FAIL if failed else INFO, "; ".join(failed + parts))

    def _record(self) -> None:
        self.m["clients"] = {r: c.record() for r, c in self.clients.items()}

    # --- 4. teardown -------------------------------------------------------------------
    def _teardown(self) -> None:
        for c in self.clients.values():
            if c.handle is not None and not c.exit:
                try:
                    c.exit = c.handle.close(30)
                except Exception as e:  # noqa: BLE001 - keep tearing down
                    c.exit = {"error": f"{type(e).__name__}: {e}"}
        if self.node is not None:
            with contextlib.suppress(Exception):
                self._snapshot_daemons()
            for step, name in ((self._release, "epilog_release"), (self._verify_gone, "teardown")):
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - users and files must still go
                    self.check(name, FAIL, f"{type(e).__name__}: {e}")
            with contextlib.suppress(Exception):
                self.m["mps_logs"] = self.node.logs()
            with contextlib.suppress(Exception):
                self.node.close()
        self._record()
        self._remove_created()
        if self.workdir is not None:
            with contextlib.suppress(Exception):
                self.d.cleanup_workdir(self.workdir)

    def _release(self) -> None:
        assert self.node is not None
        problems, released, stopped = [], [], []
        for c in self.clients.values():
            if c.decision is None:
                continue
            try:
                r = self.node.release(c.job_id)
            except Exception as e:  # noqa: BLE001 - release_first never raises; be sure
                problems.append(f"job {c.job_id}: {type(e).__name__}: {e}")
                continue
            released += r.released
            stopped += r.stopped_daemons
            problems += [f"job {c.job_id}: {e}" for e in r.errors]
            if not r.released:
                problems.append(f"job {c.job_id}: nothing registered to release")
        expected = set(self.seen_daemons)
        missing = sorted(expected - set(stopped))
        if missing:
            problems.append(f"daemons not stopped by the epilog: {missing}")
        self.m["epilog"] = {"released": released, "stopped": stopped, "problems": problems}
        if not any(c.decision is not None for c in self.clients.values()):
            self.check("epilog_release", NOT_RUN, "no job was registered")
        elif problems:
            self.check("epilog_release", FAIL, "; ".join(problems))
        else:
            self.check("epilog_release", PASS,
                       f"{len(released)} registrations released, daemons stopped: {stopped}")

    def _verify_gone(self) -> None:
        assert self.node is not None
        root = self.node.mps_root.rstrip("/") + "/"
        ours = {d.pid: d.start_ticks for d in self.seen_daemons.values() if d.pid}
        ours.update({pid: t for d in self.seen_daemons.values() for pid, t in d.servers})
        left = [p for p in self.d.procs.mps_processes()
                if (p.pipe_dir or "").startswith(root)
                or (p.pid in ours and ours[p.pid] in (None, p.start_ticks))]
        left += [MpsProc(pid, "recorded", None, None, t) for pid, t in ours.items()
                 if self.d.procs.alive(pid, t) and pid not in {p.pid for p in left}]
        self.m["left_behind"] = [dataclasses.asdict(p) for p in left]
        if left:
            self.check("teardown", FAIL, "still running: " + ", ".join(
                f"{p.name} pid {p.pid}" for p in left))
            errors = self.node.stop_all()
            self.m["fallback_stop_errors"] = errors
        else:
            self.check("teardown", PASS,
                       f"no MPS process of the kit left ({len(ours)} seen during the run)")

    def _remove_created(self) -> None:
        if not self.created:
            return
        failed = []
        for name in self.created:
            try:
                self.d.users.remove(name)
            except Exception as e:  # noqa: BLE001 - say which, keep going
                failed.append(f"{name}: {e}")
        removed = [n for n in self.created if not any(f.startswith(n + ":") for f in failed)]
        self.created = []
        if failed:
            self.check("users_cleanup", FAIL, "; ".join(failed))
        else:
            self.check("users_cleanup", PASS, f"removed {', '.join(removed)}")


# --- helpers ---------------------------------------------------------------------------


def _call(obj: Any, name: str) -> Any:
    """An optional backend capability (newer NVML backends have more); None if absent."""
    fn = getattr(obj, name, None)
    if fn is None:
        return None
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a fact we could not read is a fact "unknown"
        return None


def _fmt(d: dict[Any, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in d.items())


def _options(o: KitOptions) -> dict[str, Any]:
    d = dataclasses.asdict(o)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


_CONFIG_KEYS = ("shard_mib", "cuda_context_mib", "mps_server_mib", "mps_servers_per_gpu",
                "gpu_reserved_mib", "active_thread_percentage", "gpu_hard_limit", "mps_control",
                "mps_root", "gpu_backend")


def _config_subset(cfg: CollocConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in _CONFIG_KEYS}


def kit_config(site: CollocConfig, workdir: Path, mps_binary: str,
               shard_mib: int | None) -> CollocConfig:
    """The site's configuration with every path moved into the kit's own directory.

    The kit's daemons, markers and job files must never mix with a production
    node's: its jobs would be reaped by a real prolog, and its teardown must not
    touch real jobs' daemons. The MPS binary is the resolved path (identity checks
    compare real paths).
    """
    return dataclasses.replace(
        site,
        gpu_backend="nvml",
        mps_control=mps_binary,
        mps_root=str(workdir / "mps"),
        metrics_dir=str(workdir / "metrics"),
        evidence_dir=str(workdir / "evidence"),
        history_db=str(workdir / "history.sqlite"),
        log_file=str(workdir / "colloc.log"),
        shard_mib=shard_mib or site.shard_mib,
    )


def run_kit(opts: KitOptions, deps: KitDeps, site: CollocConfig) -> KitResult:
    """Run the kit; the result carries the exit status (0 pass, 1 fail, 2 refusal)."""
    return GpuKit(opts, deps, site).run()
