"""Issue 23, item 3: attribution that cannot be steered, replayed live.

``colloc-u1`` is the attacker, ``colloc-u2`` the victim (as in test_adversarial.py).
The devcluster has no proctrack/cgroup: the collector attributes GPU processes by
their environment, owner-checked against root's records. Each test asserts what a
site cares about: the victim's jobs complete, never requeued, no verdict on them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.gpu.sim.state import read_records
from slurm_colloc.metrics import enforce
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import ensure_user, node_state, sbatch
from tests.e2e.test_node_path import _one_gpu_with_room, _wait_running

ATTACKER, VICTIM = "colloc-u1", "colloc-u2"


@pytest.fixture
def users(cluster: Cluster) -> None:
    for u in (ATTACKER, VICTIM):
        ensure_user(cluster, u)


def _log(cluster: Cluster) -> str:
    return (cluster.layout.log / "colloc.log").read_text()


def _epilog_lines(cluster: Cluster, job: int) -> list[str]:
    return [ln for ln in _log(cluster).splitlines() if f"epilog: job {job}:" in ln]


def test_claiming_the_victims_next_job_ids_does_not_get_them_killed(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    """ATTACK (issue 23): the attacker's GPU processes carry ``SLURM_JOB_ID`` = the
    victim's next job ids before the victim submits them. The collector cached "no
    owner" for those ids; the victim's two jobs on one GPU then failed the owner check
    and were both charged to the newest, which root killed (``over_limit, killed``
    with the pids of both). Now: both complete, no verdict."""
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    limit = 4 * cfg.shard_mib
    each = limit * 3 // 4  # each job within its allocation; both together are not
    with _one_gpu_with_room(cluster, slurm, workdir):
        claims = "\n".join(
            f"SLURM_JOB_ID=$((SLURM_JOB_ID + {i})) colloc-simjob --mem 700M --seconds 60 &"
            for i in (1, 2, 3))
        attacker = sbatch(cluster, workdir, f"{claims}\nwait", "--gres=shard:4",
                          user=ATTACKER)
        _wait_running(slurm, [attacker])
        deadline = time.monotonic() + 30  # the collector samples the claims first
        while len([r for r in read_records(cfg.sim_state_dir)
                   if r.uid == _uid(ATTACKER)]) < 3:
            assert time.monotonic() < deadline, "the attacker's claims never reached a GPU"
            time.sleep(0.5)
        time.sleep(3)
        script = f"colloc-simjob --mem {each}M --seconds 15"
        victims = [sbatch(cluster, workdir, script, "--gres=shard:4", user=VICTIM)
                   for _ in range(2)]
        _wait_running(slurm, victims)  # on the GPU with room, together
    try:
        assert victims == [attacker + 1, attacker + 2], (attacker, victims)
        states = wait_for_jobs(slurm, victims, timeout=120)
        verdicts = [enforce.verdict_for(cfg, v, 0) for v in victims]
        assert verdicts == [None, None], verdicts
        assert all(states[str(v)] == "COMPLETED" for v in victims), (states, _log(cluster)[-3000:])
        for v in victims:
            assert (slurm.show_job(v) or {}).get("Restarts") == "0"
    finally:
        slurm.cancel([attacker, *victims])
        wait_for_jobs(slurm, [attacker, *victims], timeout=60)
    assert node_state(cluster) in ("idle", "mix")


def _uid(name: str) -> int:
    import pwd

    return pwd.getpwnam(name).pw_uid


def test_a_plain_shard_job_is_never_outside_mps_for_its_own_mps_server(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    """On hardware the user's MPS server is in NVML's compute list, no MPS client, and
    runs as the user: the collector charged it to the user's newest job as a process
    outside MPS (a flag on every shard job; ``kill`` killed the server). The sim now
    lists servers like NVML; the collector must know its daemon's servers."""
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    job = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 12", "--gres=shard:2",
                 user=VICTIM)
    try:
        deadline = time.monotonic() + 60
        server = 0
        while not server:
            assert time.monotonic() < deadline, "the job never reached its MPS server"
            mine = [r for r in read_records(cfg.sim_state_dir) if r.uid == _uid(VICTIM)]
            server = next((r.mps_server for r in mine if r.mps_server), 0)
            time.sleep(0.3)
        # the server runs as the job's user, as on hardware (not as root, never charged)
        assert os.stat(f"/proc/{server}").st_uid == _uid(VICTIM)
        assert wait_for_jobs(slurm, [job], timeout=90)[str(job)] == "COMPLETED"
        assert enforce.verdict_for(cfg, job, 0) is None
        assert "is the MPS server of daemon" in _log(cluster)
    finally:
        slurm.cancel([job])
        wait_for_jobs(slurm, [job], timeout=60)


def test_a_job_only_outside_mps_is_not_blamed_for_a_genuine_oom(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    """DEFECT (issue 23): a co-tenant that left MPS but stayed within its allocation
    was only flagged, yet named as the culprit of the victim's own OOM, so the victim
    was requeued with the same (too small) request until its requeues ran out. Now the
    victim's OOM is its own: no culprit named."""
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    with _one_gpu_with_room(cluster, slurm, workdir):
        attacker = sbatch(cluster, workdir,
                          "unset CUDA_MPS_PIPE_DIRECTORY\ncolloc-simjob --mem 1G --seconds 60",
                          "--gres=shard:2", user=ATTACKER)
        deadline = time.monotonic() + 60
        while (v := enforce.verdict_for(cfg, attacker, 0)) is None:
            assert time.monotonic() < deadline, "the job outside MPS was never flagged"
            time.sleep(0.5)
        assert v.kind == enforce.OUTSIDE_MPS and v.action == enforce.FLAGGED, v
        victim = sbatch(cluster, workdir, "colloc-simjob --mem 3G --seconds 5",
                        "--gres=shard:2", user=VICTIM)  # 3 GiB on 2 shards: its own OOM
        deadline = time.monotonic() + 90
        while not (lines := _epilog_lines(cluster, victim)):
            assert time.monotonic() < deadline, "the victim's epilog never ran"
            time.sleep(1)
    try:
        assert "cause=gpu-oom" in lines[0], lines
        assert f"culprit=job {attacker}" not in lines[0], lines
    finally:
        slurm.cancel([attacker, victim])
        wait_for_jobs(slurm, [attacker, victim], timeout=60)
