"""The node's GPUs in Slurm's order, as root's node scripts need them (cached per boot).

The prolog must give MPS and the job the GPU's UUID, not Slurm's index (NVIDIA's MPS
docs: a daemon's visible devices are remapped for its clients, and an index is no
identity). Asking NVML costs an NVML initialisation in every prolog; the answer only
changes when GPUs are replaced or re-enumerated, which takes a reboot. So the map is
kept in root-owned state (``mps_root/gpus.json``, 0600) keyed by the kernel's boot id
and rebuilt when the boot id differs or the file is unusable. Nothing here is in a
directory a user can write.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuInfo
from slurm_colloc.gpu.identity import GpuMap
from slurm_colloc.mps.control import read_small_file

CACHE_FILE = "gpus.json"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This boot's id (changes at every reboot); empty when unreadable."""
    try:
        return Path(BOOT_ID).read_text()[:64].strip()
    except OSError:
        return ""


def _load(path: Path, boot: str) -> GpuMap | None:
    try:
        data = json.loads(read_small_file(path, owner=os.geteuid(), limit=1 << 16))
        if not isinstance(data, dict) or not boot or data.get("boot_id") != boot:
            return None
        return GpuMap.from_gpus([GpuInfo(**g) for g in data["gpus"]])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save(path: Path, boot: str, gpus: list[GpuInfo]) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"boot_id": boot, "gpus": [asdict(g) for g in gpus]}))
    os.replace(tmp, path)


def node_gpu_map(cfg: CollocConfig, *, refresh: bool = False) -> GpuMap:
    """The node's :class:`GpuMap`, from the per-boot cache or the GPU backend.

    Raises :class:`~slurm_colloc.gpu.backend.GpuBackendError` when the backend cannot
    answer (and there is no cache), and ``GpuIdentityError`` when Slurm's order cannot
    be established.
    """
    root = Path(cfg.mps_root)
    path = root / CACHE_FILE
    boot = boot_id()
    cache = cfg.gpu_backend == "nvml"  # the sim reads one small file anyway, and a
    # devcluster re-creates its GPUs (new UUIDs) without a reboot
    if cache and not refresh:
        cached = _load(path, boot)
        if cached is not None:
            return cached
    from slurm_colloc.gpu.select import gpus_from_config

    gpus = gpus_from_config(cfg)
    gmap = GpuMap.from_gpus(gpus)
    with contextlib.suppress(OSError):
        if cache and root.is_dir() and not root.is_symlink():
            _save(path, boot, gpus)
    return gmap
