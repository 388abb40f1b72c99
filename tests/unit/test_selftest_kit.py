"""``colloc selftest --gpu`` against a fake node that behaves as NVIDIA documents.

The fake world stands for the driver, MPS and PyTorch:

* NVML (fake :class:`GpuBackend`): a client's process appears with its memory
  (context + what its caching allocator reserved), flagged as an MPS client; each MPS
  server appears as a process of its own, not a client.
* MPS (fake node scripts): one control daemon per (GPU, user) from the prolog, one
  server per user started by its first client; a client's limit is its
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``. The daemon sees one device (its UUID), which
  its clients see as device 0: a client that keeps Slurm's global index N > 0 sees
  no device (NVIDIA MPS docs, CUDA_VISIBLE_DEVICES under MPS).
* PyTorch (fake client): allocations past the limit fail with
  ``torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ...`` and the
  process lives on; other clients are not affected.

Knobs on :class:`World` break one behaviour at a time for the failure tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import (
    GpuBackend,
    GpuBackendError,
    GpuInfo,
    GpuProcess,
    GpuSample,
    HardLimitSupport,
)
from slurm_colloc.gpu.sim import tools as sim_tools
from slurm_colloc.node.epilog import EpilogResult
from slurm_colloc.node.job import JobContext
from slurm_colloc.node.prolog import PrologDecision
from slurm_colloc.selftest import gpu_kit, report
from slurm_colloc.selftest.gpu_kit import (
    FAIL,
    INFO,
    NOT_RUN,
    PASS,
    ClientGone,
    CmdResult,
    DaemonSeen,
    KitDeps,
    KitOptions,
    MpsProc,
    User,
)

MIB = 1 << 20
UUIDS = ("GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-aaaaaaaaaaaa")
CONTEXT_MIB = 500
SERVER_MIB = 30
ALICE = User("alice", 1001, 1001, "/home/alice")
BOB = User("bob", 1002, 1002, "/home/bob")


@dataclass
class World:
    """Shared state of the fake driver, MPS and PyTorch (and the knobs)."""

    gpus: list[GpuInfo] = field(default_factory=lambda: [
        GpuInfo(0, UUIDS[0], "NVIDIA H100 80GB HBM3", 81559, 0, "00000000:19:00.0", 535),
        GpuInfo(1, UUIDS[1], "NVIDIA H100 80GB HBM3", 81559, 1, "00000000:3b:00.0", 535),
    ])
    used: dict[int, tuple[int, int, bool]] = field(default_factory=dict)
    """pid -> (NVML GPU index, MiB, MPS client)."""
    servers: dict[int, int] = field(default_factory=dict)
    """uid -> server pid."""
    daemons: dict[int, int] = field(default_factory=dict)
    """uid -> control daemon pid."""
    next_pid: int = 4000
    compute_mode: str = "DEFAULT"
    # knobs
    nvml_sees_clients: bool = True
    smi_offset_mib: int = 0
    enforce_limit: bool = True
    epilog_stops_daemons: bool = True
    leftover: list[MpsProc] = field(default_factory=list)
    busy_before: bool = False
    export_uuid: bool = True

    def pid(self) -> int:
        self.next_pid += 1
        return self.next_pid


class FakeBackend(GpuBackend):
    name = "fake"

    def __init__(self, world: World) -> None:
        self.w = world

    def gpus(self) -> list[GpuInfo]:
        return list(self.w.gpus)

    def sample(self, index: int) -> GpuSample:
        procs = tuple(
            GpuProcess(pid, mib, client) for pid, (g, mib, client) in self.w.used.items()
            if g == index and (self.w.nvml_sees_clients or not client)
        )
        if self.w.busy_before:
            procs += (GpuProcess(999, 1000, False),)
        return GpuSample(index, 0.0, 535 + sum(p.used_mib for p in procs), 0.0, 70.0, 1.0,
                         processes=procs)

    def compute_modes(self) -> dict[int, str]:
        return {g.index: self.w.compute_mode for g in self.w.gpus}

    def driver_version(self) -> str:
        return "590.48.01"

    def cuda_driver_version(self) -> int:
        return 13000

    def hard_memory_limit_supported(self, index: int) -> HardLimitSupport:
        return HardLimitSupport(False, "driver older than r615")


class FakeClient:
    """torch_client's answers as PyTorch under MPS would give them."""

    def __init__(self, world: World, node: FakeNode, user: User, env: dict[str, str]) -> None:
        self.w, self.node, self.user, self.env = world, node, user, env
        self.pid = world.pid()
        self.held = 0
        self.reserved = 2
        self.out: list[dict[str, Any]] = []
        self.closed = False
        self.limit = gpu_kit.pinned_mib(env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"))
        self.gpu = node.gpu_of_pipe(env.get("CUDA_MPS_PIPE_DIRECTORY", ""))
        self.out.append(self._ready())

    def _ready(self) -> dict[str, Any]:
        visible = self.env.get("CUDA_VISIBLE_DEVICES", "")
        assert self.gpu is not None, "client without an MPS daemon"
        daemon_uuid = self.w.gpus[self.gpu].uuid
        sees = (visible == "0") or (visible.lower() == daemon_uuid.lower())
        if not sees:
            return {"event": "ready", "ok": False, "pid": self.pid, "uid": self.user.uid,
                    "device_count": 0, "visible": visible,
                    "error": "RuntimeError: No CUDA GPUs are available"}
        if self.user.uid not in self.w.servers:
            self.w.servers[self.user.uid] = self.w.pid()
            self.w.used[self.w.servers[self.user.uid]] = (self.gpu, SERVER_MIB, False)
        self._account()
        return {"event": "ready", "ok": True, "pid": self.pid, "uid": self.user.uid,
                "device_count": 1, "uuid": daemon_uuid[4:], "name": "NVIDIA H100 80GB HBM3",
                "visible": visible, "held_mib": 0, "reserved_mib": self.reserved}

    def _account(self) -> None:
        assert self.gpu is not None
        self.w.used[self.pid] = (self.gpu, CONTEXT_MIB + self.reserved, True)

    def _oom(self, mib: int) -> str:
        return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {mib / 1024:.2f}"
                " GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.00 GiB is free.")

    def _alloc(self, mib: int) -> bool:
        if self.w.enforce_limit and self.limit is not None and self.reserved + mib > self.limit:
            return False
        self.held += mib
        self.reserved += mib
        self._account()
        return True

    def _figures(self) -> dict[str, Any]:
        return {"held_mib": self.held, "allocated_mib": self.held, "reserved_mib": self.reserved}

    def send(self, line: str) -> None:
        if self.closed:
            raise ClientGone("closed")
        words = line.split()
        cmd = words[0]
        if cmd == "alloc":
            mib = int(words[1])
            ok = self._alloc(mib)
            self.out.append({"event": "alloc", "ok": ok, "oom": not ok,
                             **({} if ok else {"error": self._oom(mib)}), **self._figures()})
        elif cmd == "fill":
            chunk, most = int(words[1]), int(words[2])
            oom = False
            while self.held + chunk <= most:
                if not self._alloc(chunk):
                    oom = True
                    break
            self.out.append({"event": "fill", "ok": True, "oom": oom, "reached_mib": self.held,
                             **({"error": self._oom(chunk)} if oom else {}),
                             **self._figures()})
        elif cmd == "free":
            self.held, self.reserved = 0, 2
            self._account()
            self.out.append({"event": "free", "ok": True, **self._figures()})
        elif cmd in ("report", "hold"):
            self.out.append({"event": cmd, "ok": True, **self._figures()})
        elif cmd == "bench":
            secs, start = float(words[1]), float(words[3])
            self.node.benches.setdefault(start, []).append(self)
            self.out.append({"event": "bench", "pending": (secs, int(words[2]), start)})
        elif cmd == "exit":
            self.out.append({"event": "exit", "ok": True})

    def read(self, timeout: float) -> dict[str, Any]:
        if not self.out:
            raise ClientGone(f"client {self.pid}: no answer in {timeout:.0f}s")
        ans = self.out.pop(0)
        if "pending" in ans:  # the matmuls ran alongside whoever started at the same time
            secs, n, start = ans["pending"]
            rate = self.node.bench_rate(self.node.benches[start])
            ans = {"event": "bench", "ok": True, "n": n, "iters": int(rate * secs), "t0": start,
                   "t1": start + secs, "seconds": secs, "iters_per_s": rate, "tflops": 1.0}
        return ans

    def close(self, timeout: float) -> dict[str, Any]:
        self.closed = True
        self.w.used.pop(self.pid, None)
        self.node.clients.discard(self)
        return {"returncode": 0, "killed": False, "stderr_tail": ""}


