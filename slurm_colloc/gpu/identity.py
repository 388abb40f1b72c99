"""Which physical GPU is Slurm's GPU index N on this node.

Three numberings of one node's GPUs disagree, and mixing them up puts a job's MPS
server, memory limit and OOM evidence on a GPU the job was never given:

* **NVML's index** (``nvidia-smi``, :attr:`GpuInfo.index`): PCI bus id order.
* **CUDA's device number**: fastest GPU first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``;
  only meaningful inside one process's ``CUDA_VISIBLE_DEVICES``.
* **Slurm's GPU index** (gres bitmap, ``SLURM_JOB_GPUS``, the cgroup device list):
  the order of the GPUs' device files. Slurm sorts a node's gpu records by ``File``
  in natural order (``strnatcmp``: ``/dev/nvidia2`` before ``/dev/nvidia10``), and
  ``AutoDetect=nvml`` names the file ``/dev/nvidia<nvmlDeviceGetMinorNumber>``. So
  Slurm's order is minor-number order.

The minor number is assigned at boot in the order the driver finds the devices; an
NVIDIA maintainer says it often equals the NVML index but is not guaranteed to, nor
to stay the same across reboots (NVIDIA/nvidia-docker#1432). A real case where it
does not follow PCI order: 4x H100 NVL, Slurm 24.11 (ceems-dev/ceems discussion 513).
So a map is good for one boot at most, and the UUID is what crosses process and
node-reboot boundaries.

Some Slurm versions re-sort AutoDetected GPUs by their NVLink ``Links`` matrix (a
stand-in for PCI order). A node where that differs from minor order is exactly what
:func:`check_gres_files` reports when given the files in the order ``slurmd -G``
prints them.

A backend that knows no minor numbers at all (no device files to name) has its NVML
order as Slurm's order; :attr:`GpuMap.by_minor` says which rule built a map.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from slurm_colloc.gpu.backend import GpuBackend, GpuInfo

_DEVICE_FILE = re.compile(r"^nvidia(\d+)$")


class GpuIdentityError(RuntimeError):
    """Slurm's GPU index cannot be tied to a physical GPU with certainty."""


def _describe(g: GpuInfo) -> str:
    minor = "?" if g.minor_number is None else str(g.minor_number)
    pci = f", PCI {g.pci_bus_id}" if g.pci_bus_id else ""
    return f"NVML index {g.index} (/dev/nvidia{minor}, {g.uuid}{pci})"


