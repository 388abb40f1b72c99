"""What to ask for when a collocated job ran out of GPU memory (or lost its MPS server).

Pure arithmetic on shards, so it is easy to test and to explain in the report.

Only jobs colloc placed are ever requeued or have their request rewritten
(:func:`colloc_placed`): shard jobs, including the ``mode=whole`` jobs job_submit turned
into all shards of one GPU. A user's own ``gres:gpu:N`` job is never touched by root,
whatever its log shows: rewriting a 4-GPU DDP job to ``gres/shard:40`` would restart
it silently on one GPU (issue 11, M5). Its attempt may still be recorded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slurm_colloc.config import CollocConfig
from slurm_colloc.oom.patterns import REQUEUE_CAUSES, AttemptCause

STEP_MIN_MIB = 5 * 1024
MPS_FAULT_REASON = "MPS server fault caused by a co-tenant: same request"
CUDA_FATAL_SHARED_REASON = (
    "fatal CUDA error under MPS: one client's fault ends every client of the GPU's MPS "
    "server and nothing says whose it was, so the job gets a GPU of its own "
    "({n} shards); if the fault is its own it fails there alone and is not requeued again"
)
NOT_PLACED_REASON = (
    "not placed by colloc (a gres/gpu request, not shards): never requeued or "
    "rewritten by colloc"
)
CUDA_FATAL_WHOLE_REASON = (
    "fatal CUDA error on a GPU of its own: a bug in the job (or a GPU fault), not a "
    "co-tenant's; not requeued"
)


CULPRIT_REASON = (
    "GPU OOM while co-tenant job {job} was {what} (peak {peak} MiB, allocation {limit} "
    "MiB): not this job's fault, same request"
)


def culprit_reason(job: str, kind: str, peak_mib: int, limit_mib: int) -> str:
    """The report's sentence for an OOM blamed on a co-tenant (collector verdict)."""
    what = "over its allocation" if kind == "over_limit" else "using the GPU outside MPS"
    return CULPRIT_REASON.format(job=job, what=what, peak=peak_mib, limit=limit_mib)


def colloc_placed(*, shards: int, gpu_count: int, foreign_shards: int = 0) -> bool:
    """Whether colloc placed the job: a per-node shard request and no gres/gpu.

    ``shards``: shards per node; ``gpu_count``: whole GPUs per node; ``foreign_shards``:
    shards asked per job/task/socket (job_submit refuses those, so they are not ours).
    """
    return shards > 0 and gpu_count == 0 and foreign_shards == 0


@dataclass(frozen=True)
class RequeueDecision:
    """Whether to requeue, with what request, and the sentence the report shows."""

    requeue: bool
    new_shards: int
    reason: str


def decide(
    *,
    cause: AttemptCause,
    shards: int,
    shards_per_gpu: int,
    restarts: int,
    estimate_mib: int | None,
    cfg: CollocConfig,
    colloc_placed: bool = True,
    culprit: str | None = None,
) -> RequeueDecision:
    """Decide the next attempt of a job whose logs show ``cause``.

    ``gpu-oom`` of a shared job steps up (a whole GPU by default); ``mps-fault``
    (a co-tenant's fatal error took the MPS server down) requeues with the same
    request, because the job did nothing wrong. A job that already had a whole GPU
    is never requeued for OOM: more of the same GPU does not exist. ``cuda-fatal`` (a
    sticky CUDA error) of a shared job may be a co-tenant's fault delivered to every
    MPS client: it is requeued once on a whole GPU, where a job at fault fails alone;
    on a whole GPU it is the job's own and is not requeued.

    ``colloc_placed`` False (see :func:`colloc_placed`): never requeued, whatever the
    cause.

    ``culprit``: the collector saw a co-tenant over its allocation on this GPU during
    the attempt (:func:`culprit_reason` text; a co-tenant only outside MPS, within
    its allocation, is never one: :func:`~slurm_colloc.metrics.enforce.culprits_on_gpu`).
    A shared job's GPU OOM is then the co-tenant's doing: the victim is requeued with
    the same request, not moved to a whole GPU (that would reward the offender with the
    GPU it took).
    """
    refusal = _refusal(cause=cause, shards=shards, shards_per_gpu=shards_per_gpu,
                       restarts=restarts, cfg=cfg, colloc_placed=colloc_placed)
    if refusal is not None:
        return refusal
    return _shared_next(cause=cause, shards=shards, shards_per_gpu=shards_per_gpu,
                        restarts=restarts, estimate_mib=estimate_mib, cfg=cfg, culprit=culprit)


def _refusal(*, cause: AttemptCause, shards: int, shards_per_gpu: int, restarts: int,
             cfg: CollocConfig, colloc_placed: bool) -> RequeueDecision | None:
    """Why the job is not requeued (or a whole-GPU job's MPS fault), None to go on."""
    if not colloc_placed:
        return RequeueDecision(False, shards, NOT_PLACED_REASON)
    if cause == "cuda-fatal" and (shards <= 0 or shards >= shards_per_gpu):
        return RequeueDecision(False, shards, CUDA_FATAL_WHOLE_REASON)
    if cause not in REQUEUE_CAUSES:
        return RequeueDecision(False, shards, "no GPU out-of-memory in the job's logs")
    if not cfg.requeue_on_oom:
        return RequeueDecision(False, shards, "requeue_on_oom is off in colloc.conf")
    if restarts >= cfg.max_requeues:
        return RequeueDecision(
            False, shards, f"already requeued {restarts} time(s); max_requeues={cfg.max_requeues}"
        )
    if shards <= 0 or shards >= shards_per_gpu:
        if cause == "mps-fault":
            return RequeueDecision(True, shards, MPS_FAULT_REASON)
        return RequeueDecision(
            False, shards,
            "out of GPU memory on a whole GPU: the job needs more memory than one GPU "
            "has (smaller batch, mixed precision or a bigger GPU); not requeued",
        )
    return None


def _shared_next(*, cause: AttemptCause, shards: int, shards_per_gpu: int, restarts: int,
                 estimate_mib: int | None, cfg: CollocConfig,
                 culprit: str | None) -> RequeueDecision:
    """The next request of a shared job that is requeued."""
    if cause == "mps-fault":
        return RequeueDecision(True, shards, MPS_FAULT_REASON)
    if cause == "gpu-oom" and culprit:
        return RequeueDecision(True, shards, culprit)
    if cause == "cuda-fatal":
        return RequeueDecision(True, shards_per_gpu,
                               CUDA_FATAL_SHARED_REASON.format(n=shards_per_gpu))
    if cfg.step_up_policy == "step" and shards < shards_per_gpu:
        base = estimate_mib if estimate_mib else shards * cfg.shard_mib
        want = base + max(STEP_MIN_MIB, base // 2)
        step = min(shards_per_gpu, math.ceil(want / cfg.shard_mib))
        if step > shards and restarts == 0:
            return RequeueDecision(
                True, step, f"GPU OOM with {shards} shards: step up to {step} shards"
            )
    return RequeueDecision(
        True, shards_per_gpu,
        f"GPU OOM with {shards} shards: requeued on a whole GPU ({shards_per_gpu} shards)",
    )
