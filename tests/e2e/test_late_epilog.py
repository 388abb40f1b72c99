"""slurmd SIGKILLed while an OOM job's epilog runs (issue 28, the late epilog).

A site Epilog line ahead of colloc's holds the OOM'd job's epilog at a gate; the test
SIGKILLs slurmd there, opens the gate and starts slurmd again. The restarted slurmd
does not run the rest of the job's Epilog lines, so colloc's epilog never runs: the
late epilog (started by the node's collector, :mod:`slurm_colloc.node.late_epilog`)
must do its work once Slurm shows the job ended: the job is requeued on a whole GPU
and completes, its MPS registration is released, the node is not drained. slurmd is
always running again, and slurm.conf put back, when the module ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster import daemons
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.slurm.adapter import SlurmCli, SlurmError, wait_for_jobs
from tests.e2e.conftest import node_state, sbatch

pytestmark = pytest.mark.devcluster

GATE = """#!/bin/sh
# held while {d}/armed exists, until {d}/go (at most 120 s)
[ -e {d}/armed ] || exit 0
/bin/rm -f {d}/armed
/bin/touch {d}/started.$SLURM_JOB_ID
i=0
while [ ! -e {d}/go ] && [ $i -lt 1200 ]; do /bin/sleep 0.1; i=$((i+1)); done
exit 0
"""


def _wait(cond: Callable[[], bool], what: str, timeout: float = 60) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.5)
    raise TimeoutError(what)


def _scontrol(cluster: Cluster, *args: str) -> str:
    cp = subprocess.run(["scontrol", *args], env=cluster.env(), capture_output=True,
                        text=True, check=False, timeout=60)
    assert cp.returncode == 0, f"scontrol {' '.join(args)}: {cp.stderr}"
    return cp.stdout


def _slurmd_up(cluster: Cluster) -> None:
    if cluster.status().get("slurmd") is None:
        cluster.restart("slurmd", timeout=120)


@pytest.fixture(scope="module")
def gate(cluster: Cluster) -> Iterator[Path]:
    """The gate Epilog line ahead of colloc's; slurmd up and slurm.conf back after."""
    d = cluster.layout.root / "late-epilog-gate"
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o755)
    script = d / "epilog"
    script.write_text(GATE.format(d=d))
    script.chmod(0o755)
    conf = cluster.layout.slurm_conf
    text = conf.read_text()
    conf.write_text(f"Epilog={script}\n" + text)
    try:
        _scontrol(cluster, "reconfigure")
        _wait(lambda: str(script) in _scontrol(cluster, "show", "config"),
              "slurmctld did not take the gate Epilog", 90)
        _wait(lambda: cluster.is_up() and node_state(cluster) in ("idle", "mix"),
              "the node did not come back after reconfigure", 120)
        yield d
    finally:
        (d / "go").touch()
        (d / "armed").unlink(missing_ok=True)
        _slurmd_up(cluster)
        conf.write_text(text)
        _scontrol(cluster, "reconfigure")
        _wait(lambda: str(script) not in _scontrol(cluster, "show", "config"),
              "slurmctld kept the gate Epilog", 90)
        _wait(lambda: cluster.is_up() and node_state(cluster) in ("idle", "mix"),
              "the node did not come back after reconfigure", 120)


def _kill_slurmd(cluster: Cluster) -> None:
    pid = cluster.status()["slurmd"]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    _wait(lambda: not daemons.pid_runs(pid, "slurmd"), "slurmd survived SIGKILL", 30)


def _restarts(slurm: SlurmCli, job: int) -> str:
    try:
        return str((slurm.show_job(job) or {}).get("Restarts", ""))
    except SlurmError:
        return ""


def test_oom_job_whose_epilog_slurmd_never_ran_is_requeued_late(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, gate: Path
) -> None:
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    log = Path(cfg.log_file)
    (gate / "armed").touch()
    job = sbatch(cluster, workdir,
                 "echo attempt=${SLURM_RESTART_COUNT:-0}\n"
                 "colloc-simjob --mem 3G --peak 9G --peak-at 0.3 --seconds 2",
                 "--gres=shard:6")
    _wait(lambda: (gate / f"started.{job}").exists(), "the OOM job's epilog never started", 180)
    assert job in Tenancy(Path(cfg.mps_root)).all_jobs(), "the job had no MPS registration"
    _kill_slurmd(cluster)
    killed = time.monotonic()
    (gate / "go").touch()
    try:
        time.sleep(2)  # the gate's script ends with nobody to run colloc's line after it
        cluster.restart("slurmd", timeout=120)
    finally:
        _slurmd_up(cluster)
    took = _wait(lambda: _restarts(slurm, job) == "1",
                 f"job {job} was not requeued: {slurm.show_job(job)}", 420)
    requeue_s = time.monotonic() - killed
    print(f"\nslurmd SIGKILLed at job {job}'s epilog; requeued by the late epilog "
          f"{requeue_s:.0f} s after the kill ({took:.0f} s after slurmd was back)")
    text = log.read_text(errors="replace")
    assert f"late-epilog: job {job}: no colloc epilog did its work" in text, text[-3000:]
    assert "requeue=yes" in text.split(f"late-epilog: job {job}: no colloc epilog did")[1][:2000]
    assert wait_for_jobs(slurm, [job], timeout=300)[str(job)] == "COMPLETED"
    info = slurm.show_job(job) or {}
    assert "gres/shard:39" in info["TresPerNode"]  # the whole GPU the decision asked for
    assert "attempt=1" in (workdir / f"{job}.out").read_text()
    assert node_state(cluster) in ("idle", "mix"), node_state(cluster)
    text = log.read_text(errors="replace")
    assert text.count(f"late-epilog: job {job}: no colloc epilog did") == 1, "exactly once"
    assert (Path(cfg.evidence_dir) / str(job) / "attempt0").is_dir(), "no evidence kept"
    _wait(lambda: job not in Tenancy(Path(cfg.mps_root)).all_jobs(),
          "the job's MPS registration stayed", 120)