def slurm_order(gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
    """The node's GPUs in Slurm's index order (position N = Slurm's GPU N).

    Partly known minor numbers raise instead of guessing: a GPU placed at the wrong
    position would silently swap two jobs' GPUs. All unknown (a backend without
    device files) means NVML order.
    """
    missing = [g for g in gpus if g.minor_number is None]
    if len(missing) == len(gpus):
        return sorted(gpus, key=lambda g: g.index)
    if missing:
        raise GpuIdentityError(
            "NVML gave no minor number (nvmlDeviceGetMinorNumber) for "
            + ", ".join(_describe(g) for g in missing)
            + " but did for the other GPUs, so Slurm's GPU order cannot be derived; "
            "check `nvidia-smi -q | grep -i minor` and the driver on this node"
        )
    seen: dict[int, GpuInfo] = {}
    for g in gpus:
        assert g.minor_number is not None  # narrowed above; for mypy
        if g.minor_number in seen:
            raise GpuIdentityError(
                f"two GPUs report minor number {g.minor_number}: "
                f"{_describe(seen[g.minor_number])} and {_describe(g)}; "
                "NVML's view of this node is inconsistent (driver reload needed?)"
            )
        seen[g.minor_number] = g
    return [seen[m] for m in sorted(seen)]


def _out_of_range(index: int, count: int) -> GpuIdentityError:
    if not count:
        return GpuIdentityError(
            f"Slurm GPU index {index} does not exist on this node: NVML sees no GPUs"
        )
    return GpuIdentityError(
        f"Slurm GPU index {index} does not exist on this node: NVML sees {count} GPU(s) "
        f"(Slurm indices 0-{count - 1}); if Slurm declares more, a GPU has fallen off "
        "the bus or gres.conf is wrong: compare `nvidia-smi -L` with `slurmd -G`"
    )


def gpu_for_slurm_index(gpus: Sequence[GpuInfo], index: int) -> GpuInfo:
    """The GPU that Slurm calls ``index`` on this node."""
    order = slurm_order(gpus)
    if not 0 <= index < len(order):
        raise _out_of_range(index, len(order))
    return order[index]


@dataclass(frozen=True)
class GpuMap:
    """Slurm index <-> NVML index <-> UUID for one node, built once per process."""

    gpus: tuple[GpuInfo, ...]
    """In Slurm's index order (position N is Slurm's GPU N)."""
    by_minor: bool
    """True: ordered by minor number (real GPUs); False: NVML order (no minors known)."""

    @classmethod
    def from_gpus(cls, gpus: Sequence[GpuInfo]) -> GpuMap:
        """Map the GPUs a backend reported (raises :class:`GpuIdentityError`)."""
        order = slurm_order(gpus)
        return cls(tuple(order), any(g.minor_number is not None for g in order))

    @classmethod
    def from_backend(cls, backend: GpuBackend) -> GpuMap:
        """Map the backend's GPUs as it sees them now."""
        return cls.from_gpus(backend.gpus())

    def __len__(self) -> int:
        return len(self.gpus)

    def by_slurm_index(self, slurm_index: int) -> GpuInfo:
        """The GPU Slurm calls ``slurm_index`` (no negative indexing: -1 is an error)."""
        if not 0 <= slurm_index < len(self.gpus):
            raise _out_of_range(slurm_index, len(self.gpus))
        return self.gpus[slurm_index]

    def nvml_index(self, slurm_index: int) -> int:
        """NVML's index (what the backend samples by) of Slurm's GPU ``slurm_index``."""
        return self.by_slurm_index(slurm_index).index

    def uuid(self, slurm_index: int) -> str:
        """``GPU-...`` of Slurm's GPU ``slurm_index`` (for CUDA_VISIBLE_DEVICES, MPS)."""
        return self.by_slurm_index(slurm_index).uuid

    def slurm_index_of_uuid(self, uuid: str) -> int:
        """Slurm's index of the GPU with this UUID (case and spaces ignored)."""
        want = uuid.strip().lower()
        for i, g in enumerate(self.gpus):
            if g.uuid.lower() == want:
                return i
        raise GpuIdentityError(
            f"no GPU with UUID {uuid!r} on this node (known: "
            + (", ".join(g.uuid for g in self.gpus) or "none")
            + "); a MIG UUID or another node's GPU?"
        )

    def slurm_index_of_nvml(self, nvml_index: int) -> int:
        """Slurm's index of NVML's GPU ``nvml_index`` (samples come by NVML index)."""
        for i, g in enumerate(self.gpus):
            if g.index == nvml_index:
                return i
        raise GpuIdentityError(
            f"no GPU with NVML index {nvml_index} on this node ({len(self.gpus)} GPU(s))"
        )


def device_file_minor(path: str) -> int | None:
    """N of ``/dev/nvidiaN``; None for anything else (``nvidiactl``, MIG caps, typos)."""
    m = _DEVICE_FILE.match(os.path.basename(path.strip()))
    return int(m.group(1)) if m else None


def check_gres_files(gpus: Sequence[GpuInfo], files: Sequence[str]) -> list[str]:
    """Problems between Slurm's GPU device files and the GPUs NVML shows (empty: none).

    ``files`` are the node's gpu ``File`` entries in Slurm's index order, one per GPU
    (ranges already expanded; ``slurmd -G`` prints them in that order). Position N
    must be the device file of the GPU this module calls Slurm's GPU N; where it is
    not, colloc and Slurm disagree about which GPU a job holds. For ``colloc admin
    doctor``, so it never raises.
    """
    try:
        order = slurm_order(gpus)
    except GpuIdentityError as e:
        return [str(e)]
    problems: list[str] = []
    if not any(g.minor_number is not None for g in order):
        return ["NVML reports no minor numbers for this node's GPUs, so the device files "
                "Slurm uses cannot be checked"] if order else []
    if len(files) != len(order):
        problems.append(
            f"Slurm has {len(files)} GPU device file(s) for this node but NVML sees "
            f"{len(order)} GPU(s): make gres.conf File= match `nvidia-smi -L`"
        )
    known = {g.minor_number: g for g in order}
    first_pos: dict[int, int] = {}
    for pos, path in enumerate(files):
        minor = device_file_minor(path)
        if minor is None:
            problems.append(
                f"Slurm GPU {pos}: {path!r} is not a whole-GPU device file (/dev/nvidiaN)"
            )
            continue
        if minor in first_pos:
            problems.append(
                f"Slurm GPU {pos}: {path} is listed again (already Slurm GPU "
                f"{first_pos[minor]}): one GPU counted twice"
            )
            continue
        first_pos[minor] = pos
        if minor not in known:
            problems.append(
                f"Slurm GPU {pos}: {path} belongs to no GPU NVML sees (minors: "
                + ", ".join(str(m) for m in sorted(m for m in known if m is not None))
                + ")"
            )
            continue
        if pos < len(order) and order[pos].minor_number != minor:
            problems.append(
                f"Slurm GPU {pos} is {path} ({_describe(known[minor])}) but colloc maps "
                f"Slurm GPU {pos} to {_describe(order[pos])}: Slurm does not order this "
                "node's GPUs by minor number; list File= in minor order or report it"
            )
    for minor, g in known.items():
        if minor not in first_pos:
            problems.append(f"{_describe(g)} has no device file in Slurm's GPU list")
    return problems
