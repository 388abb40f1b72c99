"""Issue 27 item 1 on the devcluster: each report says what ended the attempt.

A job colloc's collector kills (it leaves MPS and takes 20 GiB of its 2 GiB), a job
killed by SIGKILL (it signals itself: nobody else, no memory advice), an OOM at a known
allocation (PyTorch's "Tried to allocate" line, the size kept in the record) and a job
whose collector was stopped for a while: each report, in text, JSON and HTML, names the
cause, the exit code exactly as ``sacct -o ExitCode`` prints it, and the advice that
follows. The three jobs of the first test run at once; the gap test runs alone (it
stops the node's collector, which the kill needs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.metrics import liveness
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import ensure_user, sbatch

pytestmark = pytest.mark.devcluster

USER = "colloc-u1"  # the collector never signals root's processes
KILLED = "unset CUDA_MPS_PIPE_DIRECTORY\nexec colloc-simjob --mem 20G --seconds 30"
SELF_KILLED = "colloc-simjob --mem 1G --seconds 30 &\nsleep 6\nkill -KILL $$"
OOM = "colloc-simjob --mem 4G --peak 50G --peak-at 0.4 --seconds 8"


def _run(cluster: Cluster, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), env=cluster.env(), capture_output=True, text=True,
                          check=False, timeout=60)


def _report(cluster: Cluster, job: int, *args: str) -> str:
    return _run(cluster, str(cluster.venv_bin / "colloc-report"), str(job), *args).stdout


def _story(cluster: Cluster, job: int, done: Any, timeout: float = 60) -> dict[str, Any]:
    """The report's JSON once ``done(last attempt)`` holds (the record writer is
    detached: the record reaches accounting a moment after the job ends)."""
    deadline = time.monotonic() + timeout
    d: dict[str, Any] = {}
    while time.monotonic() < deadline:
        out = _report(cluster, job, "--json")
        d = json.loads(out) if out.strip().startswith("{") else {}
        att = d.get("attempts") or []
        if att and not d.get("running") and done(att[-1]):
            return d
        time.sleep(1.5)
    raise AssertionError(f"job {job}: the report never told its story: {d}")


def _sacct_exit(cluster: Cluster, job: int) -> str:
    cp = _run(cluster, "sacct", "-j", str(job), "-X", "-n", "-P", "-o", "ExitCode")
    return cp.stdout.strip().splitlines()[-1]


def _all_forms(cluster: Cluster, job: int, tmp_path: Path) -> str:
    page = tmp_path / f"{job}.html"
    text = _report(cluster, job, "--html", str(page))
    return text + "\n" + page.read_text()


@pytest.fixture
def user(cluster: Cluster) -> None:
    ensure_user(cluster, USER)


def test_kill_signal_and_oom_each_name_cause_exit_code_and_advice(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, tmp_path: Path, user: None
) -> None:
    killed = sbatch(cluster, workdir, KILLED, "--gres=shard:2", user=USER)
    self_killed = sbatch(cluster, workdir, SELF_KILLED, "--gres=shard:2", user=USER)
    oom = sbatch(cluster, workdir, OOM, "--gres=gpu:1", user=USER)  # a whole GPU: no requeue
    states = wait_for_jobs(slurm, [killed, self_killed, oom], timeout=90)
    assert states == {str(killed): "FAILED", str(self_killed): "FAILED", str(oom): "FAILED"}

    d = _story(cluster, killed, lambda a: a.get("enforcement"))
    (a,) = d["attempts"]
    s = a["story"]
    assert a["enforcement"]["action"] == "killed" and a["enforcement"]["outside_mps"]
    assert s["cause"] == "killed-by-colloc" and "collector killed it" in s["summary"]
    assert d["exit_code"] == s["exit_code"] == _sacct_exit(cluster, killed) == "0:9"
    recs = " ".join(d["recommendations"])
    assert "Keep CUDA_MPS_PIPE_DIRECTORY" in recs and "Its allocation was 2.0 GiB" in recs
    out = _all_forms(cluster, killed, tmp_path)
    assert out.count("killed by signal 9 (SIGKILL)") >= 2 and "collector killed it" in out

    d = _story(cluster, self_killed, lambda a: a.get("story", {}).get("cause") == "signal")
    s = d["attempts"][-1]["story"]
    assert s["exit_code"] == _sacct_exit(cluster, self_killed) == "0:9"
    assert "killed by SIGKILL" in s["summary"] and "colloc did not send it" in s["summary"]
    recs = " ".join(d["recommendations"])
    assert "--colloc-mem" not in recs and "batch" not in recs and "shards instead" not in recs
    assert "killed by SIGKILL" in _all_forms(cluster, self_killed, tmp_path)

    d = _story(cluster, oom, lambda a: (a.get("oom") or {}).get("alloc_mib"))
    a = d["attempts"][-1]
    assert a["oom"]["alloc_mib"] == 47104 and a["oom"]["in_use_mib"] == 4096  # 50G - 4G
    assert a["story"]["exit_code"] == _sacct_exit(cluster, oom) == "1:0"
    assert "OOM: a 46.0 GiB allocation failed with 4.0 GiB in use" in a["story"]["summary"]
    assert "it was not requeued" in a["story"]["summary"]
    assert any("needs at least 50.0 GiB, more than a whole GPU" in r
               for r in d["recommendations"])
    assert "a 46.0 GiB allocation failed" in _all_forms(cluster, oom, tmp_path)


def test_a_collector_gap_is_told_and_never_shrinks_the_share(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, tmp_path: Path, user: None
) -> None:
    metrics = cfgmod.load(cluster.layout.colloc_conf).metrics_dir
    job = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 30", "--gres=shard:8",
                 user=USER)
    deadline = time.monotonic() + 45
    while not (liveness.collector_running(metrics)
               and (workdir / f"{job}.out").is_file()):
        assert time.monotonic() < deadline, "the job or its collector did not start"
        time.sleep(0.5)
    time.sleep(4)
    sup, worker = liveness.read_pids(metrics)
    assert sup is not None
    for pid in (sup, worker):
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while liveness.collector_running(metrics):
        assert time.monotonic() < deadline, "the collector did not stop"
        time.sleep(0.2)
    time.sleep(14)  # the job runs on, unsampled (a stop under 10 s is not called one)
    nxt = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 1", "--gres=shard:2",
                 user=USER)  # its prolog starts a collector again
    states = wait_for_jobs(slurm, [job, nxt], timeout=90)
    assert set(states.values()) == {"COMPLETED"}, states

    d = _story(cluster, job, lambda a: (a.get("story") or {}).get("measured")
               and (a.get("sampling") or {}).get("source") == "record")
    s = d["attempts"][-1]["story"]
    assert s["cause"] == "completed" and s["exit_code"] == _sacct_exit(cluster, job) == "0:0"
    assert "collector was stopped for" in s["measured"], s
    assert "peak may have been higher" in s["measured"]
    # 1 GiB of 8 shards would be "2 shards instead of 8", were the peak complete
    assert not any("shards instead" in r for r in d["recommendations"]), d["recommendations"]
    assert "collector was stopped for" in _all_forms(cluster, job, tmp_path)
