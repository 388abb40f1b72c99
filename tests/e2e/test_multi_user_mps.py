"""Two users' jobs on one GPU: legacy per-user MPS servers versus one MPS v3 server.

Legacy MPS runs one server per user, so two users' jobs on a GPU are separate contexts
the driver time-slices; MPS v3 runs one multi-user server per GPU whose clients run
concurrently (docs/node.md, "MPS layout and the multi-user decision"). The simulation
models the difference; this runs the same pair of jobs both ways through the real
Slurm node path and compares the speeds the jobs report.
"""

from __future__ import annotations

import re
from pathlib import Path

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.node.mps_protocol import v3_node
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import ensure_user, sbatch
from tests.e2e.test_node_path import _gpu_of, _one_gpu_with_room, _wait_running

USERS = ("colloc-u1", "colloc-u2")
JOB = ('echo "PIPE=$CUDA_MPS_PIPE_DIRECTORY PROTO=${COLLOC_MPS_PROTOCOL:-2}"\n'
       "colloc-simjob --mem 3G --sm-activity 90 --seconds 6")


def _pair(cluster: Cluster, slurm: SlurmCli, workdir: Path) -> list[str]:
    """Submit one job per user; both must run together on one GPU and complete."""
    for u in USERS:
        ensure_user(cluster, u)
    with _one_gpu_with_room(cluster, slurm, workdir):  # least-loaded placement spreads
        jobs = [sbatch(cluster, workdir, JOB, "--gres=shard:4", user=u) for u in USERS]
        _wait_running(slurm, jobs)
    gpus = [_gpu_of(slurm, j) for j in jobs]
    states = wait_for_jobs(slurm, jobs, timeout=120)
    outs = [(workdir / f"{j}.out").read_text() for j in jobs]
    assert set(states.values()) == {"COMPLETED"}, (states, outs)
    assert None not in gpus and len(set(gpus)) == 1, gpus  # one GPU, two users
    assert all("co-tenants 1" in o for o in outs), outs
    return outs


def _speed(out: str) -> float:
    m = re.search(r"mean speed ([0-9.]+)x", out)
    assert m, out
    return float(m.group(1))


def _v3_conf(text: str) -> str:
    """The devcluster's colloc.conf switched to MPS v3 (its stand-in)."""
    control = re.search(r'^mps_control = "(.*)"$', text, re.M)
    assert control, text
    lines = [ln for ln in text.splitlines() if not ln.startswith(("mps_control", "mps_protocol"))]
    return "\n".join([f'mps_control = "{control.group(1)}-v3"', 'mps_protocol = "3"', *lines]) + "\n"


def test_two_users_share_one_server_under_v3_and_time_slice_under_legacy_mps(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    legacy = _pair(cluster, slurm, workdir)
    assert all("PROTO=2" in o for o in legacy)
    assert len({re.search(r"PIPE=(\S+)", o).group(1) for o in legacy}) == 2  # type: ignore[union-attr]

    conf = cluster.layout.colloc_conf
    original = conf.read_text()
    conf.write_text(_v3_conf(original))
    try:
        shared = _pair(cluster, slurm, workdir)
    finally:
        cfg = cfgmod.load(conf)
        conf.write_text(original)
        v3_node(cfg).stop()
    assert all("PROTO=3" in o for o in shared), shared
    pipes = [re.search(r"PIPE=(\S+)", o).group(1) for o in shared]  # type: ignore[union-attr]
    assert all("/v3/pipe/gpu" in p for p in pipes) and len(set(pipes)) == 2  # a namespace each
    assert len({str(Path(p).parent) for p in pipes}) == 1  # ... of one server
    slow, fast = min(map(_speed, legacy)), min(map(_speed, shared))
    # the sim's models for two 90 % jobs: 0.53x time-sliced, 0.72x in one server
    assert fast > slow + 0.08, (legacy, shared)
