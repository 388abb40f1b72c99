"""Node collector: attribution of several jobs on one simulated GPU, series, summary."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.sim.backend import SimBackend
from slurm_colloc.gpu.sim.state import ProcRecord, init_state, process_start_ticks, write_record
from slurm_colloc.metrics import store
from slurm_colloc.metrics.attribution import Attributor, tag_of
from slurm_colloc.metrics.collector import Collector, acquire_lock
from slurm_colloc.metrics.summary import job_summary
from slurm_colloc.node.metrics_launch import collector_running
from tests.unit.conftest import Clock


def spawn(procs: list[subprocess.Popen[bytes]], env: dict[str, str]) -> int:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         env={"PATH": os.environ["PATH"], **env})
    procs.append(p)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # wait for exec: before it, environ is ours
        if b"time.sleep" in Path(f"/proc/{p.pid}/cmdline").read_bytes():
            break
        time.sleep(0.01)
    return p.pid


def register(state: Path, pid: int, gpu: int, mib: int, sm: float = 30.0) -> None:
    ticks = process_start_ticks(pid)
    assert ticks is not None
    write_record(state, ProcRecord(pid=pid, gpu=gpu, uid=os.getuid(), used_mib=mib, sm_pct=sm,
                                   start_ticks=ticks))


def make(tmp_path: Path, gpus: int = 2) -> tuple[CollocConfig, SimBackend, Path]:
    state = tmp_path / "sim"
    init_state(state, gpu_count=gpus, memory_mib=40960)
    cfg = CollocConfig(gpu_backend="sim", sim_state_dir=str(state),
                       metrics_dir=str(tmp_path / "metrics"), metrics_max_rows=16,
                       evidence_dir=str(tmp_path / "state" / "evidence"))
    return cfg, SimBackend(state), state


def test_environ_attribution_reads_job_and_attempt(procs: list[subprocess.Popen[bytes]]) -> None:
    pid = spawn(procs, {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "2"})
    tag = tag_of(pid)
    assert tag is not None and (tag.job_id, tag.attempt, tag.source) == ("4242", 2, "environ")
    other = spawn(procs, {})
    assert tag_of(other) is None
    assert tag_of(2**22 + 12345) is None  # no such process


def test_environ_claim_for_another_users_job_is_refused(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    pid = spawn(procs, {"SLURM_JOB_ID": "77"})
    me = os.getuid()
    assert Attributor(uid_of_job=lambda j: me).lookup(pid) is not None
    refused = Attributor(uid_of_job=lambda j: me + 1).lookup(pid)
    assert refused is None or me == 0  # root's processes are trusted


def test_three_jobs_on_one_gpu_are_attributed_separately(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path)
    a = spawn(procs, {"SLURM_JOB_ID": "101"})
    a2 = spawn(procs, {"SLURM_JOB_ID": "101"})  # a second process of job 101
    b = spawn(procs, {"SLURM_JOB_ID": "102", "SLURM_RESTART_COUNT": "1"})
    c = spawn(procs, {"SLURM_JOB_ID": "103"})
    stray = spawn(procs, {})  # a GPU process outside Slurm
    register(state, a, 0, 3000)
    register(state, a2, 0, 1000)
    register(state, b, 0, 6000)
    register(state, c, 1, 2000)
    register(state, stray, 0, 500)
    clock = Clock(1_000_000.0)
    col = Collector(cfg, backend, clock=clock)
    for _ in range(5):
        seen = col.step()
        clock.t += 1
        # the sim's energy counter runs on real time; rows keep energy to 0.01 J, so
        # steps a few ms apart would make the split mostly rounding noise
        time.sleep(0.2)
    assert seen == {("101", 0): 4000, ("102", 1): 6000, ("103", 0): 2000}
    col.close()
    s101, t101 = job_summary(cfg, 101, 0)
    s102, t102 = job_summary(cfg, 102, 1)
    s103, t103 = job_summary(cfg, 103, 0)
    assert s101 is not None and s101.peak_mib == 4000 and s101.samples == 5
    assert s102 is not None and s102.peak_mib == 6000
    assert t101 == ["102"] and t102 == ["101"] and t103 == []
    assert s103 is not None and s103.dcgm and s103.mean_sm_activity == pytest.approx(0.30)
    # GPU 0 has four tenants at 30 % each, combined as the Lucid pairs measured (not
    # their capped sum: issue 24); job 103 alone on GPU 1 at 30 %
    from slurm_colloc.gpu.sim.activity import combined_pct

    assert s101.mean_sm_activity == pytest.approx(combined_pct([30.0] * 4) / 100, abs=0.01)
    assert 0.7 < s101.mean_sm_activity < 1.0
    # energy: GPU 0's energy split 4000:6000 (the stray process is not a job)
    assert s101.energy_j and s102.energy_j
    assert s102.energy_j / s101.energy_j == pytest.approx(1.5, rel=0.05)
    assert job_summary(cfg, 999, 0) == (None, [])


def test_peak_survives_compaction_and_rows_stay_bounded(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path)
    pid = spawn(procs, {"SLURM_JOB_ID": "7"})
    clock = Clock(1_000_000.0)
    col = Collector(cfg, backend, clock=clock)
    for i in range(200):
        register(state, pid, 0, 12000 if i == 37 else 1000 + i)
        col.step()
        clock.t += 1
    col.close()
    rows = store.read_series(cfg.metrics_dir, 7, 0).rows
    assert len(rows) <= cfg.metrics_max_rows
    s, _ = job_summary(cfg, 7, 0)
    assert s is not None and s.peak_mib == 12000 and s.samples == 200
    exact_mean = (sum(1000 + i for i in range(200)) - (1000 + 37) + 12000) / 200
    assert s.mean_mib == pytest.approx(exact_mean, rel=1e-3)


def test_job_that_leaves_is_closed_and_tenants_change_over_time(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path)
    a = spawn(procs, {"SLURM_JOB_ID": "11"})
    register(state, a, 0, 1000)
    clock = Clock(1_000_000.0)
    col = Collector(cfg, backend, clock=clock)
    col.step()
    b_proc = procs  # job 12 arrives, then leaves
    b = spawn(b_proc, {"SLURM_JOB_ID": "12"})
    register(state, b, 0, 2000)
    clock.t += 1
    col.step()
    procs[-1].kill()
    procs[-1].wait()
    for _ in range(8):
        clock.t += 1
        col.step()
    assert ("12", 0) not in col.open and ("11", 0) in col.open
    rows = store.read_series(cfg.metrics_dir, 11, 0).rows
    assert [r.tenants for r in rows[:3]] == [(), ("12",), ()]
    col.close()


def test_collector_lock_is_exclusive_and_visible_to_the_prolog_probe(tmp_path: Path) -> None:
    d = str(tmp_path / "m")
    assert not collector_running(d)
    fd = acquire_lock(d)
    assert fd is not None
    try:
        assert collector_running(d)
        assert acquire_lock(d, tries=1) is None
    finally:
        os.close(fd)
    assert not collector_running(d)  # a stale pid file does not count


def test_retention_prunes_old_jobs_only(tmp_path: Path) -> None:
    m = tmp_path / "m"
    for job in ("1", "2"):
        d = store.ensure_dir(store.job_dir(m, job))
        (d / "series-0.tsv").write_text(store.HEADER + "\n")
    old = 1_000_000.0
    for f in (store.job_dir(m, "1"), store.job_dir(m, "1") / "series-0.tsv"):
        os.utime(f, (old, old))
    removed = store.prune(m, retention_days=14, now=old + 15 * 86400)
    assert removed == ["1"]
    assert not store.job_dir(m, "1").exists() and store.job_dir(m, "2").exists()


def test_symlinked_series_is_not_followed(tmp_path: Path) -> None:
    m = tmp_path / "m"
    d = store.ensure_dir(store.job_dir(m, "5"))
    secret = tmp_path / "secret"
    secret.write_text("1\t0\t5\t5\t5\t\t\t\t\t\t0\t-\t1\n")
    (d / "series-0.tsv").symlink_to(secret)
    assert store.read_series(m, 5, 0).rows == []
    with pytest.raises(OSError):
        store.SeriesWriter(d / "series-0.tsv", 100)
    with pytest.raises(ValueError):
        store.job_dir(m, "../etc")


def test_enforcement_rides_on_the_same_sample(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """One backend read per step, metrics and enforcement alike; the series still
    records an over-limit job's memory, and the verdict names the prolog's attempt."""
    from slurm_colloc.metrics import enforce

    cfg, backend, state = make(tmp_path)
    cfg = replace(cfg, enforce_over_limit="flag")
    calls = []
    real = backend.sample_all

    def counted() -> list:  # type: ignore[type-arg]
        calls.append(1)
        return real()

    backend.sample_all = counted  # type: ignore[method-assign]
    pid = spawn(procs, {"SLURM_JOB_ID": "31"})
    register(state, pid, 0, 6000)
    store.write_meta(cfg.metrics_dir, store.JobMeta(job_id=31, attempt=0, uid=os.getuid(),
                                                    gpus=(0,), limit_mib=2048, shards=2))
    clock = Clock(1_000_000.0)
    col = Collector(cfg, backend, clock=clock)
    for _ in range(3):
        assert col.step() == {("31", 0): 6000}
        clock.t += 1
    col.close()
    assert len(calls) == 3
    v = enforce.verdict_for(cfg, 31, 0)
    assert v is not None and v.action == enforce.FLAGGED and v.peak_mib == 6000
    off = replace(cfg, enforce_over_limit="off", enforce_outside_mps="off")
    assert not Collector(off, backend).enforcer.active


def test_rows_are_kept_by_slurm_index_when_nvml_order_differs(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """NVML's GPU 0 is Slurm's GPU 1 when the device files' minors run the other way."""
    from slurm_colloc.gpu.backend import GpuInfo

    cfg, _backend, state = make(tmp_path)

    class Reversed(SimBackend):
        def gpus(self) -> list[GpuInfo]:
            out = super().gpus()
            return [replace(g, minor_number=len(out) - 1 - g.index) for g in out]

    rev = Reversed(state)
    pid = spawn(procs, {"SLURM_JOB_ID": "301"})
    register(state, pid, 0, 1500)  # NVML index 0
    col = Collector(cfg, rev, clock=Clock(1_000_000.0))
    col.step()
    col.close()
    rows = store.read_series(cfg.metrics_dir, 301, 0).rows
    assert rows and {r.gpu for r in rows} == {1}
