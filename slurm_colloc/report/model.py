"""The report of one job as data: built from accounting, the colloc record and series.

Pure functions over what an :class:`~slurm_colloc.report.inquirer.Inquirer` returns;
the renderers (text, JSON, HTML) only format a :class:`JobReport`.

An attempt's time series comes from the node-local store when it is readable here
(the full series: plots, idle phases, co-tenants over time), else from the accounting
record's downsampled series (``MetricsSummary.series``, a few dozen points), so the
report shows plots on any host; :attr:`AttemptView.series_source` says which.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from slurm_colloc.accounting.codec import try_decode
from slurm_colloc.accounting.field import record_texts
from slurm_colloc.accounting.record import Attempt, JobRecord
from slurm_colloc.accounting.submit_record import CollocRecord, parse_record
from slurm_colloc.config import CollocConfig, RecordField
from slurm_colloc.gpu.budget import config_budget
from slurm_colloc.metrics import store
from slurm_colloc.metrics.summary import IDLE_SM_PCT, summarize
from slurm_colloc.oom.alloc import in_lines
from slurm_colloc.report.inquirer import Inquirer, JobRow, parse_time
from slurm_colloc.report.lost_work import add_lost_work

SOURCE_LOCAL = "node-local"
SOURCE_ACCOUNTING = "accounting"
MAX_RECORD_POINTS = 1000
"""Points of a record's series the report uses at most (the epilog writes 48)."""

RUNNING = frozenset({"RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED"})
SCHEMA_VERSION = 2
"""Version of the ``--json`` objects (job report and job table); bumped when a key
changes meaning or goes away (new keys do not bump it)."""


class UnknownJobError(LookupError):
    """Neither the controller nor accounting knows the job."""


@dataclass
class AttemptView:
    """One attempt as the report shows it (None = not known / not measured)."""

    attempt: int
    outcome: str
    node: str | None = None
    gpu: int | None = None
    shards: int | None = None
    limit_mib: int | None = None
    estimate_mib: int | None = None
    estimator: str | None = None
    peak_mib: int | None = None
    mean_mib: float | None = None
    sm_activity: float | None = None
    """0..1, mean over the attempt."""
    sm_source: str | None = None
    """``sm-activity`` (DCGM profiling or sim) or ``utilization`` (NVML only)."""
    energy_j: float | None = None
    samples: int = 0
    co_tenants: list[str] = field(default_factory=list)
    oom: dict[str, Any] | None = None
    requeue: dict[str, Any] | None = None
    start: int | None = None
    end: int | None = None
    idle_fraction: float | None = None
    """Share of samples with SM activity under 5 % (needs the series)."""
    tenants_timeline: list[dict[str, Any]] = field(default_factory=list)
    """Per co-tenant: first and last time seen (needs the node-local series)."""
    series_source: str | None = None
    """``node-local`` (full series), ``accounting`` (downsampled) or None (no series)."""
    series_points: list[list[float | int | None]] = field(default_factory=list)
    """The plotted points: [seconds since the attempt's start, memory MiB (max),
    activity % (SM activity, or utilisation when ``sm_source`` says so) or None]."""
    waited_s: int | None = None
    """Seconds the attempt queued: sacct's Submit to Start (a requeue starts a new
    Submit, so a rerun's wait counts from its requeue)."""
    unenforced: list[list[float]] | None = None
    """Spans [from, to] (epoch seconds) in which the attempt ran with no collector on
    its node: limits not enforced, nothing sampled. None: not known on this host (the
    node's record is read where the node's ``metrics_dir`` is); [] none found."""
    sampling: dict[str, Any] | None = None
    """Holes in the attempt's sampling (:mod:`slurm_colloc.metrics.gaps`):
    ``{"span_s", "unsampled_s", "source", "gaps": [{"from", "to", "cause"}]}`` (epoch
    seconds; cause ``collector``: it was not running, nothing sampled or enforced;
    ``job``: no process of the job on its GPU). ``source``: ``record`` (the epilog's)
    or ``series`` (from the node-local series now: a running job). None: not known
    (a record written before gaps were kept, and no series here)."""
    unscanned: list[str] = field(default_factory=list)
    """Job logs the epilog could not scan, ``"<path>: <why>"`` (a FIFO, a deleted
    file, ...): the attempt's cause was not looked for there (issue 28)."""
    state: str | None = None
    """sacct's State of this attempt (the job's for the last one)."""
    exit_code: str | None = None
    """sacct's ExitCode of this attempt, ``N:S`` as ``sacct -o ExitCode`` prints it
    (``0:9``: killed by SIGKILL)."""
    enforcement: dict[str, Any] | None = None
    """The collector's verdict on the attempt, as the epilog kept it: ``kind``
    (``over_limit``/``outside_mps``), ``action`` (``killed``, ``flagged``...),
    ``peak_mib``, ``limit_mib``, ``outside_mps``. None: none."""
    story: dict[str, Any] | None = None
    """Who stopped the attempt and why, in words (:func:`slurm_colloc.report.story.of`):
    ``cause``, ``summary``, ``exit_code``, ``exit``, ``measured``, ``flag``."""
    lost_work: dict[str, Any] | None = None
    """Work an OOM cost (:mod:`slurm_colloc.report.lost_work`): ``checkpoint_dir``,
    ``last_checkpoint`` (epoch s) and ``lost_s``, the time from the job's last
    checkpoint to the attempt's end. None: not known (no checkpoint before it, the
    feature off, or the report not run as the job's user)."""

    @property
    def series_label(self) -> str:
        """Where the attempt's series comes from, in words."""
        n = len(self.series_points)
        if self.series_source == SOURCE_LOCAL:
            return f"node-local full series ({n} points)"
        if self.series_source == SOURCE_ACCOUNTING:
            return f"accounting (downsampled, {n} points)"
        return "none (no node-local series on this host, none in the accounting record)"


