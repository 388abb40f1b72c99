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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_colloc.accounting.field import carry_in_admin_comment
from slurm_colloc.config import CollocConfig
from slurm_colloc.mps.tenancy import Tenancy, TenancyError
from slurm_colloc.node import evidence, requeue_policy, requeue_steps
from slurm_colloc.node.job import JobContext
from slurm_colloc.node.prolog import daemon_for
from slurm_colloc.oom.patterns import AttemptCause
from slurm_colloc.slurm.adapter import SlurmAdapter, SlurmError


@dataclass
class EpilogResult:
    """What the epilog found and did (logged, and recorded for the report)."""

    job_id: int
    released: list[tuple[int, int]] = field(default_factory=list)
    stopped_daemons: list[tuple[int, int]] = field(default_factory=list)
    cause: AttemptCause = "none"
    pattern: str | None = None
    evidence_line: str | None = None
    evidence_files: list[str] = field(default_factory=list)
    """The user's copy first when it was written (issue 13), then root's copies."""
    decision: requeue_policy.RequeueDecision | None = None
    requeued: bool = False
    requeue_pending: bool = False
    """slurmctld did not answer: a detached helper retries the requeue (issue 28)."""
    shards_per_gpu: int | None = None
    culprit: str | None = None
    """Co-tenant job the collector blamed for this job's GPU OOM."""
    unscanned: list[str] = field(default_factory=list)
    """Logs the scan could not read, ``"<path>: <why>"`` (:mod:`.unscanned`)."""
    record_spooled: str | None = None
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One log line."""
        parts = [f"cause={self.cause}"]
        if self.pattern:
            parts.append(f"pattern={self.pattern}")
        if self.culprit:
            parts.append(f"culprit=job {self.culprit}")
        if self.decision:
            said = "pending" if self.requeue_pending else "yes" if self.requeued else "no"
            parts.append(f"requeue={said} ({self.decision.reason})")
        if self.evidence_files:
            parts.append(f"evidence={','.join(self.evidence_files)}")
        if self.stopped_daemons:
            parts.append(f"stopped MPS daemons {self.stopped_daemons}")
        if self.unscanned:
            from slurm_colloc.node.unscanned import log_line

            parts.append(log_line(self.unscanned))
        if self.errors:
            parts.append(f"errors: {'; '.join(self.errors)}")
        return " ".join(parts)


def release_v3(job_id: int, cfg: CollocConfig, tenancy: Tenancy, result: EpilogResult) -> None:
    """Delete the job's MPS v3 namespace, if its prolog made one (root state says).

    Decided by what the prolog recorded, not by today's ``mps_protocol``: a job started
    before a switch is still released. The node's daemon keeps running for the next
    job (it holds a server per GPU, which the memory budget counts).
    """
    from slurm_colloc.mps.tenancy import TenancyError
    from slurm_colloc.mps.v3 import V3_DIR, MpsV3Error
    from slurm_colloc.node.mps_protocol import v3_node

    if not (Path(cfg.mps_root) / V3_DIR).is_dir():
        return
    node = v3_node(cfg)
    if node.job(job_id) is None:
        return
    try:
        with tenancy.locked_node():
            outcome = node.remove_job(job_id)
        if outcome == "forced":
            result.errors.append(f"MPS v3 namespace of job {job_id} still had clients: "
                                 "deleted with --force")
    except (MpsV3Error, TenancyError, OSError) as e:
        result.errors.append(f"MPS v3 namespace of job {job_id} not deleted: {e}")


def release_mps(job_id: int, cfg: CollocConfig, result: EpilogResult) -> None:
    """Forget the job; stop each (GPU, user) daemon it leaves without jobs.

    Works from root-owned state alone (the job's markers), before any controller
    call: with slurmctld down, the GPU is still released at once.
    """
    tenancy = Tenancy(Path(cfg.mps_root))
    release_v3(job_id, cfg, tenancy, result)
    from slurm_colloc.node.pipe_dirs import gpus_to_sweep

    gpus = gpus_to_sweep(tenancy, job_id)  # a job whose marker is gone too (issue 28)
    try:
        for gpu in gpus:
            with tenancy.locked(gpu):
                for g, uid in tenancy.remove_job(job_id):
                    result.released.append((g, uid))
                for uid in tenancy.users_on(gpu):
                    if not tenancy.jobs_of(gpu, uid):
                        # the cap lock: after a start in progress (prolog._ensure_daemon)
                        with tenancy.cap_locked(gpu, uid):
                            d = daemon_for(cfg, tenancy, gpu, uid)
                            if d.identity() is not None:
                                d.stop()
                                result.stopped_daemons.append((gpu, uid))
                            # the user's last job here is over: nothing it planted stays
                            tenancy.retire_pipe_dir(gpu, uid)
        tenancy.forget_job_env(job_id)
    finally:
        done = tenancy.purge_quarantine()  # outside the GPU lock
        result.errors.extend(f"quarantine: {e}" for e in done.errors[:3])


def shards_per_gpu(cfg: CollocConfig, gpu: int | None) -> int:
    """Whole shards the job's GPU offers (what jobs can use of it / shard size).

    ``gpu`` is Slurm's index; None: the node's first GPU.
    """
    from slurm_colloc.gpu.budget import budget_of
    from slurm_colloc.node.gpus import node_gpu_map

    gmap = node_gpu_map(cfg)
    return budget_of(cfg, gmap.by_slurm_index(gpu or 0)).shards_per_gpu


def estimate_of(ctx: JobContext) -> int | None:
    """The submit-time estimate in MiB, if job_submit recorded one."""
    rec = ctx.submit
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
        outcome = record_history(cfg, ctx.job_id, ctx.restarts, metrics, succeeded=ok,
                                 uid=ctx.uid)
        if "unsafe" in outcome or "differs" in outcome:  # a site problem, not a job's
            result.errors.append(f"history {outcome}")
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
    try:
        _scan_and_decide(ctx, cfg, result)
    except Exception as e:  # noqa: BLE001 - never let the scan take the epilog down
        result.errors.append(f"log scan or requeue decision failed: {e}")
        log.error("log scan or requeue decision failed: %s", e)
    try:
        metrics, co_tenants = _metrics(ctx, cfg)
    except Exception as e:  # noqa: BLE001 - metrics are optional for the record
        result.errors.append(f"metrics summary failed: {e}")
        metrics, co_tenants = None, ()
    _record_history(ctx, cfg, metrics, result)
    text: str | None = None
    try:
        text = _record_text(ctx, cfg, result, metrics, co_tenants)
    except Exception as e:  # noqa: BLE001 - the record never cancels a requeue (issue 11, M2)
        result.errors.append(f"accounting record not built: {e}")
        log.error("accounting record not built: %s", e)
    if result.decision is not None and result.decision.requeue and text is not None:
        _spool_entry(ctx, cfg, text, result, log, kick=False)  # issue 28: durable first
    if result.decision is not None and result.decision.requeue:
        try:
            # the next attempt finds this one's record in the live job's AdminComment:
            # Slurm lets no one set SystemComment with scontrol (24.11, 26.05)
            carry = text if text is None else carry_in_admin_comment(ctx.admin_comment, text)
            errors = requeue(ctx, adapter, result.decision.new_shards, admin_comment=carry,
                             nice=cfg.recovery_nice, record=text,
                             confirm=_confirmer(ctx, cfg, result, log))
            result.requeued = True
            result.errors.extend(errors)
        except requeue_steps.ControllerAway as e:  # issue 28: retried until Slurm answers
            text = _hand_off_requeue(e.plan, ctx, cfg, text, result, log)
        except (SlurmError, ValueError) as e:
            result.errors.append(f"requeue failed: {e}")
            log.error("requeue failed: %s", e)
            text = requeue_steps.failed_record(text, ctx.restarts, f"requeue failed: {e}",
                                               max_bytes=cfg.admin_comment_max_bytes)
    if not result.requeued and text is not None:
        _spool_record(ctx, cfg, text, result)
    _count_events(cfg, result)
    return result


def _count_events(cfg: CollocConfig, result: EpilogResult) -> None:
    """Add this job's GPU OOM and requeue to the node's counters (Prometheus export)."""
    from slurm_colloc.metrics import node_counters

    if result.cause != "gpu-oom" and not result.requeued:
        return
    try:
        node_counters.bump(cfg.metrics_dir, {"gpu_oom": int(result.cause == "gpu-oom"),
                                             "requeues": int(result.requeued)})
    except OSError as e:
        result.errors.append(f"node counters not updated: {e}")


def _user_gid(uid: int) -> int | None:
    """The job user's primary gid (None for a uid this node does not know)."""
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return None


def placed_by_colloc(ctx: JobContext) -> bool:
    """Whether colloc placed the job (a shard request, no gres/gpu): see requeue_policy."""
    return requeue_policy.colloc_placed(
        shards=ctx.shards, gpu_count=ctx.gpu_count,
        foreign_shards=getattr(ctx, "foreign_shards", 0),
    )


def _shards_per_gpu_or_fallback(
    ctx: JobContext, cfg: CollocConfig, result: EpilogResult
) -> int | None:
    """The job's GPU in shards: the GPU backend, else what was recorded (issue 11, M2).

    An NVML error must not cancel a requeue. Fallbacks, in order: the ``colloc1``
    record of a ``mode=whole`` job (its shards are all of one GPU's, ``alloc_mib`` /
    ``shard_mib``), then the node's ``gpu_memory_mib`` / ``shard_mib``. None when
    nothing is known.
    """
    try:
        return shards_per_gpu(cfg, ctx.gpu)
    except Exception as e:  # noqa: BLE001 - NVML/sim failures fall back below
        result.errors.append(f"shards per GPU from the {cfg.gpu_backend} backend failed: {e}")
    rec = ctx.submit
    if rec is not None and rec.mode == "whole":
        if rec.shard_mib > 0 and rec.alloc_mib >= rec.shard_mib:
            return rec.alloc_mib // rec.shard_mib
        if rec.shards > 0:
            return rec.shards
    from slurm_colloc.gpu.budget import config_budget
    from slurm_colloc.gpu_settings import effective, local_node

    site_budget = config_budget(effective(cfg, node=local_node(), model=None))  # no model
    if site_budget is not None and site_budget.shards_per_gpu > 0:
        return site_budget.shards_per_gpu
    result.errors.append("shards per GPU unknown: the job is treated as having a whole GPU")
    return None


def _scan_and_decide(ctx: JobContext, cfg: CollocConfig, result: EpilogResult) -> None:
    """Look for GPU OOM in a failed job's logs; keep evidence; decide the requeue.

    The logs are read with the user's uid, primary gid and groups. Only logs the scan
    could read are kept as evidence (issue 11, M1). A job colloc did not place (a
    user's own gres/gpu request) is never requeued (M5); its attempt may be recorded.
    """
    from slurm_colloc.node.unscanned import named
    from slurm_colloc.oom.detector import scan_files

    if ctx.exit_code in ("", "0:0") or not (ctx.stdout or ctx.stderr):
        return
    # stderr first: on a tie the first file wins, and frameworks print errors there
    logs = [p for p in (ctx.stderr, ctx.stdout) if p]
    gid = _user_gid(ctx.uid)
    scan = scan_files(logs, tail_bytes=cfg.log_scan_tail_mib << 20, uid=ctx.uid, gid=gid)
    result.unscanned = named(scan.results)
    result.cause = scan.cause
    result.pattern = scan.pattern_id
    result.evidence_line = scan.evidence.line if scan.evidence else None
    if scan.cause == "none":
        return
    readable = [r.path for r in scan.results if r.status == "ok"]
    if readable and gid is not None:
        try:
            errors: list[str] = []
            result.evidence_files = evidence.keep(
                cfg.evidence_dir, ctx.job_id, ctx.restarts, ctx.uid, gid, readable,
                cfg.log_scan_tail_mib << 20, errors=errors,
            )
            result.errors.extend(errors)
        except Exception as e:  # noqa: BLE001 - evidence is best effort; the requeue is not
            result.errors.append(f"evidence not kept: {e}")
        if cfg.evidence_user_copy:  # root's copy or not (issue 28: a full evidence fs)
            _keep_user_copy(ctx, result, readable, gid)
    placed = placed_by_colloc(ctx)
    spg = _shards_per_gpu_or_fallback(ctx, cfg, result) if placed else None
    result.shards_per_gpu = spg
    shards = ctx.shards if ctx.is_shared or not placed else (spg or ctx.shards)
    result.decision = requeue_policy.decide(
        cause=scan.cause, shards=shards, shards_per_gpu=spg if spg else max(shards, 1),
        restarts=ctx.restarts, estimate_mib=estimate_of(ctx), cfg=cfg, colloc_placed=placed,
        culprit=_culprit(ctx, cfg, result) if scan.cause == "gpu-oom" and ctx.is_shared
        else None,
    )


def _keep_user_copy(ctx: JobContext, result: EpilogResult, readable: list[str], gid: int) -> None:
    """Issue 13: a copy the user can read on the login host, next to the job's output
    (StdOut, else StdErr: a log the scan read), written as the user. It becomes the
    record's evidence path (first in ``evidence_files``); root's copy stays either way,
    and without root's copy it is made from the logs themselves (issue 28)."""
    log = next((p for p in (ctx.stdout, ctx.stderr) if p and p in readable), None)
    if log is None:
        return
    copy = evidence.keep_user_copy(
        log, ctx.job_id, ctx.restarts, ctx.uid, gid, node=ctx.node, cause=result.cause,
        pattern=result.pattern, line=result.evidence_line,
        root_files=list(result.evidence_files), errors=result.errors, sources=readable,
    )
    if copy is not None and len(copy) <= evidence.USER_COPY_MAX_PATH:
        result.evidence_files.insert(0, copy)
    elif copy is not None:
        result.evidence_files.append(copy)


def _culprit(ctx: JobContext, cfg: CollocConfig, result: EpilogResult) -> str | None:
    """A co-tenant the collector caught over its allocation on this GPU (not one only
    outside MPS: that took nobody's memory, issue 23).

    Issue 11, H2: without a hard cap a job can drop its MPS limit; its neighbours then
    run out of memory. The collector's root-owned verdicts say who it was.
    """
    try:
        from slurm_colloc.metrics import enforce, store
        from slurm_colloc.metrics.summary import job_summary

        meta = store.read_meta(cfg.metrics_dir, ctx.job_id, ctx.restarts)
        since = meta.start if meta is not None else 0.0
        # wait for a verdict in the making only if the collector saw co-tenants: an
        # attempt that ran alone has nobody to blame (and an OOM epilog stays fast)
        _, tenants = job_summary(cfg, ctx.job_id, ctx.restarts)
        found = enforce.culprits_on_gpu(
            cfg, ctx.gpus[0], since, exclude_job=ctx.job_id,
            wait_s=enforce.detection_window_s(cfg) if tenants else 0.0,
        )
    except Exception as e:  # noqa: BLE001 - attribution is advice; the requeue is not
        result.errors.append(f"co-tenant verdicts unreadable: {e}")
        return None
    if not found:
        return None
    v = found[0]
    result.culprit = v.job_id
    return requeue_policy.culprit_reason(v.job_id, v.kind, v.peak_mib, v.limit_mib)


def _record_text(
    ctx: JobContext, cfg: CollocConfig, result: EpilogResult, metrics: Any,
    co_tenants: tuple[str, ...],
) -> str | None:
    """This attempt appended to the job's record field (config ``record_field``,
    AdminComment by default; None for non-colloc jobs).

    May raise (the codec's RecordTooLargeError when other tools' text fills the
    field): the caller records the error and requeues regardless.
    """
    from dataclasses import replace

    from slurm_colloc.accounting.codec import append_attempt
    from slurm_colloc.node.attempt_record import build_attempt, story_of

    if ctx.submit is None and not ctx.is_shared and result.cause == "none":
        return None
    d = result.decision
    attempt = build_attempt(
        ctx, cfg, cause=result.cause, pattern=result.pattern,
        evidence_path=result.evidence_files[0] if result.evidence_files else None,
        requeued=bool(d and d.requeue), reason=d.reason if d else None,
        new_shards=d.new_shards if d else None, shards_per_gpu=result.shards_per_gpu,
        metrics=metrics, co_tenants=co_tenants,
        story=story_of(cfg, ctx.job_id, ctx.restarts, result.evidence_line, result.culprit),
    )
    # logs it could not scan: "cause none" then means "not seen" (issue 28)
    attempt = replace(attempt, unscanned=tuple(result.unscanned))
    return append_attempt(ctx.record_text(cfg.record_field), attempt,
                          max_bytes=cfg.admin_comment_max_bytes)


def _spool_record(ctx: JobContext, cfg: CollocConfig, text: str, result: EpilogResult) -> None:
    """Leave a finished attempt's record for the node's writer (:func:`_spool_entry`)."""
    _spool_entry(ctx, cfg, text, result)


def _spool_entry(ctx: JobContext, cfg: CollocConfig, text: str, result: EpilogResult,
                 log: logging.LoggerAdapter[Any] | None = None, *, kick: bool = True) -> None:
    """Leave this attempt's record in root's durable spool for the node's writer (the
    job is still COMPLETING), and start one (``kick``).

    Issue 28: per (job, attempt), fsync'd, before Slurm is asked anything (a requeue
    too: its carry in the live AdminComment may be lost with slurmctld). When the spool
    cannot take it (a full disk) the record is never dropped: a requeued attempt's
    travels in the live job's AdminComment; any other goes to a writer that holds it
    in memory (:func:`slurm_colloc.node.record_writer.write_direct`). Logged loudly."""
    import os

    from slurm_colloc.accounting import spool as spoolmod
    from slurm_colloc.mps.tenancy import ensure_root_dir
    from slurm_colloc.node import record_writer
    from slurm_colloc.node.prolog import main_env

    path = None
    try:
        spool = ensure_root_dir(spoolmod.spool_dir_of(cfg.evidence_dir), 0o700)
        path = spoolmod.entry_path(spool, ctx.job_id, ctx.restarts)
        if result.record_spooled != str(path) or _spooled_text(path) != text:
            spoolmod.write_entry(spool, ctx.job_id, ctx.restarts, text)
        result.record_spooled = str(path)
    except Exception as e:  # noqa: BLE001 - a full disk: the fallbacks below
        why = f"RECORD NOT SPOOLED ({e}): "
        if kick and not result.requeued:
            why += "written directly by an in-memory writer instead"
            try:
                record_writer.spawn_direct(ctx.job_id, text, main_env(os.environ))
            except Exception as e2:  # noqa: BLE001 - nothing left to try: say so
                why += f", which could not start: {e2}: RECORD LOST"
        else:
            why += "the requeue carries it in the live job's AdminComment"
        result.errors.append(why)
        (log or logging.getLogger("colloc.node.epilog")).error("job %s: %s", ctx.job_id, why)
        return
    if kick:
        try:
            # after the record is there: a writer that is ending looks at the spool again
            record_writer.spawn(ctx.job_id, path, main_env(os.environ))
        except Exception as e:  # noqa: BLE001 - spooled: the next prolog or collector replays it
            result.errors.append(f"record spooled, writer not started: {e}")


def _spooled_text(path: Path) -> str | None:
    from slurm_colloc.accounting import spool as spoolmod

    try:
        return spoolmod.read_text(path)
    except OSError:
        return None


def _hand_off_requeue(
    plan: requeue_steps.RequeuePlan, ctx: JobContext, cfg: CollocConfig, text: str | None,
    result: EpilogResult, log: logging.LoggerAdapter[Any],
) -> str | None:
    """slurmctld did not answer the requeue: a detached helper retries it
    (``slurm_colloc.node.requeue_retry``) and writes the record once it knows what
    happened. Returns the text still to spool here: None when the helper took the
    record over, the record marked "requeue failed" when no helper could start."""
    import os

    from slurm_colloc.node import job as jobmod
    from slurm_colloc.node.prolog import main_env

    plan.context = jobmod.context_to_json(ctx)
    try:
        path = requeue_steps.hand_off(plan, cfg.evidence_dir, main_env(os.environ))
    except Exception as e:  # noqa: BLE001 - then the record says the requeue failed
        why = f"requeue failed: slurmctld did not answer and no retry could start ({e})"
        result.errors.append(why)
        log.error("%s", why)
        return requeue_steps.failed_record(text, ctx.restarts, why,
                                           max_bytes=cfg.admin_comment_max_bytes)
    result.requeue_pending = True
    line = (f"requeue pending: {_accepted_so_far(plan)}; retried by a detached helper "
            f"for up to {cfg.requeue_retry_s} s ({path})")
    result.errors.append(line)
    log.warning("%s", line)
    return None


def _confirmer(
    ctx: JobContext, cfg: CollocConfig, result: EpilogResult, log: logging.LoggerAdapter[Any],
) -> Callable[[requeue_steps.RequeuePlan], None]:
    """After the requeue's steps: the marker that has the collector check the job
    does not stay held (issue 28: a release slurmctld lost in a crash). Never raises."""

    def confirm(plan: requeue_steps.RequeuePlan) -> None:
        try:
            requeue_steps.confirm_later(cfg.evidence_dir, plan, ctx.uid,
                                        wait_s=cfg.requeue_retry_s)
        except (OSError, TenancyError) as e:  # a foreign or linked directory
            why = f"release confirmation not kept (a lost release goes unnoticed): {e}"
            result.errors.append(why)
            log.error("%s", why)

    return confirm


def _accepted_so_far(plan: requeue_steps.RequeuePlan) -> str:
    """Which steps Slurm accepted before it stopped answering."""
    done = ", ".join(plan.done) or "nothing"
    return f"slurmctld did not answer (accepted so far: {done})"


def requeue(
    ctx: JobContext, adapter: SlurmAdapter, new_shards: int, admin_comment: str | None = None,
    nice: int = 0, record: str | None = None,
    confirm: Callable[[requeue_steps.RequeuePlan], None] | None = None,
) -> list[str]:
    """Hold-requeue, raise the shard request, boost the priority, release.

    Holding first closes the race in which the scheduler starts the job again with
    the old request before the update lands. Slurm then delays the new start by the
    credential lifetime (AuthInfo cred_expire, 120 s by default): that delay is what
    makes slurmd run the Prolog again for the same job id on the same node, so it is
    not bypassed (the devcluster shortens cred_expire instead; docs/node.md).

    ``nice`` > 0 sends the job back with ``Nice=-nice`` (``recovery_nice``): a recovery
    waits for a wholly free GPU, and without a boost every later small job that fits
    a half-free GPU goes first (replays saw 0.2 h jobs finish 3-9 h after their OOM).

    Only jobs colloc placed (:func:`placed_by_colloc`) are requeued: a user's gres/gpu
    job raises ValueError before Slurm is asked anything (issue 11, M5). The shard
    request is the requeue; a refused priority boost or AdminComment update does not
    undo it: their messages are returned instead.

    The steps are :mod:`.requeue_steps`': when slurmctld does not answer, its
    ``ControllerAway`` carries the plan (``record``: this attempt's record, for the
    retry to rewrite if the requeue never lands) so a detached helper can go on.
    ``confirm`` gets the plan once Slurm answered every step (accepted or refused):
    the release confirmation's marker (the retry helper leaves its own).
    """
    if not placed_by_colloc(ctx):
        raise ValueError(
            f"job {ctx.job_id} was not placed by colloc (gres/gpu request): not requeued"
        )
    if new_shards <= 0:
        raise ValueError(f"job {ctx.job_id}: refusing a request of {new_shards} shards")
    import time

    plan = requeue_steps.RequeuePlan(
        job_id=ctx.job_id, attempt=ctx.restarts, new_shards=new_shards,
        resize=new_shards != ctx.shards or not ctx.is_shared, nice=max(0, nice),
        admin_comment=admin_comment or None, record=record, decided_at=time.time(),
    )
    try:
        errors = requeue_steps.advance(plan, adapter)
    except requeue_steps.ControllerAway:
        raise
    except SlurmError:
        if confirm is not None:
            confirm(plan)  # a hold that landed must not stay: the collector checks
        raise
    if confirm is not None:
        confirm(plan)
    return errors
