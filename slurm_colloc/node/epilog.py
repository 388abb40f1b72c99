"""Epilog (root, compute node): release MPS, find GPU OOM, keep evidence, requeue.

Order matters: the MPS registration is released first (whatever else fails, the
GPU must not keep a daemon for a job that is gone). Then, for a job that failed,
its logs are scanned; a GPU OOM of a collocated job is answered with a requeue on a
GPU of its own. The requeue happens right here: ``scontrol requeuehold`` works while
the job is COMPLETING (checked on 22.05), then the shard request is raised and the
job released; it starts again after Slurm's credential-lifetime delay.
"""

from __future__ import annotations

import logging
import pwd
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_colloc.config import CollocConfig
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import evidence, requeue_policy
from slurm_colloc.node.job import JobContext
from slurm_colloc.node.prolog import daemon_for
from slurm_colloc.slurm.adapter import SlurmAdapter, SlurmError


@dataclass
class EpilogResult:
    """What the epilog found and did (logged, and recorded for the report)."""

    job_id: int
    released: list[tuple[int, int]] = field(default_factory=list)
    stopped_daemons: list[tuple[int, int]] = field(default_factory=list)
    cause: str = "none"
    pattern: str | None = None
    evidence_line: str | None = None
    evidence_files: list[str] = field(default_factory=list)
    decision: requeue_policy.RequeueDecision | None = None
    requeued: bool = False
    shards_per_gpu: int | None = None
    record_spooled: str | None = None
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One log line."""
        parts = [f"cause={self.cause}"]
        if self.pattern:
            parts.append(f"pattern={self.pattern}")
        if self.decision:
            parts.append(f"requeue={'yes' if self.requeued else 'no'} ({self.decision.reason})")
        if self.evidence_files:
            parts.append(f"evidence={','.join(self.evidence_files)}")
        if self.stopped_daemons:
            parts.append(f"stopped MPS daemons {self.stopped_daemons}")
        if self.errors:
            parts.append(f"errors: {'; '.join(self.errors)}")
        return " ".join(parts)


def release_mps(job_id: int, cfg: CollocConfig, result: EpilogResult) -> None:
    """Forget the job; stop each (GPU, user) daemon it leaves without jobs.

    Works from root-owned state alone (the job's markers), before any controller
    call: with slurmctld down, the GPU is still released at once.
    """
    tenancy = Tenancy(Path(cfg.mps_root))
    gpus = sorted({g for g, _ in tenancy.all_jobs().get(job_id, [])})
    for gpu in gpus:
        with tenancy.locked(gpu):
            for g, uid in tenancy.remove_job(job_id):
                result.released.append((g, uid))
            for uid in tenancy.users_on(gpu):
                if not tenancy.jobs_of(gpu, uid):
                    d = daemon_for(cfg, tenancy, gpu, uid)
                    if d.identity() is not None:
                        d.stop()
                        result.stopped_daemons.append((gpu, uid))
    tenancy.job_env_file(job_id).unlink(missing_ok=True)


def shards_per_gpu(cfg: CollocConfig, gpu: int | None) -> int:
    """Whole shards the job's GPU offers (its memory / shard size)."""
    from slurm_colloc.gpu.select import backend_from_config

    backend = backend_from_config(cfg)
    try:
        for g in backend.gpus():
            if gpu is None or g.index == gpu:
                return g.memory_total_mib // cfg.shard_mib
    finally:
        backend.close()
    raise ValueError(f"GPU {gpu} not found by the {cfg.gpu_backend} backend")


def estimate_of(ctx: JobContext) -> int | None:
    """The submit-time estimate in MiB, if job_submit recorded one."""
    from slurm_colloc.site.record import parse_record

    rec = parse_record(ctx.admin_comment)
    return rec.est_mib or rec.need_mib if rec else None


def _metrics(ctx: JobContext, cfg: CollocConfig) -> tuple[Any, tuple[str, ...]]:
    """The sidecar's summary of this attempt and its co-tenants, if a sidecar ran."""
    try:
        from slurm_colloc.metrics.summary import job_summary
    except ImportError:
        return None, ()
    summary, tenants = job_summary(cfg, ctx.job_id, ctx.restarts)
    return summary, tuple(tenants)


def _record_history(ctx: JobContext, cfg: CollocConfig, metrics: Any, result: EpilogResult) -> None:
    """A successful attempt's measured peak becomes the estimator's history."""
    try:
        from slurm_colloc.metrics.summary import record_history

        ok = ctx.exit_code == "0:0" and result.cause == "none"
        record_history(cfg, ctx.job_id, ctx.restarts, metrics, succeeded=ok)
    except Exception as e:  # noqa: BLE001 - history is an optimisation, never fatal
        result.errors.append(f"history not recorded: {e}")


def release_first(job_id: int, cfg: CollocConfig) -> EpilogResult:
    """The epilog's first step, before the job context is even built."""
    result = EpilogResult(job_id)
    try:
        release_mps(job_id, cfg, result)
    except Exception as e:  # noqa: BLE001 - keep going: OOM handling is independent
        result.errors.append(f"MPS release failed: {e}")
    return result


def run(
    ctx: JobContext, cfg: CollocConfig, adapter: SlurmAdapter, log: logging.LoggerAdapter[Any],
    result: EpilogResult | None = None,
) -> EpilogResult:
    """Do the epilog's work for one job (see module docstring).

    ``result``: what :func:`release_first` did (the entry point releases MPS before
    it asks anything of Slurm); without it, the release happens here.
    """
    if result is None:
        result = release_first(ctx.job_id, cfg)
    if not ctx.gpus:
        return result
    _scan_and_decide(ctx, cfg, result)
    try:
        metrics, co_tenants = _metrics(ctx, cfg)
    except Exception as e:  # noqa: BLE001 - metrics are optional for the record
        result.errors.append(f"metrics summary failed: {e}")
        metrics, co_tenants = None, ()
    _record_history(ctx, cfg, metrics, result)
    text = _record_text(ctx, cfg, result, metrics, co_tenants)
    if result.decision is not None and result.decision.requeue:
        try:
            requeue(ctx, adapter, result.decision.new_shards, admin_comment=text)
            result.requeued = True
        except SlurmError as e:
            result.errors.append(f"requeue failed: {e}")
            log.error("requeue failed: %s", e)
    if not result.requeued and text is not None:
        _spool_record(ctx, cfg, text, result)
    return result


def _scan_and_decide(ctx: JobContext, cfg: CollocConfig, result: EpilogResult) -> None:
    """Look for GPU OOM in a failed job's logs; keep evidence; decide the requeue."""
    from slurm_colloc.oom.detector import scan_files

    if ctx.exit_code in ("", "0:0") or not (ctx.stdout or ctx.stderr):
        return
    logs = [p for p in (ctx.stdout, ctx.stderr) if p]
    scan = scan_files(logs, tail_bytes=cfg.log_scan_tail_mib << 20, uid=ctx.uid)
    result.cause = scan.cause
    result.pattern = scan.pattern_id
    result.evidence_line = scan.evidence.line if scan.evidence else None
    if scan.cause == "none":
        return
    try:
        pw = pwd.getpwuid(ctx.uid)
        result.evidence_files = evidence.keep(
            cfg.evidence_dir, ctx.job_id, ctx.restarts, ctx.uid, pw.pw_gid, logs,
            cfg.log_scan_tail_mib << 20,
        )
    except Exception as e:  # noqa: BLE001 - evidence is best effort; the requeue is not
        result.errors.append(f"evidence not kept: {e}")
    spg = shards_per_gpu(cfg, ctx.gpu)
    result.shards_per_gpu = spg
    shards = ctx.shards if ctx.is_shared else spg
    result.decision = requeue_policy.decide(
        cause=scan.cause, shards=shards, shards_per_gpu=spg, restarts=ctx.restarts,
        estimate_mib=estimate_of(ctx), cfg=cfg,
    )


def _record_text(
    ctx: JobContext, cfg: CollocConfig, result: EpilogResult, metrics: Any,
    co_tenants: tuple[str, ...],
) -> str | None:
    """This attempt appended to the job's AdminComment (None for non-colloc jobs)."""
    from slurm_colloc.accounting.codec import append_attempt
    from slurm_colloc.node.attempt_record import build_attempt
    from slurm_colloc.site.record import parse_record

    if parse_record(ctx.admin_comment) is None and not ctx.is_shared and result.cause == "none":
        return None
    d = result.decision
    attempt = build_attempt(
        ctx, cfg, cause=result.cause, pattern=result.pattern,
        evidence_path=result.evidence_files[0] if result.evidence_files else None,
        requeued=bool(d and d.requeue), reason=d.reason if d else None,
        new_shards=d.new_shards if d else None, shards_per_gpu=result.shards_per_gpu,
        metrics=metrics, co_tenants=co_tenants,
    )
    return append_attempt(ctx.admin_comment, attempt, max_bytes=cfg.admin_comment_max_bytes)


def _spool_record(ctx: JobContext, cfg: CollocConfig, text: str, result: EpilogResult) -> None:
    """Leave the record for the detached writer (the job is still COMPLETING)."""
    import os

    from slurm_colloc.mps.tenancy import ensure_root_dir
    from slurm_colloc.node import record_writer
    from slurm_colloc.node.prolog import main_env

    try:
        spool = ensure_root_dir(Path(cfg.evidence_dir).parent / "spool", 0o700)
        path = record_writer.spool_path(str(spool), ctx.job_id)
        path.write_text(text)
        record_writer.spawn(ctx.job_id, path, main_env(os.environ))
        result.record_spooled = str(path)
    except Exception as e:  # noqa: BLE001 - the record is for the report; never fatal
        result.errors.append(f"accounting record not written: {e}")


def requeue(
    ctx: JobContext, adapter: SlurmAdapter, new_shards: int, admin_comment: str | None = None
) -> None:
    """Hold-requeue, raise the shard request, release.

    Holding first closes the race in which the scheduler starts the job again with
    the old request before the update lands. Slurm then delays the new start by the
    credential lifetime (AuthInfo cred_expire, 120 s by default): that delay is what
    makes slurmd run the Prolog again for the same job id on the same node, so it is
    not bypassed (the devcluster shortens cred_expire instead; docs/node.md).
    """
    adapter.requeue(ctx.job_id, hold=True)
    try:
        if new_shards != ctx.shards or not ctx.is_shared:
            adapter.update_job(ctx.job_id, TresPerNode=f"gres:shard:{new_shards}")
        if admin_comment:
            # allowed now: the job is pending again, not finished
            adapter.update_job(ctx.job_id, AdminComment=admin_comment)
    finally:
        adapter.release(ctx.job_id)
