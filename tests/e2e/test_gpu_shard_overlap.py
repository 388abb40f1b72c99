"""Whole GPUs and shards of the same GPU never overlap (Slurm 24.11+), so a multi-GPU job
shares its node, not its GPUs, with shard jobs.

Slurm 22.05 gave a ``--gres=gpu:1`` job a GPU that shard jobs were using, so
job_submit.lua used to give every multi-GPU job its nodes exclusively. 23.11 fixed the
overlap; these tests pin what the filter now relies on, on the release the suite runs
with (``colloc devcluster rootfs --release 24.11|26.05 -- pytest ...``): the devcluster's
one node (4 simulated GPUs, partition ``gpu`` listed as shared, Slurm's default, so the
job goes where job_submit.lua routes it) runs shard jobs (``--colloc-mem``) and a
``--gres=gpu:2`` job side by side; the two-GPU job never gets a GPU a running shard job
holds, and waits while no two GPUs are free of shards.

GPU indices come from each job's own environment (``SLURM_JOB_GPUS``, printed by the job
script; shard jobs see their GPU's UUID in ``CUDA_VISIBLE_DEVICES`` under MPS) and, for the
two-GPU job, from the controller's JSON (``gres_detail`` ``gpu:2(IDX:...)``).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.devcluster.cluster import Cluster
from tests.e2e.conftest import sbatch

pytestmark = pytest.mark.devcluster

BODY = ('echo "COLLOC_TEST_GPUS=${SLURM_JOB_GPUS:-} CVD=${CUDA_VISIBLE_DEVICES:-}"\n'
        "sleep 300")
SHARD = ("--colloc-mem=2G",)  # job_submit.lua: gres/shard:2 on one GPU
TWO_GPUS = ("--gres=gpu:2",)  # no -p: Slurm's default partition "gpu", listed as shared
ACTIVE = "PD,R,CG,CF,S"


def _json_job(cluster: Cluster, job: int) -> dict[str, Any]:
    """The job as the controller holds it (``scontrol show job --json``, 23.02+)."""
    cp = subprocess.run(["scontrol", "show", "job", "--json", str(job)], env=cluster.env(),
                        capture_output=True, text=True, check=True)
    jobs = json.loads(cp.stdout)["jobs"]
    assert len(jobs) == 1, cp.stdout[:500]
    return dict(jobs[0])


def _state(cluster: Cluster, job: int) -> str:
    s = _json_job(cluster, job)["job_state"]  # a list since data_parser v0.0.40
    return str(s[0] if isinstance(s, list) else s)


def _states(cluster: Cluster, jobs: list[int]) -> dict[int, str]:
    return {j: _state(cluster, j) for j in jobs}


def _wait_running(cluster: Cluster, jobs: list[int], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    states = _states(cluster, jobs)
    while time.monotonic() < deadline:
        states = _states(cluster, jobs)
        if all(s == "RUNNING" for s in states.values()):
            return
        assert not any(s in ("FAILED", "CANCELLED", "COMPLETED", "NODE_FAIL") for s in
                       states.values()), states
        time.sleep(0.5)
    pytest.fail(f"jobs not running after {timeout} s: {states}")


def _wait_idle(cluster: Cluster, timeout: float = 120) -> None:
    """No job of an earlier test still runs or waits: the GPUs must start free."""
    deadline = time.monotonic() + timeout
    left = ""
    while time.monotonic() < deadline:
        left = subprocess.run(["squeue", "-h", "-t", ACTIVE, "-o", "%i %T %b"],
                              env=cluster.env(), capture_output=True, text=True,
                              check=True).stdout.strip()
        if not left:
            return
        time.sleep(1)
    pytest.fail(f"the devcluster still has jobs from elsewhere: {left}")


def _gpus(workdir: Path, job: int, timeout: float = 30) -> set[int]:
    """The GPU indices the job's environment names (SLURM_JOB_GPUS)."""
    out = workdir / f"{job}.out"
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = out.read_text() if out.exists() else ""
        m = re.search(r"^COLLOC_TEST_GPUS=([0-9,]*) ", text, re.M)
        if m:
            assert m.group(1), f"job {job} has no SLURM_JOB_GPUS: {text!r}"
            return {int(g) for g in m.group(1).split(",")}
        time.sleep(0.5)
    pytest.fail(f"job {job} printed no GPUs within {timeout} s: {text!r}")