@dataclass
class JobReport:
    """Everything ``colloc-report`` says about one job."""

    job_id: str
    name: str
    user: str
    state: str
    exit_code: str
    node: str
    elapsed_s: int | None
    colloc: bool
    """The job carries colloc data (a submit record or attempt records)."""
    submitted: dict[str, Any] | None
    attempts: list[AttemptView]
    recommendations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    shards_per_gpu: int | None = None
    shard_mib: int | None = None
    gpu_memory_mib: int | None = None
    series: dict[int, store.Series] = field(default_factory=dict)
    truncated: bool = False
    request: str = ""
    """What Slurm was asked for (sacct's ReqTRES, or the controller's TRES while running)."""
    pending: dict[str, Any] | None = None
    """For a job the controller still has pending: its ``reason`` and signed ``nice``."""
    accounting: str | None = None
    """None when accounting answered; else "accounting unreachable: ..." and what the
    report was built from instead (the controller, this node's store): issue 28."""
    next_estimate: dict[str, Any] | None = None
    """What the next ``--colloc`` run of this model will be sized from: the owner's
    runs used and those set aside and why (:mod:`slurm_colloc.report.next_estimate`,
    issue 27). None: no model key, or no accounting history here."""

    @property
    def running(self) -> bool:
        """The job has not finished yet (the report shows what is known so far)."""
        return self.state in RUNNING

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object (stable keys; see docs/report.md)."""
        d = {"schema_version": SCHEMA_VERSION, **asdict(self)}
        d.pop("series")
        d["running"] = self.running
        d["series_available"] = sorted(self.series)
        for a, v in zip(d["attempts"], self.attempts, strict=True):
            a["series_label"] = v.series_label
        return d


def _outcome(a: Attempt, row: JobRow | None, last: bool, job_state: str) -> str:
    if a.requeue and a.requeue.requeued:
        cause = a.oom.cause if a.oom else "failure"
        return f"{cause}, requeued"
    if a.oom and a.oom.cause != "none":
        return f"{a.oom.cause}" + (f" ({row.state})" if row and row.state else "")
    if last:
        return job_state
    return row.state if row and row.state else "ended"


def _evidence(oom: dict[str, Any], node: str | None, inquirer: Inquirer) -> None:
    """Add to ``oom`` whether its evidence is readable here, and where it is if not."""
    path = oom.get("evidence")
    if not path:
        return
    chk = inquirer.evidence(str(path))
    on = f"on node {node}" if node else "on the compute node"
    oom["evidence_readable"] = chk.readable
    oom["evidence_status"] = chk.status
    oom["evidence_tail"] = list(chk.tail)
    oom["evidence_where"] = {
        "readable": f"{path} (readable here)",
        "absent": f"{path} {on} (not on this host)",
        "denied": f"{path} (not readable by you; kept {on})",
        "not-a-file": f"{path} (not a regular file here, not opened; kept {on})",
    }.get(chk.status, f"{path} (not a usable path)")


def _alloc_from_tail(oom: dict[str, Any]) -> None:
    """A record written before the epilog kept the failed allocation: read it from the
    evidence tail when that is readable here."""
    if oom.get("alloc_mib") is not None or oom.get("cause") != "gpu-oom":
        return
    found = in_lines(list(oom.get("evidence_tail") or []))
    if found is not None:
        oom["alloc_mib"], oom["in_use_mib"] = found.alloc_mib, found.in_use_mib


def series_from_record(job_id: str, a: Attempt) -> store.Series | None:
    """The record's downsampled series of attempt ``a`` as store rows (None if none).

    Row times are seconds since the attempt's start; SM activity goes into ``sm_pct``
    when DCGM measured it, else into ``util_pct`` (what the epilog averaged). Points
    that are not (int >= 0, int >= 0, 0..100 or None) are skipped.
    """
    m = a.metrics
    if m is None or not m.series:
        return None
    rows: list[store.Row] = []
    for p in tuple(m.series)[:MAX_RECORD_POINTS]:
        try:
            t, mib, act = p
        except (TypeError, ValueError):
            continue
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            continue
        if isinstance(mib, bool) or not isinstance(mib, int) or mib < 0:
            continue
        pct: float | None = None
        if isinstance(act, (int, float)) and not isinstance(act, bool):
            pct = min(100.0, max(0.0, float(act)))
        rows.append(store.Row(t=float(t), gpu=a.gpu if a.gpu is not None else -1,
                              mem_mib=float(mib), mem_max_mib=mib, gpu_mem_mib=0,
                              sm_pct=pct if m.dcgm else None,
                              util_pct=None if m.dcgm else pct))
    if not rows:
        return None
    rows.sort(key=lambda r: r.t)
    return store.Series(job_id, a.attempt, rows)


def _points(s: store.Series, start: float | None) -> list[list[float | int | None]]:
    rows = s.rows
    t0 = start if start is not None and start <= rows[0].t else rows[0].t
    return [[round(r.t - t0, 1), r.mem_max_mib,
             None if (act := r.sm_pct if r.sm_pct is not None else r.util_pct) is None
             else round(act, 1)] for r in rows]


def _view(a: Attempt, outcome: str) -> AttemptView:
    m = a.metrics
    v = AttemptView(
        attempt=a.attempt, outcome=outcome, node=a.node, gpu=a.gpu, shards=a.shards,
        limit_mib=a.limit_mib, estimate_mib=a.estimate.mib if a.estimate else None,
        estimator=a.estimate.estimator if a.estimate else None,
        co_tenants=list(a.co_tenants), start=a.start, end=a.end,
    )
    if m is not None:
        v.peak_mib, v.mean_mib, v.energy_j = m.peak_mib, m.mean_mib, m.energy_j
        v.samples = m.samples
        v.sm_activity = m.mean_sm_activity
        v.sm_source = None if m.mean_sm_activity is None else (
            "sm-activity" if m.dcgm else "utilization")
    v.unscanned = list(a.unscanned)
    if a.oom and a.oom.cause != "none":
        v.oom = {"cause": a.oom.cause, "pattern": a.oom.pattern_id,
                 "evidence": a.oom.evidence_path, "whole_gpu": a.oom.whole_gpu,
                 "alloc_mib": a.oom.alloc_mib, "in_use_mib": a.oom.in_use_mib,
                 "culprit": a.oom.culprit}
    if a.enforcement is not None:
        v.enforcement = asdict(a.enforcement)
    if m is not None and m.span_s is not None:
        t0 = a.start or 0
        v.sampling = _sampling(m.span_s, [(t0 + o, t0 + o + n, c) for o, n, c in m.gaps],
                               "record")
    if a.requeue:
        v.requeue = {"requeued": a.requeue.requeued, "reason": a.requeue.reason,
                     "new_request": a.requeue.new_request,
                     "new_limit_mib": a.requeue.new_limit_mib}
    return v


def _sampling(span_s: float, gaps: list[tuple[float, float, str]],
              source: str) -> dict[str, Any]:
    """The :attr:`AttemptView.sampling` object."""
    return {"span_s": round(span_s), "unsampled_s": round(sum(b - a for a, b, _ in gaps)),
            "source": source,
            "gaps": [{"from": round(a), "to": round(b), "cause": c} for a, b, c in gaps]}


def _live_sampling(v: AttemptView, s: store.Series, interval: float) -> None:
    """Gaps from the node-local series when the record has none (a running job, or a
    record written before gaps were kept); the collector's events say which are its."""
    import time

    from slurm_colloc.metrics.gaps import sampling_gaps

    if v.sampling is not None or v.start is None or not s.rows:
        return
    end = float(v.end) if v.end is not None else time.time()
    down = [(a, b) for a, b in v.unenforced or []]
    found = sampling_gaps(s.rows, float(v.start), end, interval, down)
    v.sampling = _sampling(end - v.start, [(g.start, g.end, g.cause) for g in found],
                           "series")


