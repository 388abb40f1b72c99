"""GPU memory budget: what of a GPU's memory jobs can have, and a job's pinned limit.

A GPU's memory is not all the jobs': the driver and firmware reserve some
(``reserved``), every MPS server holds some outside every client's limit, and every
client process's CUDA context takes device memory that MPS's pinned limit does not
count. Handing out ``total // shard`` shards over-commits the GPU (40 one-GiB shards on
a 40 GiB A100 leave nothing for contexts and servers), so jobs within their limits
run out anyway. This module is the one place that arithmetic lives:

* ``usable_mib = total - reserved - servers_per_gpu x server``: what shards divide;
* ``shards_per_gpu = usable_mib // shard_mib``: gres.conf, job_submit.lua, doctor;
* ``pinned_limit_mib(shards) = shards x shard_mib - context``: what the prolog gives a
  client as ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, so that allocations plus context
  (what NVML shows for the job, and what the estimator predicts) fit its shards.

The overheads come from :class:`~slurm_colloc.config.CollocConfig` (defaults are
estimates; ``colloc selftest --gpu`` measures them on a site's GPUs) and, for the
reserved memory, from the backend (NVML ``nvmlDeviceGetMemoryInfo_v2``) unless the
site overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuInfo


class BudgetError(ValueError):
    """The overheads leave no room for even one shard."""


@dataclass(frozen=True)
class GpuBudget:
    """The memory arithmetic of one GPU model under one configuration."""

    total_mib: int
    reserved_mib: int
    server_mib: int
    servers: int
    context_mib: int
    shard_mib: int

    @property
    def usable_mib(self) -> int:
        """Memory left for jobs' shards after the driver's and the MPS servers' part."""
        return self.total_mib - self.reserved_mib - self.servers * self.server_mib

    @property
    def shards_per_gpu(self) -> int:
        """Whole shards the GPU offers (what gres.conf declares for it)."""
        return max(0, self.usable_mib // self.shard_mib)

    def pinned_limit_mib(self, shards: int) -> int:
        """A job's pinned limit: its shards' memory less one CUDA context (min. 1 MiB).

        A one-shard job on a site whose context is larger than a shard would get
        nothing; it gets 1 MiB and fails at its first allocation, which is what its
        request means on a real GPU (the report says to ask for more).
        """
        return max(1, shards * self.shard_mib - self.context_mib)

    def check(self) -> None:
        """Raise :class:`BudgetError` when the GPU cannot hold one shard and a context."""
        if self.shards_per_gpu < 1:
            raise BudgetError(
                f"a {self.total_mib} MiB GPU less {self.reserved_mib} MiB reserved and "
                f"{self.servers} x {self.server_mib} MiB of MPS servers leaves "
                f"{self.usable_mib} MiB: not one shard of {self.shard_mib} MiB"
            )
        if self.context_mib >= self.shard_mib * self.shards_per_gpu:
            raise BudgetError(
                f"cuda_context_mib = {self.context_mib} is not smaller than a whole GPU's "
                f"shards ({self.shards_per_gpu} x {self.shard_mib} MiB)"
            )


def budget(cfg: CollocConfig, total_mib: int, reserved_mib: int = 0) -> GpuBudget:
    """The budget of a GPU of ``total_mib``; ``reserved_mib`` as the backend reports it.

    ``cfg.gpu_reserved_mib`` (when not 0) overrides the backend's figure: some drivers
    report no reserved memory although they keep some.
    """
    return GpuBudget(
        total_mib=total_mib,
        reserved_mib=cfg.gpu_reserved_mib or reserved_mib,
        server_mib=cfg.mps_server_mib,
        servers=cfg.mps_servers_per_gpu,
        context_mib=cfg.cuda_context_mib,
        shard_mib=cfg.shard_mib,
    )


def budget_of(cfg: CollocConfig, gpu: GpuInfo) -> GpuBudget:
    """The budget of one GPU the backend described."""
    return budget(cfg, gpu.memory_total_mib, gpu.reserved_mib)


def config_budget(cfg: CollocConfig) -> GpuBudget | None:
    """The budget of the site's GPU from colloc.conf alone (``gpu_memory_mib``).

    For readers that must not touch a GPU (the report, the admin view, an epilog whose
    backend failed); None when the site left ``gpu_memory_mib`` at 0.
    """
    if cfg.gpu_memory_mib <= 0:
        return None
    return budget(cfg, cfg.gpu_memory_mib)
