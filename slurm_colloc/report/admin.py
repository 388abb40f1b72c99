"""Admin view over a period: ``colloc report --since DATE [--user U]``.

- jobs collocated: colloc jobs that shared a GPU with another job during their run
  (overlapping time on the same GPU among the period's jobs, or co-tenants in the
  record); holding fewer shards than a GPU has while running alone is not sharing;
- GPU-hours allocated and saved against whole-GPU allocation (allocated + saved =
  whole-GPU-equivalent; saved only while sharing): :mod:`.usage` has the rules;
- OOM crashes and recoveries (a recovery: a requeued job that then completed);
- estimator accuracy: estimate vs measured peak of completed attempts, per estimator.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from slurm_colloc.config import CollocConfig, RecordField
from slurm_colloc.gpu.budget import config_budget
from slurm_colloc.report.inquirer import JobRow
from slurm_colloc.report.usage import Usage, job_records, report_usage


@dataclass
class EstimatorStats:
    """Accuracy of one estimator over the period."""

    estimator: str
    jobs: int = 0
    under: int = 0
    """Jobs whose measured peak exceeded the estimate."""
    median_error_pct: float | None = None
    """Median of (estimate - peak) / peak, in percent (positive = over-estimate)."""
    errors: list[float] = field(default_factory=list)


@dataclass
class PeriodSummary:
    """The admin view's figures."""

    since: str
    user: str | None
    jobs: int = 0
    colloc_jobs: int = 0
    collocated: int = 0
    gpu_hours_used: float = 0.0
    gpu_hours_saved: float = 0.0
    whole_gpu_hours: float = 0.0
    """gpu_hours_used + gpu_hours_saved (a whole GPU per attempt)."""
    oom_crashes: int = 0
    recovered: int = 0
    estimators: list[EstimatorStats] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """Jobs left out (malformed accounting data), one line each naming the job."""

    def to_json(self) -> dict[str, Any]:
        """JSON form (without the raw error lists)."""
        d = asdict(self)
        for e in d["estimators"]:
            e.pop("errors")
        return d


@dataclass
class _JobFold:
    """One job's contribution to the period (committed only when it folded cleanly)."""

    collocated: bool = False
    hours_whole: float = 0.0
    hours_used: float = 0.0
    hours_saved: float = 0.0
    oom_crashes: int = 0
    recovered: bool = False
    accuracy: tuple[str, bool, float] | None = None
    """(estimator, under-estimated, error %) of a completed, measured job."""


def _fold_job(lines: list[JobRow], u: Usage | None,
              prefer: RecordField = "admin_comment") -> _JobFold | None:
    """A colloc job's figures from its accounting lines and usage (None: records
    unreadable); None for a non-colloc job (``prefer``: config ``record_field``)."""
    rec, sub = job_records(lines, prefer)
    if rec is None and sub is None:
        return None
    if u is None:
        raise ValueError("records unreadable")
    f = _JobFold()
    attempts = rec.attempts if rec else ()
    f.collocated, f.hours_saved, f.hours_used = u.shared, u.gpu_hours_saved, u.gpu_hours
    f.hours_whole = u.whole_gpu_hours
    f.oom_crashes = u.gpu_crashes
    # latest attempt: sacct does not order them; one not started yet is the latest
    final = max(
        enumerate(lines),
        key=lambda p: (p[1].start if p[1].start is not None else float("inf"), p[0]),
    )[1].state
    f.recovered = any(a.requeue and a.requeue.requeued for a in attempts) and (
        final == "COMPLETED")
    done = [a for a in attempts if a.metrics and a.metrics.peak_mib and not a.oom]
    est = attempts[0].estimate if attempts and attempts[0].estimate else None
    if done and est and est.mib:
        peak = done[-1].metrics.peak_mib if done[-1].metrics else None
        if peak:
            f.accuracy = (est.estimator, peak > est.mib, (est.mib - peak) / peak * 100)
    if not all(math.isfinite(x) for x in (f.hours_used, f.hours_saved)):
        raise OverflowError("elapsed time out of range")
    return f


