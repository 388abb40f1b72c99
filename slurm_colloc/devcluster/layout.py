"""Where a devcluster keeps its files, and what it was asked to be.

Everything lives under one root directory so that ``down`` can remove it whole and
nothing is written to the host's /etc/slurm, /etc/munge or /var/lib/mysql.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.budget import GpuBudget, budget
from slurm_colloc.gpu.sim.state import DEFAULT_RESERVED_MIB

DEFAULT_ROOT = Path("/var/lib/colloc-devcluster")


@dataclass(frozen=True)
class Spec:
    """The shape of the simulated cluster (persisted so ``status``/``down`` know it)."""

    gpus: int = 4
    gpu_memory_mib: int = 40960
    shard_mib: int = 1024
    cpus: int = 32
    memory_mib: int = 65536
    node_name: str = "colloc-node0"
    cluster_name: str = "colloc"
    ctld_port: int = 16817
    slurmd_port: int = 16818
    dbd_port: int = 16819
    mysql_port: int = 13306
    node_scripts: bool = True
    """Wire colloc's Prolog/Epilog/TaskProlog into slurm.conf (off: plain Slurm)."""

    def validate(self) -> None:
        """Refuse shapes Slurm or the simulation cannot represent."""
        if not 1 <= self.gpus <= 64:
            raise ValueError(f"--gpus {self.gpus}: must be 1..64")
        if not 1024 <= self.gpu_memory_mib <= 1 << 20:
            raise ValueError(f"--gpu-memory {self.gpu_memory_mib} MiB: must be 1 GiB..1 TiB")
        if self.shards_per_gpu < 1:
            raise ValueError("shard size larger than what jobs can use of a GPU")
        ports = [self.ctld_port, self.slurmd_port, self.dbd_port, self.mysql_port]
        if len(set(ports)) != len(ports) or not all(1024 < p < 65536 for p in ports):
            raise ValueError(f"ports must be distinct and in 1025..65535: {ports}")

    @property
    def shards_per_gpu(self) -> int:
        """Shards one GPU offers: whole shards of what jobs can use of it (the simulated
        GPU keeps a driver reserve and MPS servers take memory, as real ones do)."""
        return self.budget().shards_per_gpu

    def colloc_config(self) -> CollocConfig:
        """The memory settings the devcluster's colloc.conf carries."""
        return CollocConfig(shard_mib=self.shard_mib, gpu_memory_mib=self.gpu_memory_mib,
                            gpu_reserved_mib=DEFAULT_RESERVED_MIB)

    def budget(self) -> GpuBudget:
        """The simulated GPUs' memory arithmetic (:mod:`slurm_colloc.gpu.budget`)."""
        return budget(self.colloc_config(), self.gpu_memory_mib)

    def to_json(self) -> str:
        """Serialise for the root directory's spec.json."""
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Spec:
        """Inverse of :meth:`to_json`."""
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Layout:
    """Paths of one devcluster under its root."""

    root: Path

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def colloc_conf(self) -> Path:
        return self.etc / "colloc.conf"

    @property
    def spec_file(self) -> Path:
        return self.root / "spec.json"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def munge(self) -> Path:
        return self.root / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge / "munge.socket"

    @property
    def mysql(self) -> Path:
        return self.root / "mysql"

    @property
    def mysql_socket(self) -> Path:
        return self.mysql / "mysqld.sock"

    @property
    def slurm_state(self) -> Path:
        return self.root / "state"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def sim(self) -> Path:
        return self.root / "sim"

    @property
    def colloc_var(self) -> Path:
        return self.root / "colloc"

    def gpu_device(self, index: int) -> Path:
        """The character device standing in for /dev/nvidiaN."""
        return self.dev / f"nvidia{index}"


def controller_hostname() -> str:
    """slurmctld insists that SlurmctldHost names the machine it runs on."""
    return socket.gethostname().split(".")[0]