def _apply_series(v: AttemptView, s: store.Series) -> None:
    rows = s.rows
    if not rows:
        return
    if v.samples == 0:  # running job, or no record yet: use the series itself
        summ, tenants = summarize(rows)
        if summ is not None:
            v.peak_mib, v.mean_mib, v.energy_j = summ.peak_mib, summ.mean_mib, summ.energy_j
            v.samples = summ.samples
            v.sm_activity = summ.mean_sm_activity
            if summ.mean_sm_activity is not None:
                v.sm_source = "sm-activity" if summ.dcgm else "utilization"
            v.co_tenants = sorted(set(v.co_tenants) | set(tenants), key=store._job_key)
        v.start = v.start or int(rows[0].t)
    act = [(r.sm_pct if r.sm_pct is not None else r.util_pct, r.n) for r in rows]
    known = [(x, n) for x, n in act if x is not None]
    if known:
        v.idle_fraction = round(sum(n for x, n in known if x < IDLE_SM_PCT)
                                / sum(n for _, n in known), 3)
    seen: dict[str, list[float]] = {}
    for r in rows:
        for t in r.tenants:
            span = seen.setdefault(t, [r.t, r.t])
            span[1] = r.t
    v.tenants_timeline = [{"job_id": j, "from": round(a - rows[0].t, 1),
                           "to": round(b - rows[0].t, 1)}
                          for j, (a, b) in sorted(seen.items(), key=lambda kv: kv[1][0])]


