"""Turn what the node scripts saw and decided into one accounting attempt.

The record lives in AdminComment next to job_submit's ``colloc1:`` text (kept as
is) and is written by :mod:`slurm_colloc.node.record_writer` or, for a requeued job,
by the epilog itself while the job is pending again.

The estimate carries the estimator history's key (fingerprint, batch size, sequence
length, optimizer, precision) from the prolog's root-only meta of the attempt, so the
record alone lets ``colloc estimate`` on any host use the measured peak
(:mod:`slurm_colloc.accounting.history`). Those values come from the job's own
``--colloc-*`` options: they only ever count for the job's owner.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from slurm_colloc.accounting.record import (
    Attempt,
    Enforcement,
    Estimate,
    MetricsSummary,
    OomInfo,
    Requeue,
)
from slurm_colloc.config import CollocConfig
from slurm_colloc.metrics import store
from slurm_colloc.node.job import JobContext
from slurm_colloc.oom.patterns import AttemptCause


def build_attempt(
    ctx: JobContext,
    cfg: CollocConfig,
    *,
    cause: AttemptCause,
    pattern: str | None,
    evidence_path: str | None,
    requeued: bool,
    reason: str | None,
    new_shards: int | None,
    shards_per_gpu: int | None,
    metrics: MetricsSummary | None = None,
    co_tenants: tuple[str, ...] = (),
    start: int | None = None,
    story: AttemptStory | None = None,
) -> Attempt:
    """The attempt ``ctx.restarts`` of the job as the report will show it.

    The history key and (when ``start`` is not given) the start time come from the
    prolog's meta of this attempt, if it has one for this job and owner.
    """
    sub = ctx.submit
    meta = _meta(ctx, cfg)
    key = Estimate(mib=0, estimator="")  # the history key alone
    if meta is not None:
        key = Estimate(mib=0, estimator="", batch_size=_pos_int(meta.batch_size),
                       seq_len=_pos_int(meta.seq_len), optimizer=_word(meta.optimizer),
                       precision=_word(meta.precision))
        if start is None and isinstance(meta.start, (int, float)) and 0 < meta.start < 1 << 40:
            start = int(meta.start)
    fingerprint = sub.fingerprint if sub is not None else None
    if not fingerprint and meta is not None:
        fingerprint = _word(meta.fingerprint, 64)
    estimate = None
    if sub is not None and sub.est_mib:
        estimate = replace(
            key, mib=sub.est_mib, estimator=sub.estimator or "unknown",
            margin_mib=sub.margin_mib,
            fingerprint=fingerprint,
        )
    elif sub is not None:
        estimate = replace(key, mib=sub.need_mib, estimator=sub.mode, fingerprint=fingerprint)
    whole = ctx.gpu_count > 0 or (shards_per_gpu is not None and ctx.shards >= shards_per_gpu)
    oom = _oom(cause, pattern, evidence_path, whole, story)
    requeue = None
    if reason is not None:
        requeue = Requeue(
            requeued=requeued, reason=reason,
            new_request=f"gres/shard:{new_shards}" if requeued and new_shards else None,
            new_limit_mib=new_shards * cfg.shard_mib if requeued and new_shards else None,
        )
    limit = ctx.limit_mib(cfg.shard_mib)
    return Attempt(
        attempt=ctx.restarts, estimate=estimate,
        shards=ctx.shards or None, shard_mib=cfg.shard_mib if ctx.shards else None,
        limit_mib=limit, gpu=ctx.gpu, node=ctx.node or None, co_tenants=co_tenants,
        oom=oom, requeue=requeue, metrics=metrics, start=start, end=int(time.time()),
        enforcement=story.enforcement if story is not None else None,
    )


def _oom(cause: AttemptCause, pattern: str | None, evidence_path: str | None, whole: bool,
         story: AttemptStory | None) -> OomInfo | None:
    if cause == "none":
        return None
    s = story or AttemptStory()
    return OomInfo(cause=cause, pattern_id=pattern, evidence_path=evidence_path,
                   whole_gpu=whole, alloc_mib=s.alloc_mib, in_use_mib=s.in_use_mib,
                   culprit=s.culprit)


@dataclass(frozen=True)
class AttemptStory:
    """What ended the attempt, beyond its cause (issue 27): the allocation that failed
    (from the OOM line), the co-tenant blamed for it, and the collector's verdict."""

    alloc_mib: int | None = None
    in_use_mib: int | None = None
    culprit: str | None = None
    enforcement: Enforcement | None = None


def story_of(cfg: CollocConfig, job_id: int, attempt: int, evidence_line: str | None,
             culprit: str | None) -> AttemptStory:
    """The attempt's story from root-owned state: the collector's verdict file and the
    OOM line the epilog's scan matched (numbers only are taken from it)."""
    from slurm_colloc.metrics import enforce
    from slurm_colloc.oom.alloc import failed_allocation

    found = failed_allocation(evidence_line)
    v = enforce.verdict_for(cfg, job_id, attempt)
    return AttemptStory(
        alloc_mib=found.alloc_mib if found else None,
        in_use_mib=found.in_use_mib if found else None, culprit=culprit,
        enforcement=Enforcement(kind=v.kind, action=v.action, peak_mib=v.peak_mib,
                                limit_mib=v.limit_mib, outside_mps=v.outside_mps)
        if v is not None else None)


def _meta(ctx: JobContext, cfg: CollocConfig) -> store.JobMeta | None:
    """The prolog's meta of this attempt, when it is this job's and this owner's."""
    try:
        meta = store.read_meta(cfg.metrics_dir, ctx.job_id, ctx.restarts)
    except (OSError, ValueError):
        return None
    if meta is None or meta.job_id != ctx.job_id or meta.attempt != ctx.restarts:
        return None
    if meta.uid != ctx.uid:
        return None
    return meta


def _pos_int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 31 else None


def _word(v: object, limit: int = 32) -> str | None:
    return v if isinstance(v, str) and 0 < len(v) <= limit else None
