"""Where a devcluster keeps its files, and what it was asked to be.

Everything lives under one root directory so that ``down`` can remove it whole and
nothing is written to the host's /etc/slurm, /etc/munge or /var/lib/mysql.
"""

from __future__ import annotations

import json
import re
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.budget import GpuBudget, budget
from slurm_colloc.gpu.sim.state import DEFAULT_RESERVED_MIB

DEFAULT_ROOT = Path("/var/lib/colloc-devcluster")
MAX_NODES = 16
SHARED_PARTITION = "shared"
WHOLE_PARTITION = "gpu"


@dataclass(frozen=True)
class NodePlan:
    """One compute host of the devcluster: its name, address and simulated GPUs."""

    name: str
    index: int
    gpus: int
    gpu_memory_mib: int
    partition: str
    """``shared``/``shared80`` (its GPUs offer shards) or ``gpu``: whole GPUs only on the
    last host of a mixed cluster, GPUs with shards on the one-node lab and on uniform
    hosts (``shards_per_gpu`` says which)."""
    addr: str
    shards_per_gpu: int
    """0 on a whole-GPU node (its gres.conf declares no shards)."""

    @property
    def feature(self) -> str:
        """Node feature naming the GPU size (``gpu40g``), for ``--constraint``."""
        return f"gpu{round(self.gpu_memory_mib / 1024)}g"


