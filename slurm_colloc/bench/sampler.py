"""GPU time series of a simulated cluster's GPUs, sampled like a DCGM exporter would."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from slurm_colloc.bench.collect import GpuLedger
from slurm_colloc.gpu.backend import GpuBackendError
from slurm_colloc.gpu.sim.backend import SimBackend
from slurm_colloc.gpu.sim.state import read_records


@dataclass(frozen=True)
class GpuPoint:
    """One sample of one GPU."""

    t: float
    """Unix time (wall)."""
    gpu: int
    """Index across hosts: a host's GPU ``i`` is ``i`` plus the GPUs of the hosts before it."""
    memory_mib: int
    sm_pct: float
    power_w: float
    energy_j: float
    """Cumulative energy counter, joules of *trace* time (the sim integrates power over
    the time scale, as the real GPU would over the uncompressed run)."""
    processes: int


class GpuSampler:
    """A background thread sampling every GPU of some sim state dirs every ``period`` s.

    One state dir per host, in host order; their GPUs are numbered on from the previous
    host's (a time series and a start-lag ledger need one name per GPU of the cluster).
    """

    def __init__(self, state_dirs: Path | Sequence[Path], period: float = 1.0) -> None:
        """Open the sim backends now (a bad state dir fails before the replay)."""
        dirs = [state_dirs] if isinstance(state_dirs, Path) else list(state_dirs)
        self.hosts: list[tuple[Path, SimBackend, int]] = []
        offset = 0
        for d in dirs:
            backend = SimBackend(d)
            self.hosts.append((d, backend, offset))
            offset += len(backend.gpus())
        self.period = period
        self.points: list[GpuPoint] = []
        self.ledger = GpuLedger()
        """When each job first had a process on a GPU (its start lag, to the ms)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)

    def sample_once(self) -> None:
        """Take one sample of every GPU, and note which jobs have processes on them."""
        for state_dir, backend, offset in self.hosts:
            try:
                samples = backend.sample_all()
                self.ledger.observe(read_records(state_dir, clean=False), time.time(),
                                    gpu_offset=offset)
            except (GpuBackendError, OSError):
                continue
            for s in samples:
                self.points.append(GpuPoint(
                    s.timestamp, offset + s.index, s.memory_used_mib,
                    s.sm_activity_pct or 0.0, s.power_w or 0.0, s.energy_j or 0.0,
                    len(s.processes),
                ))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.period)

    def start(self) -> None:
        """Start sampling."""
        self.sample_once()
        self._thread.start()

    def stop(self) -> None:
        """Stop and take a last sample."""
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample_once()