class FakeRunner:
    def __init__(self, world: World, probe: dict[str, Any] | None = None) -> None:
        self.w = world
        self.node: FakeNode | None = None
        self.probe_answer = probe or {"event": "probe", "ok": True, "torch": "2.9.1",
                                      "cuda": "12.8", "cuda_available": True, "device_count": 2}
        self.started: list[FakeClient] = []

    def probe(self, python: str, script: str) -> dict[str, Any]:
        return dict(self.probe_answer)

    def start(self, name: str, python: str, script: str, user: User, env: dict[str, str],
              cwd: str) -> FakeClient:
        assert self.node is not None
        assert Path(script).read_bytes() == gpu_kit.CLIENT_SCRIPT.read_bytes()
        c = FakeClient(self.w, self.node, user, env)
        self.node.clients.add(c)
        self.started.append(c)
        return c


class FakeNode:
    """The prolog/TaskProlog/epilog contract, on the world's MPS."""

    def __init__(self, world: World, cfg: CollocConfig) -> None:
        self.w, self.cfg = world, cfg
        self.mps_root = cfg.mps_root
        self.jobs: dict[int, tuple[int, int, int]] = {}
        """job -> (Slurm GPU index, uid, shards)."""
        self.clients: set[FakeClient] = set()
        self.benches: dict[float, list[FakeClient]] = {}
        self.closed = False

    def gpu_of_pipe(self, pipe: str) -> int | None:
        for gpu, uid, _ in self.jobs.values():
            if pipe == f"{self.mps_root}/gpu{gpu}/uid{uid}/pipe":
                return gpu  # Slurm index == NVML index on this fake node
        return None

    def prolog(self, ctx: JobContext) -> PrologDecision:
        gpu = ctx.gpus[0]
        self.jobs[ctx.job_id] = (gpu, ctx.uid, ctx.shards)
        if ctx.uid not in self.w.daemons:
            self.w.daemons[ctx.uid] = self.w.pid()
        return PrologDecision("shared", gpu, ctx.shards * self.cfg.shard_mib,
                              f"{self.mps_root}/gpu{gpu}/uid{ctx.uid}/pipe",
                              detail=f"{ctx.shards} shards on GPU {gpu}")

    def exports(self, job_id: int) -> list[str]:
        gpu, uid, shards = self.jobs[job_id]
        alloc = shards * self.cfg.shard_mib
        pinned = alloc - self.cfg.cuda_context_mib
        lines = [f"export CUDA_MPS_PIPE_DIRECTORY={self.mps_root}/gpu{gpu}/uid{uid}/pipe",
                 f"export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={pinned}M",
                 f"export COLLOC_LIMIT_MIB={alloc}", f"export COLLOC_PINNED_MIB={pinned}"]
        if self.w.export_uuid:
            lines.append(f"export CUDA_VISIBLE_DEVICES={self.w.gpus[gpu].uuid}")
        return lines

    def release(self, job_id: int) -> EpilogResult:
        r = EpilogResult(job_id)
        gpu, uid, _ = self.jobs.pop(job_id)
        r.released.append((gpu, uid))
        if self.w.epilog_stops_daemons and not any(u == uid for _, u, _ in self.jobs.values()):
            self.w.daemons.pop(uid, None)
            server = self.w.servers.pop(uid, None)
            self.w.used.pop(server or -1, None)
            r.stopped_daemons.append((gpu, uid))
        return r

    def daemons(self) -> list[DaemonSeen]:
        gpus = {uid: g for g, uid, _ in self.jobs.values()}
        return [DaemonSeen(gpus.get(uid, 1), uid, pid, 77,
                           ((self.w.servers[uid], 88),) if uid in self.w.servers else ())
                for uid, pid in self.w.daemons.items()]

    def bench_rate(self, together: list[FakeClient]) -> float:
        """One client alone 100/s; one server's clients overlap (60/s each); two users'
        servers time-slice the GPU (50/s each)."""
        if len(together) == 1:
            return 100.0
        return 60.0 if len({c.user.uid for c in together}) == 1 else 50.0

    def stop_all(self) -> list[str]:
        self.w.daemons.clear()
        return []

    def logs(self) -> dict[str, str]:
        return {"gpu1/uid1001/control.log": "[2026-01-01] Server 4002 started"}

    def close(self) -> None:
        self.closed = True