def _submitted(rec: CollocRecord | None) -> dict[str, Any] | None:
    if rec is None:
        return None
    return {"mode": rec.mode, "estimate_mib": rec.est_mib or rec.need_mib,
            "estimator": rec.estimator or rec.mode, "need_mib": rec.need_mib,
            "shards": rec.shards, "shard_mib": rec.shard_mib, "alloc_mib": rec.alloc_mib,
            "fingerprint": rec.fingerprint, "sm_pct": rec.sm_pct, "sm_source": rec.sm_source,
            "mem_shards": rec.mem_shards}


def _live_attempt(rec: CollocRecord | None, live: dict[str, Any], n: int,
                  meta: store.JobMeta | None, earlier: list[Attempt]) -> Attempt:
    """A synthetic record of the attempt running now (no epilog has written it yet).

    Its limit: the prolog's meta when the node store is readable here, else what the
    job was given: the submit record's allocation for the first attempt, the
    requeue's new limit for a later one (never "unknown" on a login host).
    """
    from slurm_colloc.accounting.record import Estimate
    from slurm_colloc.node.job import context_from_record

    ctx = context_from_record(0, 0, {}, live)
    est = Estimate(mib=rec.est_mib or rec.need_mib, estimator=rec.estimator or rec.mode) \
        if rec else None
    limit = meta.limit_mib if meta else None
    before = [a for a in earlier if a.attempt < n]
    if limit is None and before and before[-1].requeue and before[-1].requeue.new_limit_mib:
        limit = before[-1].requeue.new_limit_mib
    if limit is None and rec is not None and not before:
        limit = rec.alloc_mib or rec.shards * rec.shard_mib or None
    return Attempt(attempt=n, estimate=est, shards=ctx.shards or None, limit_mib=limit,
                   gpu=ctx.gpu, node=str(live.get("NodeList", "")) or None,
                   start=(int(meta.start) if meta else None)
                   or parse_time(str(live.get("StartTime", ""))))


