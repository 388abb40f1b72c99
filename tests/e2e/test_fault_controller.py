"""slurmctld stopped while an OOM job's epilog runs (issue 28 items 2 and 3).

A site Epilog line ahead of colloc's holds the OOM'd job's epilogs at a gate; the
test stops slurmctld there, opens the gate, and starts slurmctld again once colloc's
epilog has handed its unanswered requeue to the detached helper. The requeue must
still happen: the job reruns on a whole GPU and completes, and its record says
"requeued". While slurmctld is away, the adapter's queue read is an error that says
"did not answer", never "no jobs" (the real answer of this release, not a fixture).
slurmctld is always running again, and slurm.conf put back, when the module ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.accounting.codec import try_decode
from slurm_colloc.devcluster import daemons
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.node.controller_wait import controller_away
from slurm_colloc.slurm.adapter import SlurmCli, SlurmError, by_start, wait_for_jobs
from tests.e2e.conftest import node_state, sbatch

pytestmark = pytest.mark.devcluster

GATE = """#!/bin/sh
# held while {d}/armed exists, until {d}/go (at most 60 s)
[ -e {d}/armed ] || exit 0
/bin/touch {d}/started.$SLURM_JOB_ID
i=0
while [ ! -e {d}/go ] && [ $i -lt 600 ]; do /bin/sleep 0.1; i=$((i+1)); done
exit 0
"""


def _wait(cond: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.3)
    raise TimeoutError(what)


def _scontrol(cluster: Cluster, *args: str) -> str:
    cp = subprocess.run(["scontrol", *args], env=cluster.env(), capture_output=True,
                        text=True, check=False, timeout=30)
    assert cp.returncode == 0, f"scontrol {' '.join(args)}: {cp.stderr}"
    return cp.stdout


def _ctld_up(cluster: Cluster) -> None:
    if cluster.status().get("slurmctld") is None:
        cluster.restart("slurmctld", timeout=60)


@pytest.fixture(scope="module")
def gate(cluster: Cluster) -> Iterator[Path]:
    """The gate Epilog line ahead of colloc's; slurmctld up and slurm.conf back after."""
    d = cluster.layout.root / "fault-gate"
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
              "slurmctld did not take the gate Epilog")
        yield d
    finally:
        (d / "go").touch()
        (d / "armed").unlink(missing_ok=True)
        _ctld_up(cluster)
        conf.write_text(text)
        _scontrol(cluster, "reconfigure")
        # reconfigure re-executes slurmd: let it settle before later modules (or the
        # session's ``down``, which stops it by its pid file) come
        _wait(lambda: str(script) not in _scontrol(cluster, "show", "config"),
              "slurmctld kept the gate Epilog")
        _wait(lambda: cluster.is_up() and node_state(cluster) in ("idle", "mix"),
              "the node did not come back after reconfigure")


def _stop_ctld(cluster: Cluster) -> None:
    pid = cluster.status()["slurmctld"]
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    _wait(lambda: not daemons.pid_runs(pid, "slurmctld"), "slurmctld did not stop", 20)


def _raw_squeue(cluster: Cluster, out: dict[str, object]) -> None:
    """What this release's squeue prints with the controller away (for the report)."""
    t0 = time.monotonic()
    try:
        cp = subprocess.run(["squeue", "--json=v0.0.42", "--states=all"], env=cluster.env(),
                            capture_output=True, text=True, check=False, timeout=40)
        out.update(rc=cp.returncode, stdout=cp.stdout[:2000], stderr=cp.stderr[:500])
    except subprocess.TimeoutExpired:
        out.update(rc="timeout")
    out["took_s"] = round(time.monotonic() - t0, 1)


def test_requeue_decided_while_slurmctld_is_away_happens(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, gate: Path
) -> None:
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    log = Path(cfg.log_file)
    (gate / "armed").touch()
    job = sbatch(cluster, workdir,
                 "echo attempt=${SLURM_RESTART_COUNT:-0}\n"
                 "colloc-simjob --mem 3G --peak 9G --peak-at 0.3 --seconds 2",
                 "--gres=shard:6")
    _wait(lambda: (gate / f"started.{job}").exists(), "the OOM job's epilog never started", 90)
    (gate / "armed").unlink()
    _stop_ctld(cluster)
    stopped = time.monotonic()
    raw: dict[str, object] = {}
    reader = threading.Thread(target=_raw_squeue, args=(cluster, raw))
    reader.start()
    try:
        # item 3: the adapter's queue read is "did not answer", never "no jobs"
        with pytest.raises(SlurmError) as away:
            SlurmCli(env=cluster.env(), timeout=8).jobs()
        assert controller_away(away.value), away.value
        (gate / "go").touch()
        pending = f"job {job}: requeue pending: slurmctld did not answer"

        def handed_off() -> bool:
            return log.exists() and pending in log.read_text(errors="replace")

        _wait(handed_off, "colloc's epilog did not hand the requeue off", 60)
    finally:
        (gate / "go").touch()
        _ctld_up(cluster)
    outage = time.monotonic() - stopped
    reader.join(60)
    print(f"\nslurmctld away {outage:.0f} s; squeue --json meanwhile: "
          f"{json.dumps(raw)[:1500]}")
    (gate / "go").unlink()
    _wait(lambda: (slurm.show_job(job) or {}).get("Restarts") == "1",
          f"job {job} was not requeued: {slurm.show_job(job)}", 120)
    assert wait_for_jobs(slurm, [job], timeout=120)[str(job)] == "COMPLETED"
    info = slurm.show_job(job) or {}
    assert "gres/shard:39" in info["TresPerNode"]  # the whole GPU the decision asked for
    assert "attempt=1" in (workdir / f"{job}.out").read_text()
    text = log.read_text(errors="replace")
    assert f"requeue-retry: job {job}: attempt 0: requeued after" in text, "the helper's line"
    assert not list((Path(cfg.evidence_dir).parent / "requeue").glob(f"{job}.*.json"))

    def recorded() -> bool:
        recs = by_start(slurm.accounting([job]))
        rec = try_decode(recs[-1].fields.get("AdminComment", "")) if recs else None
        return rec is not None and len(rec.attempts) == 2

    _wait(recorded, "the job's record did not reach accounting", 120)
    rec = try_decode(by_start(slurm.accounting([job]))[-1].fields["AdminComment"])
    assert rec is not None
    first = rec.attempts[0].requeue
    assert first is not None and first.requeued and first.new_request == "gres/shard:39"