class FakeProcs:
    def __init__(self, world: World) -> None:
        self.w = world

    def mps_processes(self) -> list[MpsProc]:
        return [MpsProc(pid, "nvidia-cuda-mps-control", 0, f"/run/x/gpu1/uid{uid}/pipe", 77)
                for uid, pid in self.w.daemons.items()] + list(self.w.leftover)

    def alive(self, pid: int, start_ticks: int | None) -> bool:
        return pid in self.w.daemons.values() or pid in self.w.servers.values()


class FakeCommands:
    def __init__(self, world: World, present: Sequence[str] = ("nvidia-cuda-mps-control",
                                                                "nvidia-smi")) -> None:
        self.w = world
        self.present = set(present)
        self.calls: list[list[str]] = []

    def which(self, name: str) -> str | None:
        return f"/usr/bin/{name}" if name in self.present else None

    def run(self, argv: Sequence[str], timeout: float) -> CmdResult:
        self.calls.append(list(argv))
        if argv[0].endswith("nvidia-smi"):
            assert argv[1] == "--query-compute-apps=gpu_uuid,pid,used_memory,process_name"
            lines = []
            for pid, (g, mib, client) in self.w.used.items():
                name = "/usr/bin/python3" if client else "nvidia-cuda-mps-server"
                lines.append(f"{self.w.gpus[g].uuid}, {pid}, {mib + self.w.smi_offset_mib}, {name}")
            return CmdResult(0, "\n".join(lines) + "\n")
        return CmdResult(127, "", "not found")


class FakeUsers:
    def __init__(self, existing: Sequence[User] = (ALICE, BOB)) -> None:
        self.db = {u.name: u for u in existing}
        self.created: list[str] = []
        self.removed: list[str] = []

    def lookup(self, name: str) -> User | None:
        return self.db.get(name)

    def create(self, name: str) -> User:
        u = User(name, 990 + len(self.db), 990 + len(self.db), "/nonexistent")
        self.db[name] = u
        self.created.append(name)
        return u

    def remove(self, name: str) -> None:
        self.db.pop(name)
        self.removed.append(name)


@dataclass
class Rig:
    world: World
    deps: KitDeps
    runner: FakeRunner
    commands: FakeCommands
    users: FakeUsers
    nodes: list[FakeNode]
    workdirs: list[Path]
    removed_workdirs: list[Path]


def rig(tmp_path: Path, *, world: World | None = None, root: bool = True,
        backend_error: str | None = None, probe: dict[str, Any] | None = None,
        present: Sequence[str] = ("nvidia-cuda-mps-control", "nvidia-smi")) -> Rig:
    w = world or World()
    runner = FakeRunner(w, probe)
    commands = FakeCommands(w, present)
    users = FakeUsers()
    nodes: list[FakeNode] = []
    workdirs: list[Path] = []
    removed: list[Path] = []

    def backend() -> GpuBackend:
        if backend_error is not None:
            raise GpuBackendError(backend_error)
        return FakeBackend(w)

    def node(cfg: CollocConfig) -> FakeNode:
        n = FakeNode(w, cfg)
        runner.node = n
        nodes.append(n)
        return n

    def workdir() -> Path:
        d = tmp_path / f"work{len(workdirs)}"
        d.mkdir()
        workdirs.append(d)
        return d

    deps = KitDeps(
        backend_factory=backend, commands=commands, clients=runner, users=users,
        node_factory=node, procs=FakeProcs(w), workdir_factory=workdir,
        cleanup_workdir=removed.append, is_root=lambda: root, cgroup_v2=lambda: True,
        hostname=lambda: "gpu-node-7", mps_detect=lambda binary: _Cap("v2"),
        python_trust=lambda python: None,  # test_selftest_safety.py checks the real one
        clock=Tick(), sleep=lambda s: None,
    )
    return Rig(w, deps, runner, commands, users, nodes, workdirs, removed)


class Tick:
    """A clock that moves one second per reading (each benchmark starts at its own time)."""

    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@dataclass(frozen=True)
class _Cap:
    protocol: str


SITE = CollocConfig(shard_mib=1024, cuda_context_mib=512, mps_server_mib=64)
TWO = KitOptions(users=("alice", "bob"), bench_sizes=(2048,), bench_seconds=2.0)
ONE = KitOptions(bench_sizes=(2048,), bench_seconds=2.0)


def checks(res: gpu_kit.KitResult) -> dict[str, gpu_kit.Check]:
    return {c.name: c for c in res.checks}


def verdicts(res: gpu_kit.KitResult) -> dict[str, str]:
    return {c.name: c.result for c in res.checks}


# --- refusals -------------------------------------------------------------------------


REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    ("no NVML", {"backend_error": "gpu_backend = nvml but the nvidia-ml-py package (module "
                                  "pynvml) is not installed: pip install nvidia-ml-py"},
     "nvidia-ml-py"),
    ("driver not loaded", {"backend_error": "NVML initialisation failed (Driver Not Loaded): "
                           "the NVIDIA kernel driver is not loaded (nvidia-smi\nshould fail the "
                           "same way): load it or fix the node. colloc never falls back to "
                           "simulated GPUs; gpu_backend = \"sim\" is for the devcluster."},
     "driver is not loaded"),
    ("no GPU", {"world": World(gpus=[])}, "sees no GPU"),
    ("not root", {"root": False}, "must run as root"),
    ("torch missing", {"probe": {"ok": False, "torch": None,
                                 "error": "ModuleNotFoundError: No module named 'torch'"}},
     "pip install torch"),
    ("torch without CUDA", {"probe": {"ok": True, "torch": "2.9.1+cpu", "cuda": None,
                                      "cuda_available": False,
                                      "error": "torch.cuda.is_available() is False"}},
     "cannot use the GPU"),
    ("no MPS binary", {"present": ("nvidia-smi",)}, "nvidia-cuda-mps-control"),
    ("GPU busy", {"world": World(busy_before=True)}, "in use by pid(s) 999"),
]