def _elapsed(last: JobRow | None, live: dict[str, Any] | None) -> int | None:
    """Accounting's elapsed time, else (a job only the controller knows yet) since its
    start."""
    if last is not None and last.elapsed_s is not None:
        return last.elapsed_s
    start = parse_time(str((live or {}).get("StartTime", "")))
    if start is None:
        return None
    import time

    return max(0, int(time.time()) - start)


def assemble(job_id: str, inquirer: Inquirer, cfg: CollocConfig) -> JobReport:
    """The facts of ``job_id`` (notes and advice are :mod:`.recommend`'s, added by
    :func:`slurm_colloc.report.job.build`); raises :class:`UnknownJobError` for an
    unknown job."""
    rows = inquirer.job_rows(job_id)
    live = inquirer.live(job_id) if not rows or rows[-1].state in RUNNING else None
    away = inquirer.accounting_away()
    if not rows and live is None:
        raise UnknownJobError(f"job {job_id}: {away}; the controller no longer has the job"
                              if away else
                              f"job {job_id}: not known to Slurm (controller or accounting)")
    last = rows[-1] if rows else None
    state = str(live.get("JobState", "")) if live else (last.state if last else "UNKNOWN")
    record, sub = _records(rows, live, cfg.record_field)
    attempts = list(record.attempts) if record else []
    # an array task (123_4) has a raw id of its own: the node store is keyed by it
    raw = last.job_id if last else str((live or {}).get("JobId") or job_id)
    metas = inquirer.metas(raw)
    restarts = int(str(live.get("Restarts", "0") or "0")) if live else None
    if live is not None and state in RUNNING and state != "PENDING" and (sub or metas):
        n = restarts or 0
        if all(a.attempt != n for a in attempts):
            attempts.append(_live_attempt(sub, live, n, metas.get(n), attempts))
    views = []
    for i, a in enumerate(attempts):
        row = rows[i] if len(rows) == len(attempts) else None
        is_last = i == len(attempts) - 1
        views.append(_view(a, _outcome(a, row, is_last, state)))
        views[-1].state = row.state if row else (state if is_last else None)
        views[-1].exit_code = (row.exit_code if row else
                               (last.exit_code if is_last and last else None)) or None
        if row is not None and row.start is not None and row.submit is not None:
            views[-1].waited_s = max(0, row.start - row.submit)
    series = _attach_series(raw, attempts, views, metas, inquirer)
    for v in views:
        if v.series_source == SOURCE_LOCAL:
            _live_sampling(v, series[v.attempt], cfg.sample_interval_s)
    add_lost_work(views, cfg.checkpoint_dir, last.user if last else "", raw)
    site_budget = config_budget(cfg)
    return JobReport(
        job_id=job_id, name=last.name if last else str(live.get("JobName", "") if live else ""),
        user=last.user if last else str(live.get("UserId", "") if live else ""),
        state=state, exit_code=last.exit_code if last else "",
        node=(last.node if last else "") or str((live or {}).get("NodeList", "")),
        elapsed_s=_elapsed(last, live),
        colloc=bool(sub or attempts), submitted=_submitted(sub), attempts=views,
        shards_per_gpu=site_budget.shards_per_gpu if site_budget else None,
        shard_mib=cfg.shard_mib, gpu_memory_mib=cfg.gpu_memory_mib or None,
        series=series, truncated=bool(record and record.truncated),
        request=(last.req_tres if last else "") or str((live or {}).get("TresPerNode", "") or ""),
        pending=_pending(live, state),
        accounting=_degraded(away, live is not None, bool(metas)),
    )


