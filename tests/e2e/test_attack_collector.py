"""Issue 23 item 1: no user can switch the node collector (enforcement) off, replayed live.

``colloc-u1`` attacks, ``colloc-u2`` is the victim. Each test ends with the question a
site cares about: is a job that leaves MPS and takes more than its allocation still
killed, and does the victim's job complete?
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.metrics import enforce, liveness
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import ensure_user, node_state, sbatch

ATTACKER, VICTIM = "colloc-u1", "colloc-u2"
OFFENDER = "unset CUDA_MPS_PIPE_DIRECTORY\ncolloc-simjob --mem 20G --seconds 20"


@pytest.fixture
def users(cluster: Cluster) -> None:
    for u in (ATTACKER, VICTIM):
        ensure_user(cluster, u)


def _cfg(cluster: Cluster) -> cfgmod.CollocConfig:
    return cfgmod.load(cluster.layout.colloc_conf)


def _killed(cluster: Cluster, job: int, timeout: float = 60) -> enforce.Verdict | None:
    """The collector's verdict on ``job`` once it is ``killed`` (None: never)."""
    cfg = _cfg(cluster)
    deadline = time.monotonic() + timeout
    verdict = None
    while time.monotonic() < deadline:
        verdict = enforce.verdict_for(cfg, job, 0)
        if verdict is not None and verdict.action == "killed":
            return verdict
        time.sleep(1)
    return verdict


def _offender_is_stopped_and_victim_completes(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    victim = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 25", "--gres=shard:2",
                    user=VICTIM)
    time.sleep(3)
    offender = sbatch(cluster, workdir, OFFENDER, "--gres=shard:2", user=ATTACKER)
    try:
        verdict = _killed(cluster, offender)
        assert verdict is not None and verdict.action == "killed", (
            verdict, _log_tail(cluster))
        assert verdict.peak_mib > 2048 and verdict.outside_mps
    finally:
        slurm.cancel([offender])
    assert wait_for_jobs(slurm, [victim], timeout=90)[str(victim)] == "COMPLETED"
    assert (slurm.show_job(victim) or {}).get("Restarts") == "0"


def _not_drained(cluster: Cluster) -> None:
    state = node_state(cluster)
    assert "drain" not in state and "down" not in state, state


def _log_tail(cluster: Cluster) -> str:
    return "\n".join((cluster.layout.log / "colloc.log").read_text().splitlines()[-30:])


@pytest.mark.parametrize("digits", [5000, 300])
def test_a_restart_count_of_thousands_of_digits_does_not_stop_enforcement(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None, digits: int
) -> None:
    """Live: ``SLURM_RESTART_COUNT`` of 5,000 digits killed the root collector (and every
    later one at its first sample); 300 digits made every step abort at that GPU."""
    planted = sbatch(
        cluster, workdir,
        f"export SLURM_RESTART_COUNT=$(printf '7%.0s' $(seq {digits}))\n"
        "colloc-simjob --mem 1G --seconds 40", "--gres=shard:2", user=ATTACKER)
    try:
        time.sleep(5)  # the collector samples the planted environment
        _offender_is_stopped_and_victim_completes(cluster, slurm, workdir)
        assert liveness.collector_running(_cfg(cluster).metrics_dir)
    finally:
        slurm.cancel([planted])
        wait_for_jobs(slurm, [planted], timeout=60)
    _not_drained(cluster)


LOCKER = r"""
M={metrics}
for f in "$M/collector.pid" "$M/collector/lock"; do
  ( while ! flock -s -n 9; do sleep 0.1; done; echo "locked $f"; sleep 300 ) 9<"$f" &
done
echo started
sleep 120
"""


def test_a_users_lock_keeps_no_collector_out(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    """Live: a job holding a shared flock on the 0644 ``collector.pid`` made every
    prolog think a collector ran, and every collector exit at start."""
    metrics = _cfg(cluster).metrics_dir
    warm = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 1", "--gres=shard:2",
                  user=VICTIM)  # a collector runs (and leaves its files)
    assert wait_for_jobs(slurm, [warm], timeout=90)[str(warm)] == "COMPLETED"
    locker = sbatch(cluster, workdir, LOCKER.format(metrics=metrics), user=ATTACKER)
    try:
        deadline = time.monotonic() + 30
        out = workdir / f"{locker}.out"
        while not (out.exists() and "started" in out.read_text()):
            assert time.monotonic() < deadline, "the locking job did not start"
            time.sleep(0.5)
        # the collector goes (as when idle, or if it died): the attacker's turn
        sup, _worker = liveness.read_pids(metrics)
        assert sup is not None
        os.kill(sup, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while liveness.collector_running(metrics):
            assert time.monotonic() < deadline, "the collector did not stop"
            time.sleep(0.2)
        time.sleep(2)
        assert "locked" not in out.read_text(), out.read_text()
        _offender_is_stopped_and_victim_completes(cluster, slurm, workdir)
    finally:
        slurm.cancel([locker])
        wait_for_jobs(slurm, [locker], timeout=60)
    _not_drained(cluster)


def _report(cluster: Cluster, job: int) -> dict[str, object]:
    cp = subprocess.run([str(cluster.venv_bin / "colloc-report"), str(job), "--json"],
                        env=cluster.env(), capture_output=True, text=True, check=False,
                        timeout=60)
    return json.loads(cp.stdout) if cp.stdout.strip().startswith("{") else {}


def test_a_dead_collector_is_restarted_and_the_report_says_when_it_was_off(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    """A killed worker is back within seconds (its supervisor); a killed pair leaves a
    gap the next collector closes, and the job's report names it."""
    metrics = _cfg(cluster).metrics_dir
    job = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 45", "--gres=shard:2",
                 user=VICTIM)
    deadline = time.monotonic() + 60
    while liveness.read_pids(metrics)[1] is None or not liveness.collector_running(metrics):
        assert time.monotonic() < deadline, "no collector"
        time.sleep(0.5)
    time.sleep(3)
    sup, worker = liveness.read_pids(metrics)
    assert sup is not None and worker is not None
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while liveness.read_pids(metrics)[1] in (worker, None):
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.2)
    assert any(e.kind == "down" and e.pid == worker for e in liveness.read_events(metrics))
    # now the whole collector (supervisor first, then its new worker)
    _sup2, worker2 = liveness.read_pids(metrics)
    os.kill(sup, signal.SIGKILL)
    if worker2 is not None:
        os.kill(worker2, signal.SIGKILL)
    time.sleep(15)
    assert not liveness.collector_running(metrics)
    nxt = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 2", "--gres=shard:2",
                 user=VICTIM)  # its prolog starts a new collector
    states = wait_for_jobs(slurm, [job, nxt], timeout=120)
    assert set(states.values()) == {"COMPLETED"}, states
    att: dict[str, object] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        attempts = _report(cluster, job).get("attempts") or []
        att = attempts[-1] if isinstance(attempts, list) and attempts else {}
        if att.get("unenforced"):
            break
        time.sleep(2)
    spans = att.get("unenforced")
    assert isinstance(spans, list) and spans, att
    assert sum(b - a for a, b in spans) >= 12, spans
    # the epilog kept the hole in the job's sampling in its record (issue 26 item 4)
    smp = att.get("sampling")
    assert isinstance(smp, dict) and smp.get("source") == "record", att
    gaps = [g for g in smp["gaps"] if g["cause"] == "collector"]
    assert gaps and sum(g["to"] - g["from"] for g in gaps) >= 12, smp
