"""``SimBackend``: the GPU backend interface over a simulation state directory.

It reads what simjobs registered (see :mod:`slurm_colloc.gpu.sim.state`) and reports
it the way NVML would: memory used is the driver's reserve, plus what each live MPS
server with clients on the GPU holds, plus every live process's footprint (CUDA
context included, as NVML's per-process figure includes it), SM activity and
utilisation are the tenants' combined as measured (:mod:`.activity`), power follows
the SM activity and the energy counter only ever grows. SM occupancy and DRAM activity are not
modelled and stay ``None`` ("not measured"), like NVML without DCGM. Each process
says whether it is an MPS client (``GpuProcess.mps_client``): a simjob that found no
MPS daemon (its ``CUDA_MPS_PIPE_DIRECTORY`` unset or wrong) is not, as NVML's MPS
process list would tell on a real node. Hard per-cgroup limits are not simulated
(the backend answers "unsupported", like a driver before r615).

MPS servers are listed as the hardware lists them: a live server with clients on the
GPU is a compute process holding ``server_mib`` (what ``memory_used_mib`` counts for
it), and not an MPS client (``mps_client`` False: NVML's MPS list names clients, not
the server). The legacy server runs as its user outside every job's cgroup; the
collector must recognise it as root's control daemon's child
(:meth:`slurm_colloc.metrics.collector.Collector._mps_server`), or it would charge it
to that user's newest job as a process outside MPS. Hiding servers here once kept
every test from seeing that (issue 23).
"""

from __future__ import annotations

import os
import time

from slurm_colloc.gpu.backend import GpuBackend, GpuBackendError, GpuInfo, GpuProcess, GpuSample
from slurm_colloc.gpu.sim.state import (
    SimSpec,
    energy_j,
    gpu_lock,
    gpu_power_w,
    gpu_sm_activity_pct,
    gpu_used_mib,
    gpu_util_pct,
    load_spec,
    mps_servers,
    read_records,
)


class SimBackend(GpuBackend):
    """Simulated GPUs of one node, read from ``state_dir``."""

    name = "sim"

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        """Load the spec now so a missing state dir fails at start-up, not mid-job."""
        self.state_dir = os.fspath(state_dir)
        self.spec: SimSpec = load_spec(self.state_dir)

    def gpus(self) -> list[GpuInfo]:
        """All simulated GPUs."""
        return [
            GpuInfo(
                index=i,
                uuid=self.spec.uuid(i),
                name=self.spec.name,
                memory_total_mib=self.spec.memory_mib,
                minor_number=i,
                pci_bus_id=self.spec.pci_bus_id(i),
                reserved_mib=self.spec.reserved_mib,
            )
            for i in range(self.spec.gpu_count)
        ]

    def sample(self, index: int) -> GpuSample:
        """Current state of GPU ``index``, consistent under its lock."""
        if not 0 <= index < self.spec.gpu_count:
            raise GpuBackendError(f"no simulated GPU {index} (this node has {self.spec.gpu_count})")
        now = time.time()
        with gpu_lock(self.state_dir, index, shared=True) as fd:
            records = read_records(self.state_dir, index)
            energy = energy_j(self.state_dir, self.spec, index, fd, now)
        activity = gpu_sm_activity_pct(records)
        clients = tuple(
            GpuProcess(pid=r.pid, used_mib=r.used_mib, mps_client=r.mps_server > 0)
            for r in records
        )
        listed = {r.pid for r in records}
        servers = tuple(
            GpuProcess(pid=pid, used_mib=self.spec.server_mib, mps_client=False)
            for pid in sorted(mps_servers(records)) if pid not in listed
        )
        return GpuSample(
            index=index,
            timestamp=now,
            memory_used_mib=gpu_used_mib(self.spec, records),
            utilization_pct=gpu_util_pct(records),
            power_w=gpu_power_w(self.spec, records),
            energy_j=energy,
            sm_activity_pct=activity,
            processes=clients + servers,
        )