def summarize_period(rows: list[JobRow], cfg: CollocConfig, since: str,
                     user: str | None, now: float | None = None) -> PeriodSummary:
    """Aggregate the period's accounting lines (pure).

    A job whose lines or record cannot be folded (absurd numbers, a record that
    decodes but makes no sense) is left out with a line in ``warnings`` naming it:
    one crafted job must not take the admin view down for everyone.
    """
    site_budget = config_budget(cfg)
    spg = site_budget.shards_per_gpu if site_budget else 40
    by_job: dict[str, list[JobRow]] = {}
    for r in rows:
        by_job.setdefault(r.job_id, []).append(r)
    out = PeriodSummary(since=since, user=user, jobs=len(by_job))
    if site_budget is None:
        out.warnings.append(f"gpu_memory_mib = 0 in colloc.conf: GPU-hours assume {spg} "
                            "shards per GPU; set gpu_memory_mib to your GPUs' memory")
    stats: dict[str, EstimatorStats] = {}
    for lines in by_job.values():
        lines.sort(key=lambda r: (r.start is None, r.start or 0))
    usage = report_usage(by_job, spg, cfg.record_field, now)
    for job_id, lines in by_job.items():
        try:
            f = _fold_job(lines, usage.get(job_id), cfg.record_field)
        except Exception as e:  # noqa: BLE001 - any bad job is skipped, never fatal
            out.warnings.append(f"job {job_id}: skipped, its accounting data is malformed "
                                f"({type(e).__name__})")
            continue
        if f is None:
            continue
        out.colloc_jobs += 1
        out.collocated += f.collocated
        out.gpu_hours_used += f.hours_used
        out.gpu_hours_saved += f.hours_saved
        out.whole_gpu_hours += f.hours_whole
        out.oom_crashes += f.oom_crashes
        out.recovered += f.recovered
        if f.accuracy is not None:
            name, under, err = f.accuracy
            s = stats.setdefault(name, EstimatorStats(name))
            s.jobs += 1
            s.under += under
            s.errors.append(err)
    for s in stats.values():
        s.median_error_pct = round(statistics.median(s.errors), 1) if s.errors else None
    out.estimators = sorted(stats.values(), key=lambda s: -s.jobs)
    out.whole_gpu_hours = round(out.whole_gpu_hours, 3)
    out.gpu_hours_used = round(out.gpu_hours_used, 3)
    out.gpu_hours_saved = round(out.gpu_hours_saved, 3)  # each rounded: sums to +-0.001
    return out


def render(p: PeriodSummary) -> Any:
    """rich renderable of the admin view.

    Every string that comes from Slurm or a job record goes in as :class:`Text`
    (never parsed as markup) through :func:`~slurm_colloc.report.text.safe`.
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from slurm_colloc.report.text import safe

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_row("Jobs in period", str(p.jobs))
    head.add_row("colloc jobs", str(p.colloc_jobs))
    head.add_row("Collocated (shared a GPU)", str(p.collocated))
    head.add_row("GPU-hours allocated", f"{p.gpu_hours_used:.2f}")
    head.add_row("GPU-hours saved vs whole GPUs", f"{p.gpu_hours_saved:.2f}")
    head.add_row("Whole-GPU-equivalent GPU-hours", f"{p.whole_gpu_hours:.2f}")
    head.add_row("GPU OOM crashes", str(p.oom_crashes))
    head.add_row("Recovered by requeue", str(p.recovered))
    t = Table("estimator", "jobs", "under-estimated", "median error", header_style="bold")
    for s in p.estimators:
        t.add_row(safe(s.estimator), str(s.jobs), str(s.under),
                  "-" if s.median_error_pct is None else f"{s.median_error_pct:+.0f}%")
    title = safe(f"colloc usage since {p.since}" + (f" for {p.user}" if p.user else ""))
    title.stylize("bold")
    parts: list[Any] = [title, head, Text(""),
                        Text("Estimator accuracy (estimate vs measured peak)", style="bold"), t]
    if p.warnings:
        parts += [Text(""), Text("Skipped", style="bold yellow")]
        parts += [safe(f"  * {w}") for w in p.warnings]
    return Group(*parts)