def _idx(spec: str) -> set[int]:
    """``0,2-3`` -> {0, 2, 3}."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _json_gpus(cluster: Cluster, job: int) -> set[int]:
    """The whole GPUs the controller gave the job: ``gres_detail`` ``gpu:N(IDX:...)``."""
    detail = _json_job(cluster, job).get("gres_detail") or []
    found: set[int] = set()
    for entry in detail:
        m = re.match(r"^gpu(?::[^:(]+)?:(\d+)\(IDX:([0-9,-]+)\)$", str(entry))
        if m:
            found |= _idx(m.group(2))
    assert found, f"job {job}: no gpu IDX in gres_detail {detail}"
    return found


@pytest.fixture
def jobs(cluster: Cluster) -> Iterator[list[int]]:
    ids: list[int] = []
    _wait_idle(cluster)
    yield ids
    if ids:
        subprocess.run(["scancel", *map(str, ids)], env=cluster.env(), check=False)
        _wait_idle(cluster, timeout=60)


def _submit(cluster: Cluster, workdir: Path, jobs: list[int], *args: str) -> int:
    j = sbatch(cluster, workdir, BODY, *args)
    jobs.append(j)
    return j


def _two_gpu_job(cluster: Cluster, workdir: Path, jobs: list[int]) -> int:
    w = _submit(cluster, workdir, jobs, *TWO_GPUS)
    info = _json_job(cluster, w)
    # job_submit.lua leaves it as submitted: its GPUs, no shards, no colloc record
    assert info["tres_per_node"] == "gres/gpu:2", info["tres_per_node"]
    assert not str(info.get("admin_comment") or "").startswith("colloc1:")
    return w


def test_two_gpu_job_shares_the_node_but_never_a_shard_gpu(
        cluster: Cluster, workdir: Path, jobs: list[int]) -> None:
    shard_jobs = [_submit(cluster, workdir, jobs, *SHARD) for _ in range(2)]
    _wait_running(cluster, shard_jobs)
    held = {j: _gpus(workdir, j) for j in shard_jobs}
    assert all(len(g) == 1 for g in held.values()), held
    shard_gpus = set().union(*held.values())
    assert len(shard_gpus) <= 2, held  # so at least two of the four GPUs are free

    w = _two_gpu_job(cluster, workdir, jobs)
    # it starts while the shard jobs run (exclusive, it waited for the node to empty)
    _wait_running(cluster, [w], timeout=60)
    assert _states(cluster, shard_jobs) == {j: "RUNNING" for j in shard_jobs}
    whole = _gpus(workdir, w)
    assert len(whole) == 2 and not whole & shard_gpus, (whole, held)
    assert _json_gpus(cluster, w) == whole  # two GPUs, not the node's four

    # the node stays open to shard jobs, on GPUs other than the two-GPU job's
    more = [_submit(cluster, workdir, jobs, *SHARD) for _ in range(2)]
    _wait_running(cluster, more)
    for j in more:
        g = _gpus(workdir, j)
        assert len(g) == 1 and not g & whole, (j, g, whole)
    assert _states(cluster, [w, *shard_jobs]) == {j: "RUNNING" for j in [w, *shard_jobs]}
    assert _json_gpus(cluster, w) == whole


def test_two_gpu_job_waits_while_every_gpu_holds_shards(
        cluster: Cluster, workdir: Path, jobs: list[int]) -> None:
    shard_jobs = [_submit(cluster, workdir, jobs, *SHARD) for _ in range(4)]
    _wait_running(cluster, shard_jobs)
    held = {j: _gpus(workdir, j) for j in shard_jobs}
    by_gpu: dict[int, list[int]] = {}
    for j, g in held.items():
        assert len(g) == 1, held
        by_gpu.setdefault(next(iter(g)), []).append(j)
    # LL_SHARED_GRES (23.11+, in the devcluster's slurm.conf) puts them on four GPUs
    assert sorted(by_gpu) == [0, 1, 2, 3], held

    w = _two_gpu_job(cluster, workdir, jobs)
    # several scheduler and backfill passes (sched_interval=2, bf_interval=5)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        assert _state(cluster, w) == "PENDING", _json_job(cluster, w).get("gres_detail")
        time.sleep(1)
    assert not (workdir / f"{w}.out").exists()

    # free two GPUs of their shards: the two-GPU job gets exactly those
    freed = sorted(by_gpu)[-2:]
    gone = [j for g in freed for j in by_gpu[g]]
    subprocess.run(["scancel", *map(str, gone)], env=cluster.env(), check=True)
    _wait_running(cluster, [w], timeout=90)
    assert _gpus(workdir, w) == set(freed) == _json_gpus(cluster, w)
    kept = [j for j in shard_jobs if j not in gone]
    assert _states(cluster, kept) == {j: "RUNNING" for j in kept}
