"""Issue 26 item 4 on the devcluster: the collector's systemd unit and its fallback.

The devcluster runs in a chroot without systemd as PID 1: a prolog with
``collector_unit`` set must fall back to the detached start (and say so in its log),
and the unit it would have used must pass systemd's own check. The gap a killed
collector leaves in a job's sampling is checked in
``test_attack_collector.py::test_a_dead_collector_is_restarted_...``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.metrics import liveness
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import ensure_user, sbatch

USER = "colloc-u2"
UNIT = "colloc-collector.service"


def _stop_collector(metrics: str) -> None:
    sup, _ = liveness.read_pids(metrics)
    if sup is not None and liveness.collector_running(metrics):
        os.kill(sup, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while liveness.collector_running(metrics):
        assert time.monotonic() < deadline, "the collector did not stop"
        time.sleep(0.2)


def test_without_systemd_the_prolog_starts_the_collector_itself_and_logs_it(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    ensure_user(cluster, USER)
    conf = cluster.layout.colloc_conf
    original = conf.read_text()
    metrics = cfgmod.load(conf).metrics_dir
    log = cluster.layout.log / "colloc.log"
    seen = log.stat().st_size if log.exists() else 0
    _stop_collector(metrics)
    conf.write_text(original + f'\ncollector_unit = "{UNIT}"\n')
    try:
        job = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 3", "--gres=shard:2",
                     user=USER)
        deadline = time.monotonic() + 60
        while not liveness.collector_running(metrics):
            assert time.monotonic() < deadline, "no collector started"
            time.sleep(0.2)
        assert wait_for_jobs(slurm, [job], timeout=90)[str(job)] == "COMPLETED"
    finally:
        conf.write_text(original)
    with log.open("rb") as f:
        f.seek(seen)
        new = f.read().decode("utf-8", "replace")
    assert "starting the collector detached instead" in new, new[-3000:]
    assert "no systemd on this host" in new or f"systemctl start {UNIT} failed" in new


def test_the_unit_passes_systemd_analyze_verify(cluster: Cluster, tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze: the 26.05 rootfs has it (package systemd)"
    cp = subprocess.run([str(cluster.venv_bin / "colloc"), "admin", "collector-unit",
                         "--install", "--unit-dir", str(tmp_path)], env=cluster.env(),
                        capture_output=True, text=True, timeout=60, check=False)
    assert cp.returncode == 0, cp.stderr
    unit = tmp_path / UNIT
    assert f"ExecStart={cluster.venv_bin}/python" in unit.read_text()  # this install's
    cp = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True,
                        timeout=60, check=False)
    assert cp.returncode == 0, cp.stderr + cp.stdout
