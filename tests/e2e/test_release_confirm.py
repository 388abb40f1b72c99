"""Release confirmation on a real slurmctld (issue 28): a job colloc requeued whose
release slurmctld lost (killed before it saved its state) is released again by the
node's collector; an administrator's own hold is left alone.

The lost release is staged: the test holds a running job with ``scontrol
requeuehold`` as colloc's epilog does and leaves the marker colloc leaves once Slurm
accepted the release, dated as if the release was 30 s ago. A second job is
requeue-held, released and then held by the administrator (``scontrol hold``), with
the same marker. What Slurm's JSON says of both is printed (the rule rests on it).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.mps import release_confirm as rc
from slurm_colloc.node import requeue_steps
from slurm_colloc.slurm.adapter import SlurmCli
from tests.e2e.conftest import sbatch

pytestmark = pytest.mark.devcluster


def _wait(cond: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise TimeoutError(what)


def _scontrol(cluster: Cluster, *args: str) -> str:
    cp = subprocess.run(["scontrol", *args], env=cluster.env(), capture_output=True,
                        text=True, check=False, timeout=30)
    assert cp.returncode == 0, f"scontrol {' '.join(args)}: {cp.stderr}"
    return cp.stdout


def _fields(cluster: Cluster, job: int) -> dict[str, object]:
    d = json.loads(_scontrol(cluster, "--json", "show", "job", str(job)))["jobs"][0]
    return {k: d.get(k) for k in ("job_state", "hold", "state_reason", "state_description",
                                  "restart_cnt", "priority")}


def _state(slurm: SlurmCli, job: int) -> str:
    j = slurm.job(job)
    return j.state if j is not None else ""


def _held_pending(slurm: SlurmCli, job: int) -> bool:
    j = slurm.job(job)
    return (j is not None and j.job_state.base == "PENDING" and j.held
            and "COMPLETING" not in j.job_state.flags)


def test_a_lost_release_is_given_again_and_an_admin_hold_is_not(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    log = Path(cfg.log_file)
    body = "echo attempt=${SLURM_RESTART_COUNT:-0}\nsleep 300"
    ours = sbatch(cluster, workdir, body, "--gres=shard:2", "--requeue")
    admins = sbatch(cluster, workdir, body, "--gres=shard:2", "--requeue")
    try:
        _wait(lambda: all(_state(slurm, j) == "RUNNING" for j in (ours, admins)),
              "the jobs never ran", 60)
        for j in (ours, admins):
            _scontrol(cluster, "requeuehold", str(j))
        _wait(lambda: all(_held_pending(slurm, j) for j in (ours, admins)),
              "requeuehold did not leave both jobs held", 60)
        _scontrol(cluster, "release", str(admins))
        _scontrol(cluster, "hold", str(admins))
        seen = {"requeuehold": _fields(cluster, ours), "release+hold": _fields(cluster, admins)}
        print(f"\nSlurm's JSON: {json.dumps(seen)}")
        a, b = slurm.job(ours), slurm.job(admins)
        assert a is not None and rc.held_by_requeue(a), seen
        assert b is not None and b.held and not rc.held_by_requeue(b), seen
        staged = time.time() - rc.CONFIRM_AFTER_S
        for j in (ours, admins):
            plan = requeue_steps.RequeuePlan(job_id=j, attempt=0, new_shards=2, resize=False,
                                             done=list(requeue_steps.STEPS))
            requeue_steps.confirm_later(cfg.evidence_dir, plan, a.user_id, now=staged)
        t0 = time.monotonic()
        again = f"requeue-confirm: job {ours}: attempt 0: still held"
        _wait(lambda: again in log.read_text(errors="replace"),
              "the collector's confirmer did not release the job", 40)
        released_s = time.monotonic() - t0
        left = f"requeue-confirm: job {admins}: attempt 0: release confirmed: held by someone"
        _wait(lambda: left in log.read_text(errors="replace"), "the admin's hold not seen", 20)
        _wait(lambda: _state(slurm, ours) == "RUNNING",
              "the released job did not run again", 60)
        ran_s = time.monotonic() - t0
        out = workdir / f"{ours}.out"
        _wait(lambda: out.exists() and "attempt=1" in out.read_text(),
              "the second attempt printed nothing", 30)
        still = slurm.job(admins)
        assert still is not None and still.held, "the admin's hold was released"
        done = f"requeue-confirm: job {ours}: attempt 0: release confirmed"
        _wait(lambda: done in log.read_text(errors="replace"), "the marker was kept", 45)
        sdir = rc.state_dir(cfg.evidence_dir)
        assert not list(sdir.glob(f"{ours}.*.confirm")) and not list(
            sdir.glob(f"{admins}.*.confirm"))
        lines = [ln for ln in log.read_text(errors="replace").splitlines()
                 if "requeue-confirm: job" in ln]
        print(f"released again {released_s:.0f} s after the marker was due, running "
              f"{ran_s:.0f} s after; " + " | ".join(lines[-4:]))
    finally:
        subprocess.run(["scancel", str(ours), str(admins)], env=cluster.env(), check=False)