@pytest.mark.parametrize(("case", "kw", "needle"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_each_refusal_is_exit_2_with_one_line(
    tmp_path: Path, case: str, kw: dict[str, Any], needle: str
) -> None:
    r = rig(tmp_path, **kw)
    res = gpu_kit.run_kit(TWO, r.deps, SITE)
    assert res.exit_code == 2
    assert res.refusal is not None and needle in res.refusal
    assert "\n" not in res.refusal and len(res.refusal) <= 400
    assert "colloc never falls back" not in res.refusal
    assert r.nodes == [] and r.runner.started == []  # nothing was started
    assert r.workdirs == []


def test_refusal_order_hardware_before_root_before_torch_before_mps(tmp_path: Path) -> None:
    """Each refusal wins over every later one: the first thing missing is named."""
    no_torch = {"ok": False, "torch": None, "error": "No module named 'torch'"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"backend_error": "NVML Shared Library Not Found", "world": World(gpus=[]),
          "root": False, "probe": no_torch, "present": ()}, "no usable NVML"),
        ({"world": World(gpus=[]), "root": False, "probe": no_torch, "present": ()},
         "sees no GPU"),
        ({"root": False, "probe": no_torch, "present": ()}, "must run as root"),
        ({"probe": no_torch, "present": ()}, "PyTorch is not importable"),
        ({"present": ()}, "MPS control program"),
    ]
    for i, (kw, needle) in enumerate(cases):
        res = gpu_kit.run_kit(TWO, rig(tmp_path / str(i), **kw).deps, SITE)
        assert res.exit_code == 2 and res.refusal is not None, needle
        assert needle in res.refusal, (needle, res.refusal)


def test_unknown_gpu_index_and_unknown_user_are_refused(tmp_path: Path) -> None:
    res = gpu_kit.run_kit(KitOptions(gpu_index=5), rig(tmp_path / "a").deps, SITE)
    assert res.exit_code == 2 and res.refusal == "--gpu-index 5: this node has Slurm GPU " \
        "indices 0-1"
    res = gpu_kit.run_kit(KitOptions(users=("alice", "mallory")), rig(tmp_path / "b").deps, SITE)
    assert res.exit_code == 2 and res.refusal is not None and "'mallory'" in res.refusal


def test_partly_known_minor_numbers_are_refused_not_guessed(tmp_path: Path) -> None:
    w = World()
    w.gpus[0] = GpuInfo(0, UUIDS[0], "H100", 81559, None, "", 0)
    res = gpu_kit.run_kit(TWO, rig(tmp_path, world=w).deps, SITE)
    assert res.exit_code == 2 and res.refusal is not None
    assert "Slurm's GPU order" in res.refusal


# --- the whole run --------------------------------------------------------------------


def test_all_pass_with_two_users(tmp_path: Path) -> None:
    r = rig(tmp_path)
    res = gpu_kit.run_kit(TWO, r.deps, SITE)
    v = verdicts(res)
    assert [c.name for c in res.checks] == list(gpu_kit.CATALOGUE)
    assert FAIL not in v.values(), {k: checks(res)[k].detail for k in v if v[k] == FAIL}
    assert res.exit_code == 0 and res.refusal is None
    for name in ("prolog", "task_prolog", "visibility", "mps_two_users", "alloc_within_limit",
                 "nvml_attribution", "nvidia_smi_match", "oom_at_limit", "budget_fits_shards",
                 "survivor_same_user", "survivor_other_user", "epilog_release", "teardown",
                 "compute_mode", "gpu_idle"):
        assert v[name] == PASS, (name, checks(res)[name].detail)
    for name in ("driver", "gpu", "mps_protocol", "negative_control", "overhead_context",
                 "overhead_mps_server", "overhead_reserved", "throughput_one_user",
                 "throughput_two_users"):
        assert v[name] == INFO, (name, checks(res)[name].detail)
    assert v["users_cleanup"] == NOT_RUN  # nothing was created
    # default GPU: the last one, so the negative control is meaningful
    assert res.environment["gpu"]["slurm_index"] == 1
    assert "device_count=0" in checks(res)["negative_control"].detail
    assert "No CUDA GPUs are available" in checks(res)["negative_control"].detail
    # everything went down through the epilog, and the kit's directory went away
    assert r.world.daemons == {} and r.world.servers == {} and r.world.used == {}
    assert r.removed_workdirs == r.workdirs and r.nodes[0].closed


def test_clients_run_as_their_users_with_the_task_prologs_exports(tmp_path: Path) -> None:
    r = rig(tmp_path)
    gpu_kit.run_kit(TWO, r.deps, SITE)
    main = [c for c in r.runner.started if c.env.get("CUDA_VISIBLE_DEVICES", "").startswith("GPU")]
    assert {c.user.name for c in main} == {"alice", "bob"} and len(main) == 3
    for c in main:
        env = c.env
        assert env["CUDA_VISIBLE_DEVICES"] == UUIDS[1]  # the export overrides Slurm's "1"
        assert env["SLURM_JOB_GPUS"] == "1"
        assert env["CUDA_MPS_PIPE_DIRECTORY"].endswith(f"/gpu1/uid{c.user.uid}/pipe")
        assert "LD_PRELOAD" not in env and "PYTHONPATH" not in env
    neg = [c for c in r.runner.started if c not in main]
    assert len(neg) == 1 and neg[0].env["CUDA_VISIBLE_DEVICES"] == "1"


def test_measured_overheads_become_config_lines(tmp_path: Path) -> None:
    r = rig(tmp_path)
    res = gpu_kit.run_kit(TWO, r.deps, SITE)
    ctx = res.measurements["context_mib"]
    assert set(ctx.values()) == {CONTEXT_MIB}  # NVML per-process minus torch reserved
    assert set(res.measurements["mps_server_mib"].values()) == {SERVER_MIB}
    assert res.suggested_config[:2] == ["cuda_context_mib = 544", "mps_server_mib = 32"]
    # the site's config is larger than measured: informational, not a failure
    assert checks(res)["overhead_context"].result == INFO


def test_context_larger_than_configured_fails_and_says_what_to_set(tmp_path: Path) -> None:
    site = CollocConfig(shard_mib=1024, cuda_context_mib=256)
    res = gpu_kit.run_kit(TWO, rig(tmp_path).deps, site)
    c = checks(res)["overhead_context"]
    assert c.result == FAIL and "cuda_context_mib = 544" in c.detail
    assert res.exit_code == 1


def test_throughput_ratios_for_the_simulation(tmp_path: Path) -> None:
    res = gpu_kit.run_kit(TWO, rig(tmp_path).deps, SITE)
    row = res.measurements["throughput"]["2048"]
    assert row["solo"]["iters_per_s"] == 100.0
    assert row["one_user"]["iters_per_s"] == 120.0 and row["two_users"]["iters_per_s"] == 100.0
    assert row["one_user_vs_solo"] == pytest.approx(1.2)
    assert row["two_users_vs_one_user"] == pytest.approx(100 / 120)
    assert row["two_users"]["overlap"] == pytest.approx(1.0)
    assert "1.00x one client" in checks(res)["throughput_two_users"].detail


# --- OOM and isolation ----------------------------------------------------------------


