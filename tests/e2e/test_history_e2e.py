"""Measured peaks feed the next estimate: a rerun of the same model is sized from history."""

from __future__ import annotations

import time
from pathlib import Path

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
