"""What a node script knows about its job: Slurm's environment plus one scontrol call.

Prolog and Epilog get a small environment from slurmd (SLURM_JOB_ID, SLURM_JOB_UID,
SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES, SPANK_* option values) and no PATH. The rest
(shard count, the GPU index of a shard job, output paths, restarts, colloc's
submit-time record) comes from one ``scontrol -d show job`` through the adapter.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slurm_colloc.slurm.adapter import SlurmAdapter

_GRES_IDX = re.compile(r"\b(gpu|shard)(?::[^:(\s]+)?:(\d+)\(IDX:([0-9,\-]+)\)")
_TRES_SHARD = re.compile(r"gres[:/]shard(?::[^:,\s]+)?[:=](\d+)")
_TRES_GPU = re.compile(r"gres[:/]gpu(?::[^:,\s]+)?[:=](\d+)")


class JobInfoError(ValueError):
    """The job's environment or controller record is not what a node script needs."""


def _indices(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


@dataclass(frozen=True)
class JobContext:
    """The facts about one job that the node scripts act on."""

    job_id: int
    uid: int
    user: str
    node: str
    gpus: tuple[int, ...]
    """GPU indices bound to the job on this node (whole GPUs, or the shards' GPU)."""
    shards: int
    """Shards per node requested (0: not a shard job)."""
    gpu_count: int
    """Whole GPUs requested per node (0: none)."""
    stdout: str | None
    stderr: str | None
    restarts: int
    admin_comment: str
    exit_code: str
    state: str

    @property
    def whole_gpu(self) -> bool:
        """job_submit turned a one-GPU request into all shards of a GPU (mode=whole)."""
        from slurm_colloc.site.record import parse_record

        rec = parse_record(self.admin_comment)
        return rec is not None and rec.mode == "whole"

    @property
    def is_shared(self) -> bool:
        """A shard job: it shares its GPU and runs under MPS."""
        return self.shards > 0 and self.gpu_count == 0 and not self.whole_gpu

    @property
    def gpu(self) -> int | None:
        """The one GPU of a shard job (shards of one job always sit on one GPU)."""
        return self.gpus[0] if self.gpus else None


def from_slurm(env: Mapping[str, str], adapter: SlurmAdapter) -> JobContext:
    """Build the context from the node script's environment and ``scontrol show job``."""
    try:
        job_id = int(env["SLURM_JOB_ID"])
        uid = int(env["SLURM_JOB_UID"])
    except (KeyError, ValueError) as e:
        raise JobInfoError(f"SLURM_JOB_ID/SLURM_JOB_UID missing or malformed: {e}") from e
    rec: dict[str, Any] = adapter.show_job(job_id) or {}
    return context_from_record(job_id, uid, env, rec)


def context_from_record(
    job_id: int, uid: int, env: Mapping[str, str], rec: Mapping[str, Any]
) -> JobContext:
    """Pure part of :func:`from_slurm` (unit-tested with recorded scontrol output)."""
    tres = str(rec.get("TresPerNode", "")) + "," + str(rec.get("TresPerJob", ""))
    m = _TRES_SHARD.search(tres)
    shards = int(m.group(1)) if m else 0
    m = _TRES_GPU.search(tres)
    gpu_count = int(m.group(1)) if m else 0
    gpus: list[int] = []
    for gm in _GRES_IDX.finditer(str(rec.get("GRES", ""))):
        gpus.extend(_indices(gm.group(3)))
    if not gpus:
        raw = env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES") or ""
        try:
            gpus = _indices(raw)
        except ValueError:
            gpus = []
    def _path(key: str) -> str | None:
        v = str(rec.get(key, "") or "")
        return v if v.startswith("/") else None

    try:
        restarts = int(rec.get("Restarts", 0))
    except ValueError:
        restarts = 0
    return JobContext(
        job_id=job_id,
        uid=uid,
        user=env.get("SLURM_JOB_USER", str(uid)),
        node=env.get("SLURMD_NODENAME", ""),
        gpus=tuple(sorted(set(gpus))),
        shards=shards,
        gpu_count=gpu_count,
        stdout=_path("StdOut"),
        stderr=_path("StdErr"),
        restarts=restarts,
        admin_comment=str(rec.get("AdminComment", "") or ""),
        # slurmd hands the Epilog the job's exit as SLURM_JOB_EXIT_CODE2 ("1:0")
        exit_code=env.get("SLURM_JOB_EXIT_CODE2") or str(rec.get("ExitCode", "") or ""),
        state=str(rec.get("JobState", "") or ""),
    )
