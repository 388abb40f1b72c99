"""Per GPU model and per node settings on the devcluster (issue 26 item 6): the pinned
memory limit the prolog gives a shard job follows ``[gpu_types."MODEL"]`` and, above
it, ``[nodes."HOSTLIST"]`` in colloc.conf, which the prolog reads for every job."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.gpu.select import backend_from_config
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import sbatch

pytestmark = pytest.mark.devcluster

SHOW_LIMIT = 'echo "LIMIT=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"'


def _limit_of(cluster: Cluster, slurm: SlurmCli, workdir: Path) -> str:
    """The pinned limit a two-shard job is given, as its environment shows it."""
    job = sbatch(cluster, workdir, SHOW_LIMIT, "--gres=shard:2")
    assert wait_for_jobs(slurm, [job], timeout=60)[str(job)] == "COMPLETED"
    out = (workdir / f"{job}.out").read_text()
    return next((line for line in out.splitlines() if line.startswith("LIMIT=")), out)


def test_node_table_over_model_table_sets_the_pinned_limit(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    conf = cluster.layout.colloc_conf
    original = conf.read_text()
    cfg = cfgmod.load(conf)
    backend = backend_from_config(cfg)
    try:
        model = backend.gpus()[0].name  # the name the prolog's backend reports
    finally:
        backend.close()
    shards_mib = 2 * cfg.shard_mib
    by_model = original + f'\n[gpu_types."{model.upper()}"]\ncuda_context_mib = 300\n'
    by_node = by_model + f'\n[nodes."{cluster.spec.node_name},other[01-03]"]\n' \
                         "cuda_context_mib = 200\n"
    try:
        conf.write_text(by_model)
        assert _limit_of(cluster, slurm, workdir) == f"LIMIT=0={shards_mib - 300}M"
        conf.write_text(by_node)
        assert _limit_of(cluster, slurm, workdir) == f"LIMIT=0={shards_mib - 200}M"
    finally:
        conf.write_text(original)
    assert _limit_of(cluster, slurm, workdir) == \
        f"LIMIT=0={shards_mib - cfg.cuda_context_mib}M"  # the global key again
