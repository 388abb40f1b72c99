"""Collector-side enforcement of the GPU memory allocation (issue 11, H2).

Real processes stand in for GPU jobs (their records on a simulated GPU say how much
memory they hold and whether they are MPS clients); the collector attributes them
through /proc exactly as on a node, and kills only what it should.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.sim.backend import SimBackend
from slurm_colloc.gpu.sim.state import ProcRecord, init_state, process_start_ticks, write_record
from slurm_colloc.metrics import enforce, store
from slurm_colloc.metrics.collector import Collector
from tests.unit.conftest import Clock

ROOT_RUN = os.geteuid() == 0
NOBODY = 65534
JOB_UID = NOBODY if ROOT_RUN else os.getuid()
"""The uid job processes run as: never root (root's processes are never signalled)."""
as_root = pytest.mark.skipif(not ROOT_RUN, reason="needs root to run processes as other users")


def spawn(procs: list[subprocess.Popen[bytes]], job: str, uid: int | None = JOB_UID,
          restarts: str | None = None) -> subprocess.Popen[bytes]:
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": job}
    if restarts is not None:
        env["SLURM_RESTART_COUNT"] = restarts
    kw = {"user": uid} if uid is not None and uid != os.getuid() else {}
    p = subprocess.Popen(["sleep", "60"], env=env, **kw)  # type: ignore[call-overload]
    procs.append(p)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # wait for exec: before it, environ is ours
        try:
            if b"sleep" in Path(f"/proc/{p.pid}/cmdline").read_bytes():
                break
        except OSError:
            pass
        time.sleep(0.01)
    return p


def register(state: Path, pid: int, mib: int, mps: bool = True, gpu: int = 0) -> None:
    ticks = process_start_ticks(pid)
    assert ticks is not None
    write_record(state, ProcRecord(pid=pid, gpu=gpu, uid=JOB_UID, used_mib=mib, sm_pct=10.0,
                                   start_ticks=ticks, mps_server=4242 if mps else 0))


def meta(cfg: CollocConfig, job: int, limit: int | None, uid: int = JOB_UID,
         attempt: int = 0) -> None:
    store.write_meta(cfg.metrics_dir, store.JobMeta(
        job_id=job, attempt=attempt, uid=uid, gpus=(0,), limit_mib=limit,
        shards=(limit or 0) // 1024, start=1.0))


def make(tmp_path: Path, **over: object) -> tuple[CollocConfig, SimBackend, Path]:
    state = tmp_path / "sim"
    init_state(state, gpu_count=2, memory_mib=40960)
    cfg = CollocConfig(gpu_backend="sim", sim_state_dir=str(state),
                       metrics_dir=str(tmp_path / "metrics"), **over)  # type: ignore[arg-type]
    return cfg, SimBackend(state), state


def steps(col: Collector, clock: Clock, n: int) -> None:
    for _ in range(n):
        col.step()
        clock.t += 1.0


def alive(p: subprocess.Popen[bytes]) -> bool:
    time.sleep(0.05)
    return p.poll() is None


def verdict_file(cfg: CollocConfig, job: int, attempt: int = 0) -> Path:
    return enforce.verdict_path(cfg.metrics_dir, job, attempt)


# ------------------------------------------------------------------ over limit ---


def test_over_limit_job_is_killed_after_the_streak_and_only_it(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path)  # defaults: kill, 512 MiB slack, 2 samples
    bad = spawn(procs, "501")
    bad2 = spawn(procs, "501")  # a second process of the offender
    good = spawn(procs, "502")
    register(state, bad.pid, 3000)
    register(state, bad2.pid, 1000)
    register(state, good.pid, 4000)
    meta(cfg, 501, 2048)  # 4000 MiB used > 2048 + 512
    meta(cfg, 502, 4096)  # within its allocation
    clock = Clock()
    col = Collector(cfg, backend, clock=clock)
    steps(col, clock, 1)
    assert alive(bad) and alive(bad2)  # one sample: recorded, not acted on
    v1 = enforce.verdict_for(cfg, 501, 0)
    assert v1 is not None and v1.action == enforce.OBSERVED and v1.kind == enforce.OVER_LIMIT
    steps(col, clock, 1)
    assert bad.wait(timeout=5) == -signal.SIGKILL and bad2.wait(timeout=5) == -signal.SIGKILL
    assert alive(good)
    v = enforce.verdict_for(cfg, 501, 0)
    assert v is not None
    assert (v.action, v.kind, v.peak_mib, v.limit_mib, v.uid, v.gpu) == (
        enforce.KILLED, enforce.OVER_LIMIT, 4000, 2048, JOB_UID, 0)
    assert set(v.pids) == {bad.pid, bad2.pid}
    assert v.first_seen == 2_000_000.0 and v.last_seen == 2_000_001.0
    assert enforce.verdict_for(cfg, 502, 0) is None


def test_within_tolerance_is_not_an_offence(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path, enforce_tolerance_mib=512)
    p = spawn(procs, "510")
    register(state, p.pid, 2048 + 512)  # exactly at limit + tolerance
    meta(cfg, 510, 2048)
    clock = Clock()
    steps(Collector(cfg, backend, clock=clock), clock, 4)
    assert alive(p) and not verdict_file(cfg, 510).exists()


def test_flag_only_records_and_keeps_the_job(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path, enforce_over_limit="flag")
    p = spawn(procs, "520")
    register(state, p.pid, 9000)
    meta(cfg, 520, 4096)
    clock = Clock()
    col = Collector(cfg, backend, clock=clock)
    steps(col, clock, 3)
    register(state, p.pid, 12000)  # grows further: the peak follows
    steps(col, clock, 1)
    assert alive(p)
    v = enforce.verdict_for(cfg, 520, 0)
    assert v is not None and v.action == enforce.FLAGGED and v.peak_mib == 12000 and v.pids == ()


def test_off_does_nothing(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    cfg, backend, state = make(tmp_path, enforce_over_limit="off", enforce_outside_mps="off")
    p = spawn(procs, "530")
    register(state, p.pid, 30000, mps=False)
    meta(cfg, 530, 1024)
    clock = Clock()
    steps(Collector(cfg, backend, clock=clock), clock, 4)
    assert alive(p) and not enforce.verdicts_dir(cfg.metrics_dir).exists()


def test_whole_gpu_job_has_no_allocation_to_exceed(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path)
    p = spawn(procs, "540")
    register(state, p.pid, 39000, mps=False)
    meta(cfg, 540, None)  # whole GPU: no limit in the meta
    clock = Clock()
    steps(Collector(cfg, backend, clock=clock), clock, 4)
    assert alive(p) and enforce.verdict_for(cfg, 540, 0) is None


def test_claimed_attempt_does_not_escape_the_recorded_limit(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """SLURM_RESTART_COUNT is the user's: an attempt with no prolog record is no way out."""
    cfg, backend, state = make(tmp_path)
    p = spawn(procs, "550", restarts="99")
    register(state, p.pid, 8000)
    meta(cfg, 550, 2048, attempt=1)  # the prolog only knows attempt 1
    clock = Clock()
    steps(Collector(cfg, backend, clock=clock), clock, 2)
    assert p.wait(timeout=5) == -signal.SIGKILL
    v = enforce.verdict_for(cfg, 550, 1)
    assert v is not None and v.attempt == 1 and v.action == enforce.KILLED


def test_streak_restarts_when_the_job_comes_back_under(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path, enforce_samples=3)
    p = spawn(procs, "560")
    meta(cfg, 560, 2048)
    clock = Clock()
    col = Collector(cfg, backend, clock=clock)
    for mib in (5000, 5000, 1000, 5000, 5000):  # never 3 in a row
        register(state, p.pid, mib)
        steps(col, clock, 1)
    assert alive(p)
    v = enforce.verdict_for(cfg, 560, 0)
    assert v is not None and v.action == enforce.OBSERVED  # seen, not acted upon
    register(state, p.pid, 5000)
    steps(col, clock, 1)
    assert p.wait(timeout=5) == -signal.SIGKILL


# ------------------------------------------------------------------ identity ---


def test_pid_reuse_is_not_killed(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, backend, state = make(tmp_path, enforce_samples=1)
    p = spawn(procs, "570")
    register(state, p.pid, 9000)
    meta(cfg, 570, 2048)
    real = enforce.start_ticks
    # between attribution and signal the pid now names a process started later
    monkeypatch.setattr(enforce, "start_ticks",
                        lambda pid, proc="/proc": (real(pid, proc) or 0) + 1)
    clock = Clock()
    steps(Collector(cfg, backend, clock=clock), clock, 2)
    assert alive(p)
    v = enforce.verdict_for(cfg, 570, 0)
    assert v is not None and v.action == enforce.KILL_REFUSED and "pid reused" in v.detail


def test_kill_verified_checks_start_time_owner_and_root(
    procs: list[subprocess.Popen[bytes]]
) -> None:
    p = spawn(procs, "580")
    ticks = process_start_ticks(p.pid)
    assert ticks is not None
    assert enforce.kill_verified(p.pid, ticks + 1, JOB_UID)[0] is False
    assert enforce.kill_verified(p.pid, ticks, JOB_UID + 1)[0] is False
    assert enforce.kill_verified(p.pid, ticks, 0) == (False, "refused: the job's uid is root")
    assert alive(p)
    assert enforce.kill_verified(p.pid, ticks, JOB_UID) == (True, "signalled")
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert enforce.kill_verified(p.pid, ticks, JOB_UID)[0] is False  # gone


@as_root
def test_another_users_process_is_never_killed(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path, enforce_samples=1)
    # nobody's process claims (environment) a job of uid 4321: not attributed at all
    intruder = spawn(procs, "590", uid=NOBODY)
    register(state, intruder.pid, 20000)
    meta(cfg, 590, 1024, uid=4321)
    # root's process inside a job's accounting: attributed, but never signalled
    rootproc = spawn(procs, "591", uid=0)
    register(state, rootproc.pid, 20000)
    meta(cfg, 591, 1024, uid=NOBODY)
    clock = Clock()
    steps(Collector(cfg, backend, clock=clock), clock, 3)
    assert alive(intruder) and alive(rootproc)
    assert enforce.verdict_for(cfg, 590, 0) is None
    v = enforce.verdict_for(cfg, 591, 0)
    assert v is not None and v.action == enforce.KILL_REFUSED and "root" in v.detail
    ticks = process_start_ticks(intruder.pid)
    assert ticks is not None
    ok, why = enforce.kill_verified(intruder.pid, ticks, 4321)
    assert not ok and f"uid {NOBODY}" in why and alive(intruder)


# ------------------------------------------------------------------ outside MPS ---


def test_process_outside_mps_is_detected_and_flagged(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path)  # enforce_outside_mps = flag by default
    rogue = spawn(procs, "600")
    client = spawn(procs, "601")
    register(state, rogue.pid, 1000, mps=False)  # within its allocation, but no MPS
    register(state, client.pid, 1000, mps=True)
    meta(cfg, 600, 2048)
    meta(cfg, 601, 2048)
    clock = Clock()
    col = Collector(cfg, backend, clock=clock)
    steps(col, clock, 1)
    assert enforce.verdict_for(cfg, 600, 0) is None  # one sample is not enough for this
    steps(col, clock, 1)
    v = enforce.verdict_for(cfg, 600, 0)
    assert v is not None and (v.kind, v.action, v.outside_mps) == (
        enforce.OUTSIDE_MPS, enforce.FLAGGED, True)
    assert alive(rogue) and enforce.verdict_for(cfg, 601, 0) is None


def test_outside_mps_kill_when_configured(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path, enforce_outside_mps="kill")
    rogue = spawn(procs, "610")
    register(state, rogue.pid, 1000, mps=False)
    meta(cfg, 610, 2048)
    clock = Clock()
    steps(Collector(cfg, backend, clock=clock), clock, 2)
    assert rogue.wait(timeout=5) == -signal.SIGKILL
    v = enforce.verdict_for(cfg, 610, 0)
    assert v is not None and v.kind == enforce.OUTSIDE_MPS and v.action == enforce.KILLED


def test_unknown_mps_membership_never_counts_as_outside(tmp_path: Path) -> None:
    from slurm_colloc.gpu.backend import GpuProcess
    from slurm_colloc.metrics.attribution import JobTag

    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"), enforce_samples=1,
                       enforce_outside_mps="kill")
    meta(cfg, 620, 2048)
    killed: list[int] = []
    enf = enforce.Enforcer(cfg, kill=lambda pid, t, u: (killed.append(pid) or True, "x"))
    tag = JobTag("620", 0, "cgroup", JOB_UID)
    for _ in range(3):
        enf.begin_step()
        assert enf.observe(0, [(GpuProcess(1234, 100, None), 1, tag)]) == []
        enf.end_step()
    assert killed == []
    enf.begin_step()
    out = enf.observe(0, [(GpuProcess(1234, 100, False), 1, tag)])
    assert killed == [1234] and out and out[0].action == enforce.KILLED


# ------------------------------------------------------------------ verdict files ---


def test_verdict_files_are_root_only_and_never_followed(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path, enforce_over_limit="flag")
    d = enforce.verdicts_dir(cfg.metrics_dir)
    store.ensure_dir(Path(cfg.metrics_dir))
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)  # too open: tightened before use
    secret = tmp_path / "secret"
    secret.write_text("keep me")
    (d / "630-0.json").symlink_to(secret)
    p = spawn(procs, "630")
    register(state, p.pid, 9000)
    meta(cfg, 630, 1024)
    clock = Clock()
    steps(Collector(cfg, backend, clock=clock), clock, 2)
    assert secret.read_text() == "keep me"
    st = os.lstat(d / "630-0.json")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    assert json.loads((d / "630-0.json").read_text())["job_id"] == "630"
    assert [n for n in os.listdir(d) if n.startswith(".")] == []  # no temp files left


def test_symlinked_verdict_is_not_read_and_symlinked_dir_is_refused(tmp_path: Path) -> None:
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"))
    v = enforce.Verdict("640", 0, JOB_UID, 0, enforce.OVER_LIMIT, 9000, 1024, 1.0, 2.0,
                        enforce.KILLED)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(v.to_json())
    store.ensure_dir(enforce.verdicts_dir(cfg.metrics_dir))
    os.chmod(enforce.verdicts_dir(cfg.metrics_dir), 0o700)
    (enforce.verdicts_dir(cfg.metrics_dir) / "640-0.json").symlink_to(elsewhere)
    assert enforce.verdict_for(cfg, 640, 0) is None
    assert enforce.culprits_on_gpu(cfg, 0, 0.0) == []
    # the verdicts directory itself as a symlink: refused for writing and reading
    cfg2 = CollocConfig(metrics_dir=str(tmp_path / "m2"))
    store.ensure_dir(Path(cfg2.metrics_dir))
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    enforce.verdicts_dir(cfg2.metrics_dir).symlink_to(real)
    with pytest.raises(OSError):
        enforce.write_verdict(cfg2.metrics_dir, v)
    assert os.listdir(real) == []
    (real / "640-0.json").write_text(v.to_json())
    assert enforce.verdict_for(cfg2, 640, 0) is None


@as_root
def test_verdict_owned_by_someone_else_is_ignored(tmp_path: Path) -> None:
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"))
    v = enforce.Verdict("650", 0, JOB_UID, 0, enforce.OVER_LIMIT, 9000, 1024, 1.0, 2.0,
                        enforce.FLAGGED)
    path = enforce.write_verdict(cfg.metrics_dir, v)
    assert enforce.verdict_for(cfg, 650, 0) == v
    os.chown(path, NOBODY, NOBODY)
    assert enforce.verdict_for(cfg, 650, 0) is None


def test_collector_survives_an_unwritable_verdict_store(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path, enforce_samples=1)
    store.ensure_dir(Path(cfg.metrics_dir))
    enforce.verdicts_dir(cfg.metrics_dir).write_text("not a directory")
    p = spawn(procs, "660")
    register(state, p.pid, 9000)
    meta(cfg, 660, 1024)
    clock = Clock()
    col = Collector(cfg, backend, clock=clock)
    seen = col.step()
    assert seen == {("660", 0): 9000}  # metrics still collected
    assert p.wait(timeout=5) == -signal.SIGKILL  # and the cap still enforced


# ------------------------------------------------------------------ epilog API ---


def _v(job: str, gpu: int, last: float, kind: str = enforce.OVER_LIMIT,
       peak: int = 9000) -> enforce.Verdict:
    return enforce.Verdict(job, 0, JOB_UID, gpu, kind, peak, 2048, last - 1, last,
                           enforce.KILLED)


def test_culprits_on_gpu_filters_gpu_time_and_victim(tmp_path: Path) -> None:
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"))
    for v in (_v("700", 0, 100.0), _v("701", 0, 50.0), _v("702", 1, 100.0),
              _v("703", 0, 120.0, kind=enforce.OUTSIDE_MPS), _v("704", 0, 110.0, peak=20000),
              _v("799", 0, 130.0)):
        enforce.write_verdict(cfg.metrics_dir, v)
    got = enforce.culprits_on_gpu(cfg, 0, since=80.0, exclude_job=799)
    # over limit only (703 was only outside MPS: no culprit, issue 23), by peak
    assert [v.job_id for v in got] == ["704", "700"]
    assert enforce.culprits_on_gpu(cfg, 1, since=101.0) == []
    assert enforce.verdict_for(cfg, 701, 0) == _v("701", 0, 50.0)
    assert enforce.verdict_for(cfg, 701, 1) is None
    assert enforce.verdict_for(cfg, "../x", 0) is None


def test_culprits_on_gpu_waits_for_a_verdict_in_the_making(tmp_path: Path) -> None:
    import threading

    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"))
    t = threading.Timer(0.3, enforce.write_verdict, (cfg.metrics_dir, _v("710", 0, 100.0)))
    t.start()
    t0 = time.monotonic()
    got = enforce.culprits_on_gpu(cfg, 0, since=0.0, wait_s=3.0)
    t.join()
    assert [v.job_id for v in got] == ["710"] and time.monotonic() - t0 < 2.5
    assert enforce.detection_window_s(cfg) == pytest.approx(3.0)


def test_prune_removes_old_verdicts_only(tmp_path: Path) -> None:
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"))
    old = enforce.write_verdict(cfg.metrics_dir, _v("720", 0, 1.0))
    new = enforce.write_verdict(cfg.metrics_dir, _v("721", 0, 1.0))
    os.utime(old, (1000.0, 1000.0))
    os.utime(new, (1000.0 + 20 * 86400, 1000.0 + 20 * 86400))
    assert enforce.prune_verdicts(cfg.metrics_dir, 14, now=1000.0 + 21 * 86400) == 1
    assert not old.exists() and new.exists()


def test_verdict_json_round_trip_and_rejects_junk() -> None:
    v = dataclasses.replace(_v("730", 0, 5.0), pids=(1, 2), outside_mps=True)
    assert enforce.Verdict.from_json(v.to_json().encode()) == v
    assert enforce.Verdict.from_json(b"[]") is None
    assert enforce.Verdict.from_json(v.to_json().replace('"730"', '"../1"').encode()) is None


def test_next_attempt_on_a_whole_gpu_is_not_held_to_the_old_limit(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path, enforce_samples=1)
    first = spawn(procs, "810")
    register(state, first.pid, 1500)
    meta(cfg, 810, 2048)  # attempt 0: 2 shards
    clock = Clock()
    col = Collector(cfg, backend, clock=clock)
    steps(col, clock, 2)
    first.kill()
    first.wait()
    steps(col, clock, 1)  # gone from the GPU
    meta(cfg, 810, None, attempt=1)  # requeued onto a whole GPU
    second = spawn(procs, "810", restarts="1")
    register(state, second.pid, 30000)
    steps(col, clock, 3)
    assert alive(second) and enforce.verdict_for(cfg, 810, 1) is None


@as_root
def test_a_process_claiming_another_job_is_charged_to_its_owners_job(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Issue 11 variant: without cgroups the job id comes from the process's own
    environment; ``SLURM_JOB_ID=<a job with no record>`` hid the memory from
    enforcement. Root's MPS bookkeeping names the owner's job on that GPU."""
    from slurm_colloc.mps.tenancy import Tenancy

    cfg, backend, state = make(tmp_path, mps_root=str(tmp_path / "mps"))
    meta(cfg, 5, 1024)
    Tenancy(tmp_path / "mps").add_job(0, JOB_UID, 5)
    liar = spawn(procs, "999999")  # claims a job no prolog recorded
    register(state, liar.pid, 8192)
    clock = Clock()
    col = Collector(cfg, backend, clock=clock)
    steps(col, clock, 3)
    v = enforce.verdict_for(cfg, 5, 0)
    assert v is not None and v.kind == enforce.OVER_LIMIT and v.peak_mib == 8192
    assert not alive(liar)
