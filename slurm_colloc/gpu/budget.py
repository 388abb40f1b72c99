"""GPU memory budget: what of a GPU's memory jobs can have, and a job's pinned limit.

A GPU's memory is not all the jobs': the driver and firmware reserve some
(``reserved``), every MPS server holds some outside every client's limit, and every
client process's CUDA context takes device memory that MPS's pinned limit does not
count. Handing out ``total // shard`` shards over-commits the GPU (40 one-GiB shards on
a 40 GiB A100 leave nothing for contexts and servers), so jobs within their limits
run out anyway. This module is the one place that arithmetic lives:

* ``shards_per_gpu``: the most shards ``S`` with ``reserved + S x shard +
  servers(S) x server <= total``, where ``servers(S)`` is how many MPS servers ``S``
  shard jobs can bring: one per job (each may be another user's, and legacy MPS runs
  one server per user on a GPU) capped at ``mps_servers_per_gpu`` when that is not 0
  (a site's promise, e.g. MPS v3's one server per GPU); gres.conf, job_submit.lua,
  doctor;
* ``usable_mib = total - reserved - servers(S) x server``: what the shards divide;
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
from slurm_colloc.gpu_settings import effective, local_node


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

    def servers_for(self, shards: int) -> int:
        """MPS servers that ``shards`` shard jobs can hold on the GPU at once.

        Every job may be another user's, and legacy MPS runs one server per user on a
        GPU: one server per job, unless ``servers`` (``mps_servers_per_gpu``) caps it.
        Budgeting fewer lets jobs within their limits run the GPU out of memory once
        more users than budgeted share it (issue 24: a third user's job on an 80 GB
        GPU whose shards leave 23 MiB of slack).
        """
        jobs = max(0, shards)
        return jobs if self.servers <= 0 else min(jobs, self.servers)

    def _fits(self, shards: int) -> bool:
        need = shards * self.shard_mib + self.servers_for(shards) * self.server_mib
        return self.reserved_mib + need <= self.total_mib

    @property
    def shards_per_gpu(self) -> int:
        """Whole shards the GPU offers (what gres.conf declares for it): the most whose
        jobs, each with its server, fit beside the driver's reserve."""
        shards = max(0, (self.total_mib - self.reserved_mib) // self.shard_mib)
        while shards > 0 and not self._fits(shards):
            shards -= 1
        return shards

    @property
    def usable_mib(self) -> int:
        """Memory left for jobs' shards after the driver's and the MPS servers' part."""
        servers = self.servers_for(self.shards_per_gpu)
        return self.total_mib - self.reserved_mib - servers * self.server_mib

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


def budget_of(cfg: CollocConfig, gpu: GpuInfo, node: str | None = None) -> GpuBudget:
    """The budget of one GPU the backend described, on ``node`` (default: this one).

    The overheads are the ones colloc.conf sets for this GPU's model and this node
    (``gpu_types``, ``nodes``; :mod:`slurm_colloc.gpu_settings`).
    """
    where = local_node() if node is None else node
    return budget(effective(cfg, node=where, model=gpu.name), gpu.memory_total_mib,
                  gpu.reserved_mib)


def config_budget(cfg: CollocConfig) -> GpuBudget | None:
    """The budget of the site's GPU from colloc.conf alone (``gpu_memory_mib``).

    For readers that must not touch a GPU (the report, the admin view, an epilog whose
    backend failed); None when the site left ``gpu_memory_mib`` at 0. Global keys:
    pass ``effective(cfg, node=..., model=None)`` for a node's own.
    """
    if cfg.gpu_memory_mib <= 0:
        return None
    return budget(cfg, cfg.gpu_memory_mib)
