"""Advice that follows from what ended an attempt (:mod:`.story`), issue 27.

Each cause gets the one change that helps, or is told that none is needed:

- killed by colloc outside MPS: keep ``CUDA_MPS_PIPE_DIRECTORY`` (no limit holds
  outside MPS, so the collector stops such jobs; a bigger share would not help);
- killed by colloc over its allocation: the allocation and a ``--colloc-mem`` that
  covers the peak the collector saw;
- a GPU OOM at a known allocation: a size that covers what was in use plus the
  allocation that failed, rounded up to whole shards (a measured peak never
  includes the refused allocation, so sizing from the peak repeats the crash);
- a co-tenant's fault: no resize, and whether it was requeued;
- stopped from outside (scancel, a signal, the time limit, preemption): no memory
  advice at all, since its peak is not what it needs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from slurm_colloc.report.fmt import gib
from slurm_colloc.report.story import CO_TENANT, KILLED_BY_COLLOC, SIGNALLED

if TYPE_CHECKING:
    from slurm_colloc.report.model import AttemptView, JobReport

MARGIN = 0.10
"""Headroom over a figure we size from (as :mod:`.recommend`)."""
KEEP_PIPE_DIR = (
    "Keep CUDA_MPS_PIPE_DIRECTORY as the job gets it: do not unset or override it "
    "(env -i, apptainer --cleanenv and some launchers drop it; pass it on, e.g. "
    "--env CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY). Outside MPS no GPU "
    "memory limit holds, so colloc stops the job; a bigger share would not help.")


def cause(a: AttemptView) -> str | None:
    """The story's cause word of an attempt (None before :mod:`.story` ran)."""
    return (a.story or {}).get("cause")


def colloc_mem(need_mib: float, shard_mib: int | None) -> tuple[int, int | None]:
    """(``--colloc-mem`` in whole GiB, shards) covering ``need_mib`` plus the margin,
    rounded up to whole shards when the shard size is known."""
    want = need_mib * (1 + MARGIN)
    if shard_mib:
        shards = math.ceil(want / shard_mib)
        return math.ceil(shards * shard_mib / 1024), shards
    return math.ceil(want / 1024), None


def _size(need_mib: float, shard_mib: int | None) -> str:
    gb, shards = colloc_mem(need_mib, shard_mib)
    return f"--colloc-mem={gb}G" + (f" ({shards} shards)" if shards else "")


def _killed(rep: JobReport, a: AttemptView) -> list[str]:
    v: dict[str, Any] = a.enforcement or {}
    out = []
    if v.get("kind") == "outside_mps" or v.get("outside_mps"):
        out.append(KEEP_PIPE_DIR)
    if v.get("kind") == "over_limit" and v.get("peak_mib"):
        out.append(f"Its allocation was {gib(v.get('limit_mib'))} and it reached "
                   f"{gib(v['peak_mib'])} before colloc killed it: if it needs that much, "
                   f"submit with {_size(v['peak_mib'], rep.shard_mib)}, peak + 10 %; "
                   "the allocation is enforced.")
    return out


def _oom(rep: JobReport, a: AttemptView) -> list[str]:
    oom = a.oom or {}
    alloc, used = oom.get("alloc_mib"), oom.get("in_use_mib") or a.peak_mib
    if alloc is None or used is None:
        return []
    need = used + alloc
    head = (f"A {gib(alloc)} allocation failed with {gib(used)} in use: the job needs at "
            f"least {gib(need)}")
    if rep.gpu_memory_mib and need > rep.gpu_memory_mib:
        return [f"{head}, more than a whole GPU here ({gib(rep.gpu_memory_mib)}): no share "
                "covers it. Use a smaller batch, mixed precision (--colloc-precision="
                "amp-bf16) or activation checkpointing, or a GPU with more memory."]
    return [f"{head}. Submit with {_size(need, rep.shard_mib)}, in use + the failed "
            "allocation + 10 %, rounded up to whole shards."]


def _victim(a: AttemptView) -> list[str]:
    rq = a.requeue or {}
    then = ("it was requeued with the same request" if rq.get("requeued")
            else "resubmit it as it is")
    return [f"Attempt {a.attempt} crashed because of a co-tenant, not because of its own "
            f"size: no resize is needed ({then})."]


def stopped_from_outside(rep: JobReport) -> bool:
    """The last attempt was ended from outside (a signal, scancel, the time limit,
    colloc's kill) or by a co-tenant: its figures say nothing about what it needs."""
    last = rep.attempts[-1] if rep.attempts else None
    return last is not None and cause(last) in SIGNALLED | {KILLED_BY_COLLOC, CO_TENANT}


def oom_sized(rep: JobReport) -> bool:
    """The last attempt died of a GPU OOM at a known allocation (sized from it here)."""
    last = rep.attempts[-1] if rep.attempts else None
    return (last is not None and cause(last) == "gpu-oom"
            and (last.oom or {}).get("alloc_mib") is not None)


def advice(rep: JobReport) -> list[str]:
    """Advice from each finished attempt's cause (see the module docstring)."""
    if rep.running and rep.state not in ("PENDING", "REQUEUED"):
        return []
    out: list[str] = []
    for i, a in enumerate(rep.attempts):
        c = cause(a)
        if c == KILLED_BY_COLLOC:
            out += _killed(rep, a)
        elif c == CO_TENANT:
            out += _victim(a)
        elif c == "gpu-oom" and i == len(rep.attempts) - 1:
            out += _oom(rep, a)
    return list(dict.fromkeys(out))
