"""Issue 23, item 4 and lows: private data stays private, replayed by unprivileged users.

``colloc-u1`` is the attacker, ``colloc-u2`` the victim. The victim's OOM evidence,
MPS environment file and estimator history are readable by the victim (and root),
never by the attacker; a newline in an output path does not forge a line in root's
log; a flood of short jobs does not leave one root poller per job.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import threading
import time
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import ensure_user, node_state, sbatch

pytestmark = pytest.mark.devcluster

ATTACKER, VICTIM = "colloc-u1", "colloc-u2"
SUMMARY = (Path(__file__).resolve().parents[2] / "sbatch_templates" / "summaries"
           / "resnet50_torchinfo.txt")
HISTORY_OPTS = (f"--colloc={SUMMARY}", "--colloc-batch-size=24", "--colloc-optimizer=momentum")


@pytest.fixture
def users(cluster: Cluster) -> None:
    for u in (ATTACKER, VICTIM):
        ensure_user(cluster, u)


def _cfg(cluster: Cluster) -> cfgmod.CollocConfig:
    return cfgmod.load(cluster.layout.colloc_conf)


def _read_as(user: str, path: Path) -> subprocess.CompletedProcess[str]:
    """``head -c 64 path`` as ``user``: what that user can read of it."""
    return subprocess.run(["runuser", "-u", user, "--", "head", "-c", "64", str(path)],
                          capture_output=True, text=True, errors="replace", check=False,
                          timeout=30)


def _refused(cp: subprocess.CompletedProcess[str]) -> bool:
    return cp.returncode != 0 and "Permission denied" in cp.stderr


def _wait_for(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def test_victims_oom_evidence_is_the_victims_alone(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    job = sbatch(cluster, workdir, "echo 'secret of the victim'\n"
                 "colloc-simjob --mem 2G --peak 50G --seconds 1", "--gres=gpu:1", user=VICTIM)
    assert wait_for_jobs(slurm, [job], timeout=120)[str(job)] == "FAILED"
    attempt = Path(_cfg(cluster).evidence_dir) / str(job) / "attempt0"
    _wait_for(lambda: attempt.is_dir() and any(p.name[0].isdigit() for p in attempt.iterdir()),
              30, "root's evidence copy")
    copies = [p for p in attempt.iterdir() if p.name[0].isdigit()]
    kept = "".join(p.read_text() for p in copies)
    assert "secret of the victim" in kept and "OutOfMemoryError" in kept
    for p in (*copies, attempt):
        st = os.lstat(p)
        assert (st.st_uid, st.st_gid) == (0, 0) and not st.st_mode & 0o007, (p, oct(st.st_mode))
    # the owner reads it, the attacker neither lists the attempt nor reads a copy
    mine = _read_as(VICTIM, copies[0])
    assert mine.returncode == 0 and mine.stdout, mine.stderr
    assert _refused(_read_as(ATTACKER, copies[0]))
    ls = subprocess.run(["runuser", "-u", ATTACKER, "--", "ls", str(attempt)],
                        capture_output=True, text=True, check=False)
    assert ls.returncode != 0 and "Permission denied" in ls.stderr
    assert node_state(cluster) in ("idle", "mix")


def test_victims_env_file_is_not_readable_by_the_attacker(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    """``jobs/<id>.env`` (the TaskProlog's exports) while the victim's job runs."""
    job = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 20", "--gres=shard:2",
                 user=VICTIM)
    env = Tenancy(Path(_cfg(cluster).mps_root)).job_env_file(job)
    try:
        _wait_for(env.exists, 60, f"{env}")
        assert _refused(_read_as(ATTACKER, env)), oct(os.stat(env).st_mode)
    finally:
        slurm.cancel([job])


def test_victims_history_is_the_victims_alone(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    job = sbatch(cluster, workdir, "colloc-simjob --mem 2G --seconds 5", *HISTORY_OPTS,
                 user=VICTIM)
    assert wait_for_jobs(slurm, [job], timeout=120)[str(job)] == "COMPLETED"
    db = Path(_cfg(cluster).history_db)
    vuid = pwd.getpwnam(VICTIM).pw_uid
    own = db.with_name(db.name + ".users") / f"{vuid}.sqlite"
    _wait_for(own.exists, 60, f"{own}")
    assert (os.stat(db).st_mode & 0o777) == 0o600
    assert _refused(_read_as(ATTACKER, db))
    assert _refused(_read_as(ATTACKER, own))
    assert _read_as(VICTIM, own).stdout.startswith("SQLite format 3")
    listing = subprocess.run(["runuser", "-u", ATTACKER, "--", "ls", str(own.parent)],
                             capture_output=True, text=True, check=False)
    assert listing.returncode != 0  # who has history is not listed


def test_a_newline_in_the_output_path_forges_no_log_line(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    """The user's copy of the evidence goes next to the output file: a directory
    named with a newline put the forged text on a line of its own in root's log."""
    forged = "2026-01-01 00:00:00,000 colloc: epilog: job 1: FORGED-BY-USER"
    odir = workdir / f"out\n{forged}"
    subprocess.run(["runuser", "-u", ATTACKER, "--", "mkdir", str(odir)], check=True)
    job = sbatch(cluster, workdir, "colloc-simjob --mem 2G --peak 50G --seconds 1",
                 "--gres=gpu:1", f"--output={odir}/%j.out", user=ATTACKER)
    assert wait_for_jobs(slurm, [job], timeout=120)[str(job)] == "FAILED"
    log = cluster.layout.log / "colloc.log"
    _wait_for(lambda: f"epilog: job {job}: cause=gpu-oom" in log.read_text(), 30, "the epilog")
    lines = log.read_text().splitlines()
    assert not any(line.startswith(forged) for line in lines)
    mine = [line for line in lines if f"epilog: job {job}: cause=gpu-oom" in line]
    assert mine and "\\n2026-01-01" in mine[-1], mine


def _record_writers() -> int:
    """Root processes running the accounting writer now."""
    n = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != 0:
                continue
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"slurm_colloc.node.record_writer" in cmd:
            n += 1
    return n


def test_a_flood_of_short_jobs_leaves_one_record_writer(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    """50 tiny shard jobs: each used to fork a root poller for up to 120 s."""
    seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(_record_writers())
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        jobs = [sbatch(cluster, workdir, "true", "--gres=shard:1", user=ATTACKER)
                for _ in range(50)]
        states = wait_for_jobs(slurm, jobs, timeout=300)
        assert all(s == "COMPLETED" for s in states.values()), states
        spool = Path(_cfg(cluster).evidence_dir).parent / "spool"
        _wait_for(lambda: not list(spool.glob("*.adminc")), 240, "the spool to drain")
        _wait_for(lambda: _record_writers() == 0, 60, "the writer to exit")
    finally:
        stop.set()
        sampler.join()
    # one draining, one that has just let go of the lock (exiting), one just handed it:
    # never one per job (50 jobs used to leave up to 50 pollers for 120 s each)
    assert max(seen) <= 3, f"record writers at once: max {max(seen)}"
    assert not list(spool.glob("*.failed"))
    recs = slurm.accounting(jobs)
    written = {r.job_id for r in recs if "cl1:" in r.fields.get("AdminComment", "").lower()}
    assert written == {str(j) for j in jobs}, sorted({str(j) for j in jobs} - written)
