"""Measured peaks feed the next estimate: a rerun of the same model is sized from history."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.accounting.submit_record import parse_record
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import sbatch

pytestmark = pytest.mark.devcluster

SUMMARY = Path(__file__).resolve().parents[2] / "sbatch_templates" / "summaries" / "resnet50_torchinfo.txt"
OPTS = (f"--colloc={SUMMARY}", "--colloc-batch-size=48", "--colloc-optimizer=momentum")


def _record(slurm: SlurmCli, job: int):
    rec = parse_record(str((slurm.show_job(job) or {}).get("AdminComment", "")))
    assert rec is not None, f"job {job} has no colloc1 record"
    return rec


def _wait_history(cluster: Cluster, timeout: float = 60) -> None:
    """Until ``colloc estimate`` (history from accounting, as the cli_filter runs it)
    finds the measured peak."""
    import json
    import subprocess

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cp = subprocess.run(
            ["colloc", "estimate", "--summary", str(SUMMARY), "--batch-size", "48",
             "--optimizer", "momentum", "--json"],
            env=cluster.env(), capture_output=True, text=True, check=False)
        if cp.returncode == 0 and json.loads(cp.stdout).get("estimator") == "history":
            return
        time.sleep(1)
    pytest.fail("the measured peak never reached the accounting history")


def test_rerun_is_estimated_from_the_measured_peak(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    first = sbatch(cluster, workdir, "colloc-simjob --mem 5G --peak 6G --peak-at 0.2 --seconds 4",
                   *OPTS)
    r1 = _record(slurm, first)
    assert r1.estimator == "layer-aware" and r1.est_mib and r1.est_mib > 6144
    assert wait_for_jobs(slurm, [first], timeout=90)[str(first)] == "COMPLETED"
    _wait_history(cluster)  # the run's record (with its peak) reaches slurmdbd after its end
    second = sbatch(cluster, workdir, "colloc-simjob --mem 5G --peak 6G --seconds 1", *OPTS)
    r2 = _record(slurm, second)
    assert r2.estimator == "history", r2
    assert r2.fingerprint == r1.fingerprint
    assert r2.est_mib is not None and 6144 <= r2.est_mib < r1.est_mib  # tighter, still safe
    assert r2.shards <= r1.shards
    assert wait_for_jobs(slurm, [second], timeout=90)[str(second)] == "COMPLETED"
    # the same model at twice the batch: one measured batch size anchors the estimate
    bigger = sbatch(cluster, workdir, "colloc-simjob --mem 5G --peak 6G --seconds 1",
                    f"--colloc={SUMMARY}", "--colloc-batch-size=96",
                    "--colloc-optimizer=momentum")
    r3 = _record(slurm, bigger)
    slurm.cancel([bigger])
    assert r3.estimator == "history-anchored", r3
    assert r3.est_mib is not None and r2.est_mib < r3.est_mib  # grows with the batch


def _estimate(cluster: Cluster, *opts: str) -> dict[str, Any]:
    import json
    import subprocess

    cp = subprocess.run(["colloc", "estimate", "--summary", str(SUMMARY), *opts, "--json"],
                        env=cluster.env(), capture_output=True, text=True, check=True)
    out: dict[str, Any] = json.loads(cp.stdout)
    return out


def test_a_gapped_attempt_leaves_the_history_unchanged(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    """Issue 27 item 2: the collector is killed while a job of a model with no history
    yet runs; its partial 1 GiB peak must not become the model's history (it would size
    the next run from 1 GiB): the estimate stays the summary's, and the provenance names
    the job as not used for its sampling gap."""
    from slurm_colloc import config as cfgmod
    from slurm_colloc.metrics import liveness, store

    key = ("--batch-size", "8", "--optimizer", "adamw")  # a key no other test measures
    before = _estimate(cluster, *key)
    assert before["estimator"] == "layer-aware" and before["estimate_mib"] > 1100, before
    metrics = cfgmod.load(cluster.layout.colloc_conf).metrics_dir
    job = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 24",
                 f"--colloc={SUMMARY}", "--colloc-batch-size=8", "--colloc-optimizer=adamw")
    deadline = time.monotonic() + 60
    while not store.read_series(metrics, job, 0).rows or liveness.read_pids(metrics)[1] is None:
        assert time.monotonic() < deadline, "the job was never sampled"
        time.sleep(0.5)
    sup, worker = liveness.read_pids(metrics)
    for pid in (sup, worker):  # the whole collector: nothing samples the rest of the job
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    assert wait_for_jobs(slurm, [job], timeout=90)[str(job)] == "COMPLETED"
    deadline = time.monotonic() + 60
    after: dict[str, Any] = {}
    while time.monotonic() < deadline:  # until the job's record reaches slurmdbd
        after = _estimate(cluster, *key)
        if any(n["job"] == str(job) for n in after.get("history_runs", {}).get("not_used", [])):
            break
        time.sleep(1)
    (mine,) = [n for n in after["history_runs"]["not_used"] if n["job"] == str(job)]
    assert mine["use"] == "bound" and mine["reason"].startswith("sampling gaps"), mine
    assert after["estimator"] == "layer-aware", after  # not "history" from 1 GiB
    assert after["estimate_mib"] == before["estimate_mib"], (before, after)
