"""Chaos: thousands of GPU processes with hostile environments, names and cgroups.

Issue 23 item 1. Every value the collector reads from a process (``environ``,
``cgroup``, ``stat``) is its owner's to choose. A fake ``/proc`` tree holds a few
well-formed jobs among thousands of processes with random junk: numbers of any size,
binary bytes, other users' job ids, Slurm-like cgroup lines with the wrong owner,
links, missing and truncated files, processes that vanish between steps. The
collector must never raise, must attribute exactly the well-formed jobs' memory, and
must still find the one job over its limit, in the same sample. Seeded, bounded to a
few seconds, runs in CI.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuBackend, GpuBackendError, GpuInfo, GpuProcess, GpuSample
from slurm_colloc.metrics import enforce, store
from slurm_colloc.metrics.attribution import Attributor
from slurm_colloc.metrics.collector import Collector
from tests.unit.conftest import Clock

GPUS = 4
JUNK = 3000
BASE_PID = 5_000_000  # above any pid_max: never a real process (the real /proc is asked too)
OWNER = 4242  # the well-formed jobs' user
JUNK_UIDS = (60001, 60002, 60003)
SEEDS = (1, 2, 3)


class FakeBackend(GpuBackend):
    """GPUs whose process lists the test sets."""

    name = "fake"

    def __init__(self) -> None:
        self.procs: dict[int, list[GpuProcess]] = {g: [] for g in range(GPUS)}

    def gpus(self) -> list[GpuInfo]:
        raise GpuBackendError("fake: no identities")  # NVML order taken as Slurm's

    def sample(self, index: int) -> GpuSample:
        return self.sample_all()[index]

    def sample_all(self) -> list[GpuSample]:
        now = time.time()
        return [GpuSample(index=g, timestamp=now, memory_used_mib=sum(p.used_mib for p in ps),
                          utilization_pct=50.0, power_w=100.0, energy_j=None,
                          processes=tuple(ps)) for g, ps in self.procs.items()]

    def close(self) -> None:
        pass


def _junk_value(rng: random.Random) -> bytes:
    return rng.choice([
        b"7" * rng.choice([5, 12, 13, 300, 4301, 5000, 20000]),
        b"-1", b"+3", b" 3", b"3\n4", b"0x10", b"1e9", "\u0663\u0664".encode(),
        rng.randbytes(rng.randrange(1, 64)),
        b"", b"\xff\xfe", b"99999999999999999999", b"(null)", b"../../etc",
        str(rng.randrange(1, 40)).encode(),  # a well-formed job's id, not the owner's
    ])


def _junk_environ(rng: random.Random) -> bytes:
    items = []
    for _ in range(rng.randrange(0, 6)):
        key = rng.choice([b"SLURM_JOB_ID", b"SLURM_RESTART_COUNT", b"SLURM_JOB_SLUID",
                          b"CUDA_MPS_PIPE_DIRECTORY", b"X" * rng.randrange(1, 300)])
        items.append(key + b"=" + _junk_value(rng))
    if rng.random() < 0.1:
        items.append(rng.randbytes(rng.randrange(1, 4096)))
    return b"\0".join(items)


def _junk_cgroup(rng: random.Random) -> bytes:
    job = _junk_value(rng)
    return rng.choice([
        b"0::/system.slice/slurmstepd.scope/job_" + job + b"/step_0\n",
        b"0::/system.slice/n1_slurmstepd.scope/sEKNKTV3WPV500/x\n",
        b"4:memory:/slurm/uid_" + str(OWNER).encode() + b"/job_" + job + b"/\n",
        b"0::/user.slice/job_3/\n" * rng.randrange(1, 200),
        rng.randbytes(rng.randrange(0, 512)),
        b"",
    ])


def _junk_stat(rng: random.Random, pid: int) -> bytes:
    name = bytes(rng.randrange(1, 256) for _ in range(rng.randrange(0, 16)))
    good = f"{pid} (".encode() + name + b") S " + b" ".join(
        str(rng.randrange(1, 10**6)).encode() for _ in range(50))
    return rng.choice([good, good, good, b"garbage", b"1 (x) S 1 2", good[:40], b""])


def _write(path: Path, data: bytes, uid: int) -> None:
    path.write_bytes(data)
    os.chown(path, uid, uid)


def _proc(root: Path, pid: int, uid: int, environ: bytes | None, cgroup: bytes | None,
          stat: bytes) -> None:
    d = root / str(pid)
    d.mkdir()
    if environ is not None:
        _write(d / "environ", environ, uid)
    if cgroup is not None:
        _write(d / "cgroup", cgroup, uid)
    _write(d / "stat", stat, uid)
    os.chown(d, uid, uid)


def _stat(pid: int, ticks: int) -> bytes:
    fields = ["S", "1"] + ["0"] * 17 + [str(ticks)] + ["0"] * 30
    return f"{pid} (python3) ".encode() + " ".join(fields).encode()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Path, CollocConfig]]:
    if os.geteuid() != 0:
        pytest.fail("the fake /proc needs files of several owners: run as root")
    # thousands of small files: in memory where there is a tmpfs (seconds, not tens)
    shm = Path("/dev/shm")
    fast = Path(tempfile.mkdtemp(prefix="colloc-chaos-", dir=shm if shm.is_dir() else None))
    cfg = CollocConfig(metrics_dir=str(tmp_path / "metrics"), mps_root=str(tmp_path / "mps"),
                       metrics_max_rows=64, enforce_over_limit="flag",
                       enforce_outside_mps="flag")
    yield fast / "proc", cfg
    shutil.rmtree(fast)


@pytest.mark.parametrize("seed", SEEDS)
def test_hostile_processes_never_stop_the_sample(
    world: tuple[Path, CollocConfig], seed: int
) -> None:
    proc, cfg = world
    proc.mkdir()
    rng = random.Random(seed)
    backend = FakeBackend()
    expected: dict[tuple[str, int], int] = {}
    # well-formed jobs 1..8 of OWNER: two processes each on one GPU; job 8 over its limit
    for job in range(1, 9):
        gpu = job % GPUS
        store.write_meta(cfg.metrics_dir, store.JobMeta(
            job_id=job, attempt=0, uid=OWNER, gpus=(gpu,), limit_mib=4096, shards=4))
        for k in range(2):
            pid = BASE_PID + job * 10 + k
            env = b"\0".join([b"SLURM_JOB_ID=" + str(job).encode(), b"SLURM_RESTART_COUNT=0"])
            _proc(proc, pid, OWNER, env, b"0::/user.slice\n", _stat(pid, 1000 + pid))
            mib = 3000 if job == 8 else 1000
            backend.procs[gpu].append(GpuProcess(pid, mib, True))
            expected[(str(job), 0)] = expected.get((str(job), 0), 0) + mib
    # thousands of hostile ones, on every GPU
    junk: list[int] = []
    for i in range(JUNK):
        pid = BASE_PID + 1000 + i
        uid = rng.choice(JUNK_UIDS)
        env = None if rng.random() < 0.05 else _junk_environ(rng)
        cg = None if rng.random() < 0.05 else _junk_cgroup(rng)
        _proc(proc, pid, uid, env, cg, _junk_stat(rng, pid))
        if rng.random() < 0.02:  # a link where a file should be
            (proc / str(pid) / "environ").unlink(missing_ok=True)
            (proc / str(pid) / "environ").symlink_to("/proc/self/environ")
        backend.procs[rng.randrange(GPUS)].append(
            GpuProcess(pid, rng.choice([0, 1, 512, 2**31]), rng.choice([True, False, None])))
        junk.append(pid)
    clock = Clock(1_000_000.0)
    col = Collector(cfg, backend, clock=clock)
    col.attributor = Attributor(proc=str(proc), uid_of_job=col._uid_of_job,
                                job_of_sluid=col._job_of_sluid)
    started = time.monotonic()
    for step in range(4):
        seen = col.step()
        assert seen == expected, (step, {k: v for k, v in seen.items() if k not in expected})
        clock.t += 1
        for pid in rng.sample(junk, 200):  # vanish between steps
            shutil.rmtree(proc / str(pid), ignore_errors=True)
    col.close()
    assert time.monotonic() - started < 30
    v = enforce.verdict_for(cfg, 8, 0)
    assert v is not None and v.peak_mib == 6000, v
    for job in range(1, 8):
        assert enforce.verdict_for(cfg, job, 0) is None
        assert store.read_series(cfg.metrics_dir, job, 0).rows


def test_the_chaos_world_is_hostile_enough(world: tuple[Path, CollocConfig]) -> None:
    """The generator makes what broke the collector live (a guard on the test itself)."""
    rng = random.Random(SEEDS[0])
    envs = [_junk_environ(rng) for _ in range(JUNK)]
    assert any(b"SLURM_RESTART_COUNT=" + b"7" * 5000 in e for e in envs)
    assert any(b"SLURM_RESTART_COUNT=" + b"7" * 300 in e for e in envs)
    assert any(b"SLURM_JOB_ID=1\0" in e + b"\0" for e in envs)
