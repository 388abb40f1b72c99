"""Crash a daemon mid-run, bring it back with ``up``/``restart``: nothing is lost.

Its own cluster (root and ports apart from the shared test cluster and the other
throwaway ones), because it kills daemons that other tests rely on. Each test
shows that only what was killed restarts (the others keep their pids), and that
every job still completes and reaches accounting with its colloc record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster import daemons
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.layout import Layout, Spec
from slurm_colloc.metrics import liveness, store
from slurm_colloc.node.metrics_launch import collector_running
from slurm_colloc.slurm.adapter import SlurmCli, SlurmError, by_start, wait_for_jobs
from tests.e2e.conftest import LOG_KEEP, sbatch

pytestmark = pytest.mark.devcluster

ROOT = Path("/var/lib/colloc-restart-test")
# 27817/27827 belong to test_devcluster.py's throwaway clusters; all test ports sit below
# the kernel's ephemeral range (32768-60999): an outgoing connection can hold a port there
SPEC = Spec(ctld_port=27837, slurmd_port=27838, dbd_port=27839, mysql_port=24336)


@pytest.fixture(scope="module")
def rc() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.fail("end-to-end tests start slurmd/munged and need root")
    c = Cluster(Layout(ROOT), SPEC)
    try:
        c.up(timeout=90, fresh=True)
        yield c
    finally:
        c.down(keep_logs=LOG_KEEP / "restart")


@pytest.fixture
def slurm(rc: Cluster) -> SlurmCli:
    return SlurmCli(env=rc.env())


@pytest.fixture
def jobdir(rc: Cluster, request: pytest.FixtureRequest) -> Path:
    d = rc.layout.root / "jobs" / str(request.node.name)[:60]
    d.mkdir(parents=True, exist_ok=True)
    d.parent.chmod(0o755)
    d.chmod(0o1777)
    return d


def _wait_running(slurm: SlurmCli, jobs: list[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((slurm.show_job(j) or {}).get("JobState") == "RUNNING" for j in jobs):
            return
        time.sleep(0.3)
    raise TimeoutError(f"jobs {jobs} did not all start")


def _state_saved(rc: Cluster, since: float, timeout: float = 15) -> None:
    """Wait until slurmctld has written its job state after ``since``.

    slurmctld saves state a moment after each change (asynchronously), so a kill -9
    right after jobs start loses them as it would on any site: what ``up`` must not
    lose is what slurmctld had saved.
    """
    path = rc.layout.slurm_state / "job_state"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_mtime > since + 0.05:
            return
        time.sleep(0.2)
    raise TimeoutError(f"slurmctld did not save {path}")


def _kill9(rc: Cluster, name: str) -> int:
    pid = rc.status()[name]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    while daemons.pid_runs(pid, name if name != "mariadb" else "mariadbd"):
        time.sleep(0.05)
    return pid


def _accounted(
    slurm: SlurmCli, jobs: list[int], timeout: float = 150, *, record: bool = True
) -> dict[int, dict[str, str]]:
    """Each job's last sacct record once it is COMPLETED, ended and (``record``) carries
    the colloc attempt record."""
    deadline = time.monotonic() + timeout
    got: dict[int, dict[str, str]] = {}
    while time.monotonic() < deadline:
        for j in jobs:
            try:
                recs = by_start(slurm.accounting([j]))
            except SlurmError:
                recs = []
            f = recs[-1].fields if recs else {}
            if (recs and recs[-1].state == "COMPLETED" and f.get("End", "Unknown") != "Unknown"
                    and (not record or "cl1:" in f.get("AdminComment", ""))):
                got[j] = dict(recs[-1].fields)
        if len(got) == len(jobs):
            return got
        time.sleep(1)
    last = {j: (r[-1].state, r[-1].fields.get("End"), r[-1].fields.get("AdminComment", "")[:20])
            for j in jobs if (r := by_start(slurm.accounting([j])))}
    raise AssertionError(f"accounting incomplete after {timeout:.0f}s: {last}")


def _others_kept(before: dict[str, int | None], after: dict[str, int | None], name: str) -> None:
    assert after[name] is not None and after[name] != before[name]
    assert {k: v for k, v in after.items() if k != name} == {
        k: v for k, v in before.items() if k != name
    }, "only the killed daemon may restart"


def _simjobs(rc: Cluster, d: Path, n: int, seconds: int) -> list[int]:
    return [sbatch(rc, d, f"colloc-simjob --mem 2G --seconds {seconds}", "--gres=shard:4")
            for _ in range(n)]


def test_slurmctld_killed_mid_run_up_restarts_only_it_and_loses_no_job(
    rc: Cluster, slurm: SlurmCli, jobdir: Path
) -> None:
    jobs = _simjobs(rc, jobdir, 3, 10)
    _wait_running(slurm, jobs)
    _state_saved(rc, time.time())
    before = rc.status()
    _kill9(rc, "slurmctld")
    assert rc.up(install=False) < 30
    _others_kept(before, rc.status(), "slurmctld")
    assert set(wait_for_jobs(slurm, jobs, timeout=90).values()) == {"COMPLETED"}
    recs = _accounted(slurm, jobs)
    assert all(r["End"] != "Unknown" for r in recs.values())
    assert all("done:" in (jobdir / f"{j}.out").read_text() for j in jobs)


def test_slurmdbd_killed_mid_run_accounting_of_jobs_ended_meanwhile_arrives(
    rc: Cluster, slurm: SlurmCli, jobdir: Path
) -> None:
    jobs = _simjobs(rc, jobdir, 2, 3)
    _wait_running(slurm, jobs)
    before = rc.status()
    _kill9(rc, "slurmdbd")
    # the jobs end while slurmdbd is down: slurmctld must queue their records
    assert set(wait_for_jobs(slurm, jobs, timeout=60).values()) == {"COMPLETED"}
    with pytest.raises(SlurmError):
        slurm.accounting(jobs)
    assert rc.up(install=False) < 30
    _others_kept(before, rc.status(), "slurmdbd")
    recs = _accounted(slurm, jobs, record=False)
    assert all(r["Start"] != "Unknown" for r in recs.values())
    # the record writer waits for the job's end time in slurmdbd: the queued job-end
    # record slurmctld replays after the restart used to overwrite an AdminComment
    # written in between (the state already read COMPLETED)
    _accounted(slurm, jobs, timeout=30)


def _report(rc: Cluster, job: int) -> dict[str, object]:
    cp = subprocess.run([str(rc.venv_bin / "colloc-report"), str(job), "--json"],
                        env=rc.env(), capture_output=True, text=True, check=False, timeout=60)
    return json.loads(cp.stdout) if cp.returncode in (0, 3) and cp.stdout.strip() else {}


def test_collector_killed_mid_job_is_restarted_and_the_job_keeps_its_samples(
    rc: Cluster, slurm: SlurmCli, jobdir: Path
) -> None:
    metrics = cfgmod.load(rc.layout.colloc_conf).metrics_dir
    (a,) = _simjobs(rc, jobdir, 1, 12)
    _wait_running(slurm, [a])
    time.sleep(3)
    assert collector_running(metrics)
    pid = liveness.read_pids(metrics)[0]  # the supervisor: it holds the lock
    assert pid is not None
    rows_at_kill = len(store.read_series(metrics, a, 0).rows)
    os.kill(pid, signal.SIGKILL)
    # the orphaned worker starts a new supervisor (issue 28: enforcement back in 10 s)
    deadline = time.monotonic() + 10
    while not (collector_running(metrics)
               and liveness.read_pids(metrics)[0] not in (None, pid)):
        assert time.monotonic() < deadline, "no new collector 10 s after the kill"
        time.sleep(0.2)
    (b,) = _simjobs(rc, jobdir, 1, 2)
    assert set(wait_for_jobs(slurm, [a, b], timeout=90).values()) == {"COMPLETED"}
    assert liveness.read_pids(metrics)[0] not in (None, pid)
    _accounted(slurm, [a, b])
    deadline = time.monotonic() + 60
    att: dict[str, object] = {}
    while time.monotonic() < deadline:
        attempts = _report(rc, a).get("attempts") or []
        att = attempts[-1] if isinstance(attempts, list) and attempts else {}
        if att.get("samples"):
            break
        time.sleep(1)
    samples = att.get("samples")
    assert isinstance(samples, int) and samples > rows_at_kill > 0, (samples, rows_at_kill)


def _procs_of(rc: Cluster, job: int) -> list[int]:
    """The job's own processes (not leftovers of earlier jobs, nor detached helpers)."""
    want = f"SLURM_JOB_ID={job}".encode()
    out = []
    for p in daemons.cluster_processes("SLURM_CONF", str(rc.layout.slurm_conf),
                                       str(rc.layout.root)):
        try:
            if want in Path(f"/proc/{p}/environ").read_bytes().split(b"\0"):
                out.append(p)
        except OSError:
            pass
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def test_restart_slurmd_keeps_the_running_job(
    rc: Cluster, slurm: SlurmCli, jobdir: Path
) -> None:
    (job,) = _simjobs(rc, jobdir, 1, 10)
    _wait_running(slurm, [job])
    before = rc.status()
    # slurmstepd runs with slurmd's environment, not the cluster's: find it as the
    # parent of the batch script running colloc-simjob (not of a task prolog, whose
    # parent is a short-lived fork of slurmstepd)
    job_procs: list[int] = []
    stepds: set[int] = set()
    deadline = time.monotonic() + 20
    while not stepds and time.monotonic() < deadline:
        time.sleep(0.3)
        job_procs = _procs_of(rc, job)
        sim = [p for p in job_procs if b"colloc-simjob" in _cmdline(p)]
        stepds = {pp for pp in (_ppid(_ppid(p)) for p in sim)
                  if daemons.pid_runs(pp, "slurmstepd")}
    assert stepds
    assert rc.restart("slurmd") < 30
    _others_kept(before, rc.status(), "slurmd")
    assert all(daemons.pid_runs(p, "slurmstepd") for p in stepds), (stepds, job_procs)
    assert all(Path(f"/proc/{p}").exists() for p in job_procs), "the job's processes too"
    assert (slurm.show_job(job) or {}).get("JobState") == "RUNNING"
    assert wait_for_jobs(slurm, [job], timeout=60)[str(job)] == "COMPLETED"
    _accounted(slurm, [job])
    assert "done:" in (jobdir / f"{job}.out").read_text()
