"""The devcluster itself: real Slurm, simulated GPUs, accounting, and its failure modes."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.daemons import DaemonError
from slurm_colloc.devcluster.layout import Layout, Spec
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import node_state, sbatch

pytestmark = pytest.mark.devcluster


def test_node_is_idle_with_gpus_and_shards(cluster: Cluster, slurm: SlurmCli) -> None:
    nodes = slurm.nodes()
    assert [n["NodeName"] for n in nodes] == [cluster.spec.node_name]
    assert "gpu:4" in nodes[0]["Gres"] and "shard:156" in nodes[0]["Gres"]  # 4 x 39: reserve, MPS
    assert node_state(cluster) in ("idle", "mix")


def test_simjob_on_a_whole_gpu_completes_in_accounting(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    job = sbatch(cluster, workdir, "colloc-simjob --mem 2G --seconds 1", "--gres=gpu:1")
    assert wait_for_jobs(slurm, [job], timeout=60)[str(job)] == "COMPLETED"
    for _ in range(40):  # slurmdbd lags the controller a little
        recs = slurm.accounting([job])
        if recs and recs[-1].state == "COMPLETED":
            break
        import time

        time.sleep(0.25)
    assert recs[-1].state == "COMPLETED"
    # job_submit gives a one-GPU job all shards of one GPU (22.05 would mix gpu and shard)
    assert "gres/shard=39" in recs[-1].fields["AllocTRES"]
    assert "done:" in (workdir / f"{job}.out").read_text()


def test_simulated_oom_prints_pytorch_text_and_fails(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    job = sbatch(cluster, workdir, "colloc-simjob --mem 2G --peak 48G --seconds 1", "--gres=gpu:1")
    assert wait_for_jobs(slurm, [job], timeout=60)[str(job)] == "FAILED"
    out = (workdir / f"{job}.out").read_text()
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in out
    info = slurm.show_job(job)
    assert info is not None and info["ExitCode"] == "1:0" and info["Restarts"] == "0"


def test_simjob_bad_input_is_exit_2_not_oom(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    job = sbatch(cluster, workdir, "colloc-simjob --mem -3G --seconds 1", "--gres=gpu:1")
    assert wait_for_jobs(slurm, [job], timeout=60)[str(job)] == "FAILED"
    assert slurm.show_job(job)["ExitCode"] == "2:0"  # type: ignore[index]
    assert "OutOfMemoryError" not in (workdir / f"{job}.out").read_text()


def test_up_is_idempotent_and_env_points_at_it(cluster: Cluster) -> None:
    assert cluster.up(install=False) < 5  # already up: returns quickly, changes nothing
    lines = cluster.export_lines()
    assert f"SLURM_CONF={cluster.layout.slurm_conf}" in lines
    assert f"COLLOC_CONF={cluster.layout.colloc_conf}" in lines


SCRATCH = Path("/var/lib/colloc-devcluster-test-scratch")  # munge must reach it


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A root for throwaway clusters, removed afterwards."""
    yield SCRATCH
    shutil.rmtree(SCRATCH, ignore_errors=True)


def test_port_in_use_is_named_and_nothing_is_left_running(scratch: Path) -> None:
    spec = Spec(ctld_port=27817, slurmd_port=27818, dbd_port=27819, mysql_port=24306)
    other = Cluster(Layout(scratch / "dc"), spec)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 27819))
        s.listen()
        with pytest.raises(DaemonError, match=r"slurmdbd: port 27819 on 127\.0\.0\.1 is already in use"):
            other.up(install=False)
    assert all(pid is None for pid in other.status().values())


def test_failing_daemon_is_named_with_its_log(scratch: Path) -> None:
    spec = Spec(ctld_port=27827, slurmd_port=27828, dbd_port=27829, mysql_port=24316)
    broken = Cluster(Layout(scratch / "dc2"), spec)
    # a slurmdbd.conf it refuses: the password file is fine but the DB user is wrong
    orig = broken._create_db_user
    broken._create_db_user = lambda: None  # type: ignore[method-assign]
    try:
        with pytest.raises(DaemonError) as e:
            broken.up(install=False, timeout=15)
    finally:
        broken._create_db_user = orig  # type: ignore[method-assign]
    assert "slurmdbd" in str(e.value) and "slurmdbd.log" in str(e.value)
    assert all(pid is None for pid in broken.status().values())
    broken.down()