def test_oom_in_client_a_leaves_the_others_allocating(tmp_path: Path) -> None:
    r = rig(tmp_path)
    res = gpu_kit.run_kit(TWO, r.deps, SITE)
    c = checks(res)
    assert c["oom_at_limit"].result == PASS
    assert "torch-cuda-oom" in c["oom_at_limit"].detail  # our detector's pattern id
    assert "pinned limit 1536 MiB" in c["oom_at_limit"].detail
    assert res.measurements["oom"]["oom"] is True
    assert c["survivor_same_user"].result == PASS and "a2 (alice)" in c["survivor_same_user"].detail
    assert c["survivor_other_user"].result == PASS and "b (bob)" in c["survivor_other_user"].detail
    assert res.measurements["oom_scan"]["cause"] == "gpu-oom"


def test_an_unenforced_limit_fails(tmp_path: Path) -> None:
    res = gpu_kit.run_kit(TWO, rig(tmp_path, world=World(enforce_limit=False)).deps, SITE)
    c = checks(res)
    assert c["oom_at_limit"].result == FAIL and "does not enforce" in c["oom_at_limit"].detail
    assert c["budget_fits_shards"].result == NOT_RUN
    assert res.exit_code == 1


def test_oom_text_the_detector_does_not_know_fails(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(FakeClient, "_oom", lambda self, mib: "RuntimeError: something odd")
    res = gpu_kit.run_kit(TWO, rig(tmp_path).deps, SITE)
    assert checks(res)["oom_at_limit"].result == FAIL
    assert "did not recognise" in checks(res)["oom_at_limit"].detail


# --- attribution and nvidia-smi -------------------------------------------------------


def test_clients_missing_from_nvml_fail_attribution(tmp_path: Path) -> None:
    res = gpu_kit.run_kit(TWO, rig(tmp_path, world=World(nvml_sees_clients=False)).deps, SITE)
    c = checks(res)
    assert c["nvml_attribution"].result == FAIL
    assert "not in NVML's process lists" in c["nvml_attribution"].detail
    assert c["overhead_context"].result == NOT_RUN
    assert res.exit_code == 1


def test_nvidia_smi_disagreeing_beyond_tolerance_fails(tmp_path: Path) -> None:
    res = gpu_kit.run_kit(TWO, rig(tmp_path, world=World(smi_offset_mib=200)).deps, SITE)
    c = checks(res)["nvidia_smi_match"]
    assert c.result == FAIL and "vs nvidia-smi" in c.detail
    assert res.exit_code == 1


def test_nvidia_smi_within_tolerance_passes(tmp_path: Path) -> None:
    res = gpu_kit.run_kit(TWO, rig(tmp_path, world=World(smi_offset_mib=10)).deps, SITE)
    assert checks(res)["nvidia_smi_match"].result == PASS


def test_without_nvidia_smi_the_cross_check_is_not_run(tmp_path: Path) -> None:
    r = rig(tmp_path, present=("nvidia-cuda-mps-control",))
    res = gpu_kit.run_kit(TWO, r.deps, SITE)
    assert verdicts(res)["nvidia_smi_match"] == NOT_RUN
    assert res.exit_code == 0


# --- users ----------------------------------------------------------------------------


def test_two_user_checks_are_not_run_without_users(tmp_path: Path) -> None:
    r = rig(tmp_path)
    res = gpu_kit.run_kit(ONE, r.deps, SITE)
    v = verdicts(res)
    for name in ("mps_two_users", "survivor_other_user", "throughput_two_users"):
        assert v[name] == NOT_RUN, name
    for name in ("visibility", "oom_at_limit", "survivor_same_user", "teardown"):
        assert v[name] == PASS, name
    assert v["throughput_one_user"] == INFO
    assert res.exit_code == 0
    assert {c.user.name for c in r.runner.started} == {"root"}
    assert "two-user checks not run" in checks(res)["users"].detail


def test_created_users_are_removed_afterwards(tmp_path: Path) -> None:
    r = rig(tmp_path)
    res = gpu_kit.run_kit(KitOptions(create_users=True, bench_sizes=(2048,)), r.deps, SITE)
    assert r.users.created == ["colloc-kit1", "colloc-kit2"]
    assert r.users.removed == ["colloc-kit1", "colloc-kit2"]
    assert checks(res)["users_cleanup"].result == PASS
    assert checks(res)["mps_two_users"].result == PASS
    assert res.environment["users_created"] == ["colloc-kit1", "colloc-kit2"]


def test_existing_kit_users_are_used_and_kept(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.users.db["colloc-kit1"] = User("colloc-kit1", 901, 901)
    gpu_kit.run_kit(KitOptions(create_users=True, bench_sizes=(2048,)), r.deps, SITE)
    assert r.users.created == ["colloc-kit2"] and r.users.removed == ["colloc-kit2"]


def test_users_created_before_a_refusal_are_removed(tmp_path: Path) -> None:
    r = rig(tmp_path)

    def boom(name: str) -> User:
        if name == "colloc-kit2":
            raise RuntimeError("useradd: cannot lock /etc/passwd")
        return FakeUsers.create(r.users, name)

    r.users.create = boom  # type: ignore[method-assign]
    res = gpu_kit.run_kit(KitOptions(create_users=True), r.deps, SITE)
    assert res.exit_code == 2 and res.refusal is not None and "cannot lock" in res.refusal
    assert r.users.removed == ["colloc-kit1"]


# --- visibility, the negative control, GPU 0 -------------------------------------------


def test_a_prolog_that_exports_no_uuid_fails_visibility_on_a_nonzero_gpu(tmp_path: Path) -> None:
    res = gpu_kit.run_kit(TWO, rig(tmp_path, world=World(export_uuid=False)).deps, SITE)
    c = checks(res)
    assert c["task_prolog"].result == PASS and "no CUDA_VISIBLE_DEVICES" in c["task_prolog"].detail
    assert c["visibility"].result == FAIL and "No CUDA GPUs" in c["visibility"].detail
    assert res.exit_code == 1
    assert c["teardown"].result == PASS  # torn down all the same


def test_on_gpu_zero_the_negative_control_is_not_run(tmp_path: Path) -> None:
    opts = KitOptions(gpu_index=0, users=("alice", "bob"), bench_sizes=(2048,))
    res = gpu_kit.run_kit(opts, rig(tmp_path).deps, SITE)
    assert verdicts(res)["negative_control"] == NOT_RUN
    assert res.exit_code == 0


def test_compute_mode_other_than_default_fails(tmp_path: Path) -> None:
    res = gpu_kit.run_kit(TWO, rig(tmp_path, world=World(compute_mode="EXCLUSIVE_PROCESS")).deps,
                          SITE)
    c = checks(res)["compute_mode"]
    assert c.result == FAIL and "-c DEFAULT" in c.detail


def test_mps_protocol_unknown_without_the_v3_module(tmp_path: Path) -> None:
    r = rig(tmp_path)

    def absent(binary: str) -> Any:
        raise ImportError("No module named 'slurm_colloc.mps.v3'")

    r.deps.mps_detect = absent
    res = gpu_kit.run_kit(TWO, r.deps, SITE)
    assert checks(res)["mps_protocol"].detail.startswith("unknown")
    assert res.environment["mps"]["protocol"] == "unknown"
    assert res.exit_code == 0


# --- teardown --------------------------------------------------------------------------


def test_teardown_fails_when_an_mps_process_of_ours_remains(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.world.leftover.append(MpsProc(4242, "nvidia-cuda-mps-server", 1001,
                                    None, 5))
    r.world.leftover.append(MpsProc(4343, "nvidia-cuda-mps-control", 0, "/elsewhere/pipe", 5))

    def node(cfg: CollocConfig) -> FakeNode:
        n = FakeNode(r.world, cfg)
        r.runner.node = n
        r.nodes.append(n)
        r.world.leftover.append(MpsProc(4444, "nvidia-cuda-mps-server", 1001,
                                        f"{cfg.mps_root}/gpu1/uid1001/pipe", 5))
        return n

    r.deps.node_factory = node
    res = gpu_kit.run_kit(TWO, r.deps, SITE)
    c = checks(res)["teardown"]
    assert c.result == FAIL and "pid 4444" in c.detail
    assert "4242" not in c.detail and "4343" not in c.detail  # not the kit's
    assert res.exit_code == 1


def test_epilog_that_leaves_daemons_fails_release_and_teardown(tmp_path: Path) -> None:
    r = rig(tmp_path, world=World(epilog_stops_daemons=False))
    res = gpu_kit.run_kit(TWO, r.deps, SITE)
    c = checks(res)
    assert c["epilog_release"].result == FAIL and "not stopped" in c["epilog_release"].detail
    assert c["teardown"].result == FAIL
    assert r.world.daemons == {}  # the fallback stop ran after the verdict


def test_a_prolog_error_aborts_but_still_tears_down(tmp_path: Path) -> None:
    r = rig(tmp_path)

    def node(cfg: CollocConfig) -> FakeNode:
        n = FakeNode(r.world, cfg)
        r.runner.node = n
        r.nodes.append(n)
        orig = n.prolog

        def prolog(ctx: JobContext) -> PrologDecision:
            if ctx.uid == BOB.uid:
                raise RuntimeError("MPS control daemon for GPU 1 did not come up in 10s")
            return orig(ctx)

        n.prolog = prolog  # type: ignore[method-assign]
        return n

    r.deps.node_factory = node
    res = gpu_kit.run_kit(TWO, r.deps, SITE)
    v = verdicts(res)
    assert v["prolog"] == FAIL and "did not come up" in checks(res)["prolog"].detail
    assert v["visibility"] == NOT_RUN and v["oom_at_limit"] == NOT_RUN
    assert v["epilog_release"] == PASS and v["teardown"] == PASS
    assert res.measurements["aborted"] == "prolog failed"
    assert r.world.daemons == {} and res.exit_code == 1


def test_a_client_that_never_answers_fails_visibility_only(tmp_path: Path) -> None:
    r = rig(tmp_path)
    orig = FakeClient._ready

    def silent(self: FakeClient) -> dict[str, Any]:
        if self.user.uid == BOB.uid:
            return {"event": "ready", "ok": False, "error": "client 9: no answer in 180s"}
        return orig(self)

    r.deps.clients = r.runner
    FakeClient._ready = silent  # type: ignore[method-assign]
    try:
        res = gpu_kit.run_kit(TWO, r.deps, SITE)
    finally:
        FakeClient._ready = orig  # type: ignore[method-assign]
    v = verdicts(res)
    assert v["visibility"] == FAIL and v["mps_two_users"] == FAIL
    assert v["survivor_other_user"] == NOT_RUN and v["survivor_same_user"] == PASS
    assert v["throughput_two_users"] == NOT_RUN and v["teardown"] == PASS


# --- JSON and table ---------------------------------------------------------------------


TOP_KEYS = {"schema", "colloc_version", "host", "started", "finished", "duration_s",
            "exit_code", "refusal", "options", "environment", "config", "checks", "summary",
            "measurements", "suggested_config"}


def test_json_schema_keys(tmp_path: Path) -> None:
    res = gpu_kit.run_kit(TWO, rig(tmp_path).deps, SITE)
    path = tmp_path / "out.json"
    report.write_json(res, path)
    doc = json.loads(path.read_text())
    assert set(doc) == TOP_KEYS and doc["schema"] == "colloc-selftest/1"
    assert doc["exit_code"] == 0 and doc["refusal"] is None and doc["host"] == "gpu-node-7"
    assert {"driver_version", "cuda_driver_version", "gpus", "gpu", "compute_mode", "mps",
            "cgroup_v2", "hard_limit", "nvidia_smi", "torch", "users", "slurm_order",
            "kit_config"} <= set(doc["environment"])
    assert doc["environment"]["cuda_driver_version"] == "13.0"
    assert {"clients", "daemons", "nvml_hold", "nvidia_smi_hold", "context_mib",
            "mps_server_mib", "oom", "oom_scan", "nvml_at_limit", "negative_control",
            "throughput", "epilog", "left_behind", "mps_logs", "idle"} <= set(doc["measurements"])
    assert set(doc["measurements"]["clients"]) == {"a", "a2", "b"}
    a = doc["measurements"]["clients"]["a"]
    assert {"role", "user", "uid", "job_id", "shards", "pid", "prolog", "exports", "env",
            "ready", "answers", "exit"} <= set(a)
    for c in doc["checks"]:
        assert set(c) == {"name", "result", "detail", "data"}
        assert c["result"] in (PASS, FAIL, INFO, NOT_RUN)
    assert doc["summary"] == {r: sum(1 for c in doc["checks"] if c["result"] == r)
                              for r in (PASS, FAIL, INFO, NOT_RUN)}
    assert doc["config"]["shard_mib"] == 1024 and doc["options"]["users"] == ["alice", "bob"]


def test_table_renders_every_check(tmp_path: Path) -> None:
    from rich.console import Console

    res = gpu_kit.run_kit(TWO, rig(tmp_path).deps, SITE)
    console = Console(record=True, width=200)
    report.render(res, console, tmp_path / "x.json")
    text = console.export_text()
    for name in gpu_kit.CATALOGUE:
        assert name in text
    assert "cuda_context_mib = 544" in text and "x.json" in text


def test_default_json_path_names_host_and_date() -> None:
    p = report.default_json_path("gpu-node-7.cluster", 1_800_000_000.0)
    assert p.name.startswith("colloc-selftest-gpu-node-7.cluster-2027")
    assert p.suffix == ".json" and p.parent == Path(".")


# --- parsers -----------------------------------------------------------------------------


def test_small_parsers() -> None:
    assert gpu_kit.pinned_mib("0=1536M") == 1536
    assert gpu_kit.pinned_mib("1=2G,0=2G") == 2048
    assert gpu_kit.pinned_mib("0=1073741824") == 1024
    assert gpu_kit.pinned_mib("garbage") is None and gpu_kit.pinned_mib(None) is None
    assert gpu_kit.norm_uuid("GPU-ABC") == gpu_kit.norm_uuid("abc")
    assert gpu_kit.parse_exports(["export A=1=2", "print x", "export B="]) == {"A": "1=2",
                                                                               "B": ""}
    rows = gpu_kit.parse_smi_apps(
        "GPU-1, 4001, 1502, /usr/bin/python3\nGPU-1, 4002, [N/A], nvidia-cuda-mps-server\n"
        "No running processes found\nGPU-1, 4003, 12, /opt/a, b/python\n")
    assert [(r["pid"], r["used_mib"]) for r in rows] == [(4001, 1502), (4002, None), (4003, 12)]
    assert rows[2]["name"] == "/opt/a, b/python"


# --- the client script (no torch here: only what runs without it) -------------------------


def test_client_script_says_how_to_install_torch_when_missing(tmp_path: Path) -> None:
    script = gpu_kit.CLIENT_SCRIPT
    env = {"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"}
    probe = subprocess.run([sys.executable, "-S", str(script), "probe"], capture_output=True,
                           text=True, env=env, timeout=60, check=False)
    doc = json.loads(probe.stdout.splitlines()[-1])
    assert doc["event"] == "probe" and doc["torch"] is None
    assert "pip install torch" in doc["error"]
    run = subprocess.run([sys.executable, "-S", str(script)], input="report\n",
                         capture_output=True, text=True, env=env, timeout=60, check=False)
    assert run.returncode == 3
    doc = json.loads(run.stdout.splitlines()[-1])
    assert doc["event"] == "ready" and doc["ok"] is False and "pip install torch" in doc["error"]


def test_client_script_answers_commands_with_a_fake_torch(tmp_path: Path) -> None:
    """The command loop and OOM reporting, with a stand-in torch module on the path."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(FAKE_TORCH)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "FAKE_LIMIT_MIB": "100"}
    cmds = "alloc 60\nalloc 60\nfill 16 200\nreport\nhold\nbench 0.05 8 0\nbogus\nfree\nexit\n"
    run = subprocess.run([sys.executable, str(gpu_kit.CLIENT_SCRIPT)], input=cmds,
                         capture_output=True, text=True, env=env, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    out = [json.loads(line) for line in run.stdout.splitlines()]
    ready, a1, a2, fill, rep, hold, bench, bogus, free, bye = out
    assert ready["ok"] and ready["device_count"] == 1 and ready["uuid"] == "abcd"
    assert a1["ok"] and not a2["ok"] and a2["oom"]
    assert a2["error"].startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")
    assert fill["oom"] and fill["reached_mib"] == 92 and fill["added_mib"] == 32
    assert rep["held_mib"] == 92 and hold["ok"]
    assert bench["ok"] and bench["iters"] >= 10 and bench["n"] == 8
    assert not bogus["ok"] and "unknown command" in bogus["error"]
    assert free["held_mib"] == 0 and bye["event"] == "exit"


FAKE_TORCH = '''
import os
__version__ = "0.0-fake"
class _V: cuda = "12.8"
version = _V()
uint8 = "uint8"; float16 = "float16"
class OutOfMemoryError(RuntimeError): pass
OutOfMemoryError.__module__ = "torch"
_used = [0]
LIMIT = int(os.environ.get("FAKE_LIMIT_MIB", "0")) << 20
class _T:
    def __init__(self, n): self.n = n
    def __matmul__(self, other): return self
class _Props:
    name = "Fake GPU"; total_memory = 80 << 30; uuid = "abcd"
class cuda:
    OutOfMemoryError = OutOfMemoryError
    @staticmethod
    def is_available(): return True
    @staticmethod
    def device_count(): return 1
    @staticmethod
    def get_device_properties(i): return _Props()
    @staticmethod
    def synchronize(): pass
    @staticmethod
    def empty_cache(): pass
    @staticmethod
    def memory_allocated(): return _used[0]
    @staticmethod
    def memory_reserved(): return _used[0]
def zeros(n, device=None): return _T(0)
def empty(n, dtype=None, device=None):
    if _used[0] + n > LIMIT:
        raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n / 2**20:.2f} MiB.")
    _used[0] += n
    return _T(n)
def randn(*a, **k): return _T(0)
'''


# --- the real node scripts behind CollocNodeOps (simulated GPUs, MPS stand-in) ---------------


# the lab's launcher (not a console script of the wheel: issue 26 item 7)
STANDIN = str(sim_tools.tool("colloc-sim-mps-control"))


def test_collocnodeops_drives_the_real_prolog_task_prolog_and_epilog(tmp_path: Path) -> None:
    """The adapter the kit uses on hardware, against the simulation's GPUs and MPS."""
    from slurm_colloc.gpu.sim.state import init_state
    from slurm_colloc.selftest.system import CollocNodeOps, ProcTable

    if not os.path.exists(STANDIN):
        pytest.fail(f"MPS stand-in not installed at {STANDIN}; run make venv")
    init_state(tmp_path / "sim", gpu_count=2)
    cfg = CollocConfig(gpu_backend="sim", sim_state_dir=str(tmp_path / "sim"),
                       mps_control=os.path.realpath(STANDIN), mps_root=str(tmp_path / "mps"),
                       metrics_dir=str(tmp_path / "metrics"), gpu_hard_limit=False,
                       log_file=str(tmp_path / "colloc.log"))
    node = CollocNodeOps(cfg)
    uid = os.getuid()
    ctx = JobContext(job_id=gpu_kit.JOB_ID_BASE + 1, uid=uid, user="root", node="n",
                     gpus=(1,), shards=2, gpu_count=0, stdout=None, stderr=None, restarts=0,
                     admin_comment="", exit_code="", state="RUNNING")
    try:
        d = node.prolog(ctx)
        assert d.mode == "shared" and d.gpu == 1
        exports = gpu_kit.parse_exports(node.exports(ctx.job_id))
        assert exports["CUDA_MPS_PIPE_DIRECTORY"] == f"{cfg.mps_root}/gpu1/uid{uid}/pipe"
        assert gpu_kit.pinned_mib(exports["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) is not None
        seen = node.daemons()
        assert [(s.gpu, s.uid) for s in seen] == [(1, uid)] and seen[0].pid
        procs = ProcTable(frozenset({os.path.basename(STANDIN)}))
        assert procs.alive(seen[0].pid or 0, seen[0].start_ticks)
        r = node.release(ctx.job_id)
        assert r.released == [(1, uid)] and r.stopped_daemons == [(1, uid)] and not r.errors
        # stop() counts a daemon whose /proc entry no longer shows its program as gone: one
        # that is still tearing down (its memory released, not yet a zombie) is given a
        # moment, never more (the C stand-in client answers quit fast enough to see it)
        deadline = time.monotonic() + 5
        while procs.alive(seen[0].pid or 0, seen[0].start_ticks) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not procs.alive(seen[0].pid or 0, seen[0].start_ticks)
        assert not any((p.pipe_dir or "").startswith(cfg.mps_root)
                       for p in procs.mps_processes())
        assert "gpu1/uid" in "".join(node.logs()) or node.logs() == {}
    finally:
        node.stop_all()
        node.close()


# --- the CLI ---------------------------------------------------------------------------------


def test_cli_refusal_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: Any) -> None:
    from slurm_colloc.cli import main
    from slurm_colloc.selftest import system

    r = rig(tmp_path, root=False)
    monkeypatch.setattr(system, "real_deps", lambda: r.deps)
    monkeypatch.setenv("COLLOC_CONF", str(tmp_path / "none.conf"))
    (tmp_path / "none.conf").write_text("shard_mib = 1024\n")
    out = CliRunner().invoke(main, ["selftest", "--gpu"])
    assert out.exit_code == 2
    assert out.output.count("\n") == 1 and "must run as root" in out.output


def test_cli_writes_json_and_exits_with_the_verdict(tmp_path: Path, monkeypatch: Any) -> None:
    from slurm_colloc.cli import main
    from slurm_colloc.selftest import system

    r = rig(tmp_path, world=World(smi_offset_mib=500))
    monkeypatch.setattr(system, "real_deps", lambda: r.deps)
    (tmp_path / "c.conf").write_text("shard_mib = 1024\n")
    path = tmp_path / "res.json"
    out = CliRunner().invoke(main, ["selftest", "--gpu", "--users", "alice,bob", "--json",
                                    str(path), "--conf", str(tmp_path / "c.conf"),
                                    "--bench-sizes", "1024", "--bench-seconds", "1"])
    assert out.exit_code == 1, out.output
    doc = json.loads(path.read_text())
    assert doc["exit_code"] == 1 and doc["options"]["bench_sizes"] == [1024]
    assert "nvidia_smi_match" in out.output and "fail" in out.output


def test_cli_without_gpu_flag_is_a_usage_error() -> None:
    from slurm_colloc.cli import main

    out = CliRunner().invoke(main, ["selftest"])
    assert out.exit_code == 2 and "--gpu" in out.output


def test_an_interpreter_the_user_cannot_run_fails_visibility_for_that_client(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path)
    start = r.runner.start

    def start_or_deny(name: str, python: str, script: str, user: User, env: dict[str, str],
                      cwd: str) -> FakeClient:
        if user.name == "bob":
            raise PermissionError(13, "Permission denied", python)
        return start(name, python, script, user, env, cwd)

    r.runner.start = start_or_deny  # type: ignore[method-assign]
    res = gpu_kit.run_kit(TWO, r.deps, SITE)
    c = checks(res)
    assert c["visibility"].result == FAIL and "cannot start" in c["visibility"].detail
    assert "readable by the test users" in c["visibility"].detail
    assert c["survivor_same_user"].result == PASS and c["teardown"].result == PASS


def test_process_client_runner_speaks_to_the_real_client_script(tmp_path: Path) -> None:
    """The subprocess side: JSON lines in order, deadlines, a client that dies early."""
    from slurm_colloc.selftest.system import ProcessClientRunner

    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_TORCH)
    me = User("me", os.getuid(), os.getgid(), str(tmp_path))
    runner = ProcessClientRunner()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "fake"),
           "FAKE_LIMIT_MIB": "100"}
    c = runner.start("a", sys.executable, str(gpu_kit.CLIENT_SCRIPT), me, env, str(tmp_path))
    try:
        assert c.read(60)["event"] == "ready"
        c.send("alloc 200")
        ans = c.read(60)
        assert ans["event"] == "alloc" and ans["oom"] is True
        with pytest.raises(ClientGone, match="no answer"):
            c.read(0.2)  # nothing asked, nothing said
    finally:
        done = c.close(30)
    assert done["returncode"] == 0 and not done["killed"]
    bare = {"PATH": "/usr/bin:/bin"}
    d = runner.start("b", sys.executable, str(gpu_kit.CLIENT_SCRIPT), me, bare, str(tmp_path))
    try:
        assert "pip install torch" in d.read(60)["error"]
        with pytest.raises(ClientGone, match="exited"):
            d.read(30)
    finally:
        assert d.close(30)["returncode"] == 3
    probe = runner.probe(sys.executable, str(gpu_kit.CLIENT_SCRIPT))
    assert probe["event"] == "probe"
    assert runner.probe("/nonexistent/python", "x")["torch"] is None


def test_mps_v3_capability_is_reported_as_v3(tmp_path: Path) -> None:
    @dataclass(frozen=True)
    class Capability:  # the shape of slurm_colloc.mps.v3.MpsCapability
        protocol: int
        multiuser: bool
        detail: str

    r = rig(tmp_path)
    r.deps.mps_detect = lambda binary: Capability(3, True, f"{binary}: MPS v3")
    res = gpu_kit.run_kit(TWO, r.deps, SITE)
    assert checks(res)["mps_protocol"].detail == "v3: /usr/bin/nvidia-cuda-mps-control: MPS v3"
    assert res.environment["mps"]["protocol"] == "v3"
    assert res.environment["mps"]["multiuser"] is True


def test_no_per_user_daemons_recorded_means_two_user_daemon_check_not_run(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(FakeNode, "daemons", lambda self: [])
    res = gpu_kit.run_kit(TWO, rig(tmp_path).deps, SITE)
    assert checks(res)["mps_two_users"].result == NOT_RUN
    assert checks(res)["survivor_other_user"].result == PASS
