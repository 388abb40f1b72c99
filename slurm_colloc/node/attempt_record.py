"""Turn what the node scripts saw and decided into one accounting attempt.

The record lives in AdminComment next to job_submit's ``colloc1:`` text (kept as
is) and is written by :mod:`slurm_colloc.node.record_writer` or, for a requeued job,
by the epilog itself while the job is pending again.
"""

from __future__ import annotations

import time

from slurm_colloc.accounting.record import Attempt, Estimate, MetricsSummary, OomInfo, Requeue
from slurm_colloc.config import CollocConfig
from slurm_colloc.node.job import JobContext
from slurm_colloc.site.record import parse_record


def build_attempt(
    ctx: JobContext,
    cfg: CollocConfig,
    *,
    cause: str,
    pattern: str | None,
    evidence_path: str | None,
    requeued: bool,
    reason: str | None,
    new_shards: int | None,
    shards_per_gpu: int | None,
    metrics: MetricsSummary | None = None,
    co_tenants: tuple[str, ...] = (),
    start: int | None = None,
) -> Attempt:
    """The attempt ``ctx.restarts`` of the job as the report will show it."""
    sub = parse_record(ctx.admin_comment)
    estimate = None
    if sub is not None and sub.est_mib:
        estimate = Estimate(
            mib=sub.est_mib, estimator=sub.estimator or "unknown",
            margin=float(sub.margin_mib) if sub.margin_mib is not None else None,
            fingerprint=sub.fingerprint,
        )
    elif sub is not None:
        estimate = Estimate(mib=sub.need_mib, estimator=sub.mode)
    whole = ctx.gpu_count > 0 or (shards_per_gpu is not None and ctx.shards >= shards_per_gpu)
    oom = None
    if cause != "none":
        oom = OomInfo(cause=cause, pattern_id=pattern, evidence_path=evidence_path,
                      whole_gpu=whole)
    requeue = None
    if reason is not None:
        requeue = Requeue(
            requeued=requeued, reason=reason,
            new_request=f"gres:shard:{new_shards}" if requeued and new_shards else None,
            new_limit_mib=new_shards * cfg.shard_mib if requeued and new_shards else None,
        )
    limit = ctx.shards * cfg.shard_mib if ctx.is_shared else None
    return Attempt(
        attempt=ctx.restarts, estimate=estimate,
        shards=ctx.shards or None, shard_mib=cfg.shard_mib if ctx.shards else None,
        limit_mib=limit, gpu=ctx.gpu, node=ctx.node or None, co_tenants=co_tenants,
        oom=oom, requeue=requeue, metrics=metrics, start=start, end=int(time.time()),
    )