_TRES_WEIGHT = re.compile(r"[A-Za-z]+(/[a-z0-9_]+)?=\d{1,7}")


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
    nodes: int = 1
    """Compute hosts. 1: the one-node lab (everything in the host's namespaces, one
    partition ``gpu`` whose GPUs carry shards). 2 or more: the host is the login host and
    controller, and each compute host runs in its own network, mount and UTS namespace
    (private /var/lib/colloc, /tmp and MPS dirs; /home shared): odd-numbered hosts have
    half as many GPUs of twice the memory, and with 3 or more the last host has whole
    GPUs only, in partition ``gpu`` (the default partition), the others in ``shared``
    (the small GPUs) and ``shared80`` (the big ones, with the default GPU size), unless
    ``uniform``."""
    uniform: bool = False
    """With ``nodes`` > 1: every host alike (``gpus`` GPUs of ``gpu_memory_mib``), all in
    one partition ``gpu`` whose GPUs carry shards, as on the one-node lab. Why: a replay
    compares one node with several of the same total capacity, so only the number of
    hosts may differ, not the GPUs' sizes or the partitions a job can reach."""
    mps_protocol: str = "2"
    """``2``: the simulation's legacy MPS stand-in (one server per GPU and user). ``3``:
    its MPS v3 stand-in (one multi-user server per GPU; colloc.conf ``mps_protocol``),
    so a replay can measure both (issue 25 item 3)."""

    spread_shards: bool = True
    """``LL_SHARED_GRES`` where the release has it (shard jobs go to the least-loaded
    GPU); False: Slurm's first fit, which packs (a replay policy measures both)."""
    sm_capacity_pct: int = 0
    """colloc.conf ``sm_capacity_pct`` (compute admission; 0: off), so a replay policy
    can measure it; the table it reads is ``<colloc var>/compute-history``."""
    priority_weight_tres: str = ""
    """slurm.conf ``PriorityWeightTRES`` (with ``PriorityType=priority/multifactor``),
    e.g. ``GRES/shard=10000,GRES/gpu=10000``: jobs asking for more of a GPU go first, so
    a replay can measure size priority against sharing's starvation of big requests.
    Empty: Slurm's default priority (every weight 0: submit order, then nice)."""

    def validate(self) -> None:
        """Refuse shapes Slurm or the simulation cannot represent."""
        if self.priority_weight_tres and not all(
                _TRES_WEIGHT.fullmatch(w) for w in self.priority_weight_tres.split(",")):
            raise ValueError(f"priority_weight_tres {self.priority_weight_tres!r}: "
                             "expected TRES=WEIGHT[,TRES=WEIGHT...]")
        if self.mps_protocol not in ("2", "3"):
            raise ValueError(f"mps_protocol {self.mps_protocol!r}: must be '2' or '3'")
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"--nodes {self.nodes}: must be 1..{MAX_NODES}")
        if self.uniform and self.nodes == 1:
            raise ValueError("--uniform needs --nodes 2 or more (one node is always uniform)")
        if self.nodes > 1 and not self.uniform and 2 * self.gpu_memory_mib > 1 << 20:
            raise ValueError(f"--gpu-memory {self.gpu_memory_mib} MiB: the big nodes have "
                             "twice that; must stay within 1 TiB")
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

    @property
    def multi_node(self) -> bool:
        """Compute hosts in their own namespaces (``nodes`` > 1)."""
        return self.nodes > 1

    def subnet(self) -> str:
        """The /24 of the cluster's bridge, derived from its port so that several
        devclusters (tests) can run side by side: ``10.A.B``."""
        return f"10.{100 + (self.ctld_port >> 8) % 100}.{self.ctld_port & 255}"

    def controller_addr(self) -> str:
        """Where nodes and clients reach slurmctld and slurmdbd."""
        return f"{self.subnet()}.1" if self.multi_node else "127.0.0.1"

    def node_plans(self) -> list[NodePlan]:
        """The compute hosts, in order."""
        if not self.multi_node:
            return [NodePlan(self.node_name, 0, self.gpus, self.gpu_memory_mib,
                             WHOLE_PARTITION, "127.0.0.1", self.shards_per_gpu)]
        prefix = self.node_name.rstrip("0123456789")
        if self.uniform:
            return [NodePlan(f"{prefix}{i}", i, self.gpus, self.gpu_memory_mib, WHOLE_PARTITION,
                             f"{self.subnet()}.{10 + i}", self.shards_per_gpu)
                    for i in range(self.nodes)]
        plans = []
        for i in range(self.nodes):
            big = i % 2 == 1
            whole = self.nodes >= 3 and i == self.nodes - 1
            mem = self.gpu_memory_mib * (2 if big else 1)
            spg = 0 if whole else budget(self.colloc_config(), mem).shards_per_gpu
            part = WHOLE_PARTITION if whole else self.shared_partition_of(mem)
            plans.append(NodePlan(
                f"{prefix}{i}", i, max(1, self.gpus // 2) if big else self.gpus, mem,
                part, f"{self.subnet()}.{10 + i}", spg,
            ))
        return plans

    def shared_partition_of(self, gpu_memory_mib: int) -> str:
        """One shared partition per GPU size (``shared``, ``shared80``): job_submit turns
        a one-GPU job into all the shards of one GPU of its partition, which is only
        a whole GPU where every GPU of the partition has that size."""
        if gpu_memory_mib == self.gpu_memory_mib:
            return SHARED_PARTITION
        return f"{SHARED_PARTITION}{round(gpu_memory_mib / 1024)}"

    def shared_partitions(self) -> list[str]:
        """``shared_partitions`` of the cluster's colloc.conf (see config.py), smallest
        GPUs first (a --colloc job goes to every one that holds it, in this order)."""
        if not self.multi_node or self.uniform:
            return [WHOLE_PARTITION]  # one partition, its GPUs carry shards
        sizes = sorted({n.gpu_memory_mib for n in self.node_plans() if n.shards_per_gpu})
        return [f"{self.shared_partition_of(m)}:{m}" for m in sizes]

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
    def lab_bin(self) -> Path:
        """The simulation's executables (``colloc-simjob``, the MPS stand-ins): the lab's
        own, first on the jobs' PATH, never in a site's wheel (slurm_colloc.gpu.sim.tools)."""
        return self.root / "lab-bin"

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

    @property
    def mps_root(self) -> Path:
        return self.run / "mps"

    @property
    def tmp(self) -> Path:
        """The host's /tmp (compute hosts get their own bound over it)."""
        return Path("/tmp")

    def node_dir(self, node: str) -> Path:
        """A compute host's private files (bound over the shared paths in its namespace)."""
        return self.root / "nodes" / node

    def node_private(self, node: str) -> list[tuple[Path, Path]]:
        """(source, target) bind mounts that make a compute host's state its own."""
        d = self.node_dir(node)
        return [
            (d / "colloc", self.colloc_var),
            (d / "sim", self.sim),
            (d / "mps", self.mps_root),
            (d / "tmp", self.tmp),
        ]

    def gpu_device(self, index: int, node: str | None = None) -> Path:
        """The character device standing in for /dev/nvidiaN (per host when several)."""
        return (self.dev / node if node else self.dev) / f"nvidia{index}"


def controller_hostname() -> str:
    """slurmctld insists that SlurmctldHost names the machine it runs on."""
    return socket.gethostname().split(".")[0]