def _degraded(away: str | None, live: bool, local: bool) -> str | None:
    """The report's one line about its sources while accounting is away."""
    if away is None:
        return None
    used = [w for w, ok in (("the controller's view of the job", live),
                            ("this node's metrics store", local)) if ok]
    return (f"{away}; shown from {' and '.join(used) or 'what could be reached'}: "
            "attempts not yet written to accounting may be missing")


def _pending(live: dict[str, Any] | None, state: str) -> dict[str, Any] | None:
    """Reason and nice of a job still waiting (None once it runs or ends)."""
    if live is None or state not in ("PENDING", "REQUEUED"):
        return None
    try:
        nice = int(str(live.get("Nice", "0") or "0"))
    except ValueError:
        nice = 0
    return {"reason": str(live.get("Reason", "") or "None"), "nice": nice}


def _records(rows: list[JobRow], live: dict[str, Any] | None,
             prefer: RecordField = "admin_comment",
             ) -> tuple[JobRecord | None, CollocRecord | None]:
    """The fullest accounting record and the submit record among the job's comments."""
    # colloc's record may be in AdminComment or SystemComment: per row the configured
    # field last, so that it wins a tie (a later text with as many attempts wins)
    comments = [t for r in rows for t in reversed(r.record_texts(prefer))]
    if live:
        comments += reversed(record_texts({k: str(live.get(k, "") or "")
                                           for k in ("AdminComment", "SystemComment")},
                                          prefer))
    record: JobRecord | None = None
    sub: CollocRecord | None = None
    for c in comments:
        r = try_decode(c)
        if r is not None and (record is None or len(r.attempts) >= len(record.attempts)):
            record = r
    for c in [r.admin_comment for r in rows] + ([str(live.get("AdminComment", ""))]
                                                if live else []):
        sub = sub or parse_record(c)
    return record, sub


def _attach_series(raw: str, attempts: list[Attempt], views: list[AttemptView],
                   metas: dict[int, store.JobMeta], inquirer: Inquirer,
                   ) -> dict[int, store.Series]:
    """Each attempt's series (node-local when readable here, else the accounting
    record's downsampled one), the prolog's limit and start, and its evidence."""
    series: dict[int, store.Series] = {}
    for a, v in zip(attempts, views, strict=True):
        s = inquirer.series(raw, v.attempt)
        if s is not None and s.rows:
            series[v.attempt] = s
            _apply_series(v, s)
            v.series_source = SOURCE_LOCAL
        meta = metas.get(v.attempt)
        if meta is not None:
            v.limit_mib = v.limit_mib or meta.limit_mib
            v.start = v.start or int(meta.start) or None
        if v.series_source == SOURCE_LOCAL:
            v.series_points = _points(series[v.attempt], v.start)
        elif (rs := series_from_record(raw, a)) is not None:
            # no node-local series here (login host): the record's downsampled one
            series[v.attempt] = rs
            v.series_source = SOURCE_ACCOUNTING
            v.series_points = _points(rs, 0.0)
        if v.oom is not None:
            _evidence(v.oom, v.node, inquirer)
            _alloc_from_tail(v.oom)
        if v.start is not None:
            found = inquirer.collector_gaps(raw, v.start, v.end)
            v.unenforced = None if found is None else [[a, b] for a, b in found]
    return series
