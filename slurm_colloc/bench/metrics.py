"""Per-policy metrics of one replay, computed from collected outcomes and GPU samples."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slurm_colloc.bench import lag as L
from slurm_colloc.bench.collect import JobOutcome
from slurm_colloc.bench.sampler import GpuPoint
from slurm_colloc.bench.trace import TraceJob


@dataclass(frozen=True)
class PolicyMetrics:
    """One row of the results table. Times are hours of the real (uncompressed) trace."""

    trace: str
    policy: str
    jobs: int
    completed: int
    lost: int
    makespan_h: float
    mean_jct_h: float
    p95_jct_h: float
    mean_wait_h: float
    gpu_busy_share: float
    energy_kwh: float
    oom_crashes: int
    requeues: int
    fallbacks: int
    makespan_vs_whole: float
    energy_vs_whole: float
    wall_s: float
    energy_common_kwh: float = math.nan
    """Energy from trace start until the *last* policy of the replay finished: a policy
    that finishes early keeps paying its GPUs' idle power (issue 14)."""
    energy_common_vs_whole: float = math.nan
    completed_gpu_h: float = math.nan
    """GPU-hours of work (solo run time x GPUs) of the jobs that completed."""
    kwh_per_gpu_h: float = math.nan
    """``energy_common_kwh / completed_gpu_h``: energy per unit of work done."""
    kwh_per_gpu_h_vs_whole: float = math.nan
    time_scale: float = math.nan
    idle_while_queued: float = math.nan
    """Share of GPU samples idle while a job waited (:func:`idle_while_queued`)."""
    start_lag_s: float = math.nan
    """Median wall seconds from Slurm's start to the job's first process on a GPU, less
    the clocks' quantisation (:mod:`slurm_colloc.bench.lag`): it does not compress."""
    stretch_slurm: float = math.nan
    """Work-weighted run time / solo work, by Slurm's start and end."""
    stretch_gpu: float = math.nan
    """The same from the first process on a GPU (start lag removed)."""
    makespan_corrected_h: float = math.nan
    """Makespan with the start lags of its critical chain at their real duration."""
    makespan_corrected_vs_whole: float = math.nan
    energy_corrected_kwh: float = math.nan
    """Own-makespan energy less the idle power of the removed excess latency."""
    energy_common_corrected_kwh: float = math.nan
    """``energy_corrected_kwh`` plus idle power up to the last corrected makespan."""
    energy_common_corrected_vs_whole: float = math.nan
    idle_power_w: float = math.nan
    """All GPUs' power with no process (median of the samples)."""
    p95_wait_h: float = math.nan
    """95th percentile of queue waits (submit to first start)."""
    recovery_wait_max_h: float = math.nan
    """Longest wait of a requeued job for its rerun (:attr:`JobOutcome.recovery_wait`);
    nan when no job was requeued."""


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def energy_between(points: Sequence[GpuPoint], t0: float, t1: float) -> float:
    """Joules all GPUs' energy counters advanced between wall times t0 and t1."""
    total = 0.0
    for gpu in sorted({p.gpu for p in points}):
        series = sorted((p.t, p.energy_j) for p in points if p.gpu == gpu)
        total += _interp(series, t1) - _interp(series, t0)
    return total


def _interp(series: list[tuple[float, float]], t: float) -> float:
    if not series:
        return 0.0
    if t <= series[0][0]:
        return series[0][1]
    for (ta, ea), (tb, eb) in itertools.pairwise(series):
        if ta <= t <= tb:
            return ea + (eb - ea) * ((t - ta) / (tb - ta) if tb > ta else 0.0)
    return series[-1][1]


def busy_share(points: Sequence[GpuPoint], t0: float, t1: float) -> float:
    """Share of GPU samples in [t0, t1] with at least one process on the GPU."""
    inside = [p for p in points if t0 <= p.t <= t1]
    return sum(1 for p in inside if p.processes > 0) / len(inside) if inside else math.nan


def last_end(outcomes: Sequence[JobOutcome], t0: float) -> float:
    """Wall time the last job of a policy ended (``t0`` when none did)."""
    ends = [o.end for o in outcomes if o.end is not None]
    return max(ends) if ends else t0


def policy_metrics(
    trace: str, policy: str, outcomes: Sequence[JobOutcome], points: Sequence[GpuPoint],
    *, t0: float, scale: float, n_jobs: int, fallbacks: int, wall_s: float,
    common_end: float | None = None, work_gpu_s: Mapping[str, float] | None = None,
    trace_jobs: Sequence[TraceJob] | None = None,
) -> PolicyMetrics:
    """Metrics of one policy; ``t0`` is the wall time of trace second 0.

    ``common_end``: wall time the last policy of the replay finished (energy over the
    common window); ``work_gpu_s``: GPU-seconds of work per job name (energy per
    completed GPU-hour); ``trace_jobs``: the trace (start lag and the figures
    corrected for it, :func:`lag_fields`).
    """
    h = scale / 3600.0
    done = [o for o in outcomes if not o.lost and o.end is not None]
    ends = [o.end for o in outcomes if o.end is not None]
    t_end = max(ends) if ends else t0
    jct = [(o.end - o.submit) * h for o in done if o.end is not None]
    waits = [(o.start - o.submit) * h for o in outcomes if o.start is not None]
    recovering = [o.recovery_wait for o in outcomes if o.recovery_wait is not None]
    return PolicyMetrics(
        trace=trace, policy=policy, jobs=n_jobs, completed=len(done),
        lost=n_jobs - len(done), makespan_h=(t_end - t0) * h,
        mean_jct_h=sum(jct) / len(jct) if jct else math.nan, p95_jct_h=percentile(jct, 95),
        mean_wait_h=sum(waits) / len(waits) if waits else math.nan,
        p95_wait_h=percentile(waits, 95),
        recovery_wait_max_h=max(recovering) * h if recovering else math.nan,
        gpu_busy_share=busy_share(points, t0, t_end),
        energy_kwh=energy_between(points, t0, t_end) / 3.6e6,
        oom_crashes=sum(o.oom_crashes for o in outcomes),
        requeues=sum(o.requeues for o in outcomes), fallbacks=fallbacks,
        makespan_vs_whole=math.nan, energy_vs_whole=math.nan, wall_s=wall_s,
        **_common(points, t0, common_end, done, work_gpu_s), time_scale=scale,
        **(lag_fields(outcomes, points, trace_jobs, t0=t0, scale=scale,
                      energy_kwh=energy_between(points, t0, t_end) / 3.6e6)
           if trace_jobs is not None else {}),
    )


def lag_fields(outcomes: Sequence[JobOutcome], points: Sequence[GpuPoint],
               trace_jobs: Sequence[TraceJob], *, t0: float, scale: float,
               energy_kwh: float) -> dict[str, float]:
    """Start lag and the figures without its compression excess (rule: lag module).

    Latency that does not scale with compression (prolog, MPS start, launch) counts at
    its real duration in trace time; the samples' and sacct's quantisation is removed.
    """
    h = scale / 3600.0
    prof = {j.name: j for j in trace_jobs}
    jobs = [L.JobTimes(o.name, (o.submit - t0) * h, (o.start - t0) * h, (o.end - t0) * h,
                       prof[o.name].steady_mib, prof[o.name].gpus, prof[o.name].work_s / 3600,
                       not o.lost, o.attempts)
            for o in outcomes if o.start is not None and o.end is not None and o.name in prof]
    lags = _lags(outcomes, points, jobs, t0=t0, scale=scale)
    known = [lg.lag_h for lg in lags if lg.lag_h is not None]
    lag_h = L.filled(lags)
    span, span_c = L.corrected_makespan(jobs, lag_h, scale)
    s_slurm, s_gpu = L.stretch(jobs, lag_h)
    idle = idle_power_w(points)
    e_c = L.corrected_energy_kwh(energy_kwh, span - span_c, 1, idle) if jobs else math.nan
    return {"start_lag_s": percentile(known, 50) * 3600 / scale if known else math.nan,
            "stretch_slurm": s_slurm, "stretch_gpu": s_gpu, "makespan_corrected_h": span_c,
            "energy_corrected_kwh": e_c, "idle_power_w": idle}


def _lags(outcomes: Sequence[JobOutcome], points: Sequence[GpuPoint],
          jobs: Sequence[L.JobTimes], *, t0: float, scale: float) -> list[L.Lag]:
    """Exact lags from the ledger where the replay kept one, else matched on the samples.

    Either way less the clocks' mean overstatement: sacct's whole second always, half
    a sample period only for lags read from samples.
    """
    h = scale / 3600.0
    if any(o.first_on_gpu is not None for o in outcomes):
        first = {o.name: (o.first_on_gpu - t0) * h for o in outcomes
                 if o.first_on_gpu is not None}
        return L.debiased(L.ledger_lags(jobs, first), L.quantisation_h(0.0, scale))
    samples = [((p.t - t0) * h, p.gpu, p.memory_mib, p.processes) for p in points]
    period = L.sample_period_s(samples, scale)
    return L.debiased(L.match_lags(jobs, L.steps(samples)),
                      L.quantisation_h(period if math.isfinite(period) else 1.0, scale))


def idle_power_w(points: Sequence[GpuPoint]) -> float:
    """Summed idle power of all GPUs: per GPU the median power of its idle samples."""
    total = 0.0
    for gpu in {p.gpu for p in points}:
        idle = [p.power_w for p in points if p.gpu == gpu and p.processes == 0]
        total += percentile(idle, 50) if idle else 0.0
    return total


def _common(points: Sequence[GpuPoint], t0: float, common_end: float | None,
            done: Sequence[JobOutcome], work_gpu_s: Mapping[str, float] | None,
            ) -> dict[str, float]:
    if common_end is None:
        return {}
    e = energy_between(points, t0, common_end) / 3.6e6
    out = {"energy_common_kwh": e}
    if work_gpu_s is not None:
        gpu_h = sum(work_gpu_s.get(o.name, 0.0) for o in done) / 3600.0
        out["completed_gpu_h"] = gpu_h
        out["kwh_per_gpu_h"] = e / gpu_h if gpu_h else math.nan
    return out

def relative_to(rows: list[PolicyMetrics], base: str = "whole-gpu") -> list[PolicyMetrics]:
    """Fill the ``*_vs_whole`` ratios against the ``base`` policy's row."""
    rows = _common_corrected(rows)
    ref = next((r for r in rows if r.policy == base), None)
    if ref is None:
        return rows
    from dataclasses import replace

    def ratio(a: float, b: float) -> float:
        return a / b if b and math.isfinite(b) else math.nan

    return [
        replace(r, makespan_vs_whole=ratio(r.makespan_h, ref.makespan_h),
                energy_vs_whole=ratio(r.energy_kwh, ref.energy_kwh),
                energy_common_vs_whole=ratio(r.energy_common_kwh, ref.energy_common_kwh),
                kwh_per_gpu_h_vs_whole=ratio(r.kwh_per_gpu_h, ref.kwh_per_gpu_h),
                makespan_corrected_vs_whole=ratio(r.makespan_corrected_h,
                                                  ref.makespan_corrected_h),
                energy_common_corrected_vs_whole=ratio(r.energy_common_corrected_kwh,
                                                       ref.energy_common_corrected_kwh))
        for r in rows
    ]


def _common_corrected(rows: list[PolicyMetrics]) -> list[PolicyMetrics]:
    """Corrected energy over the common window: idle power up to the last corrected end."""
    from dataclasses import replace

    spans = [r.makespan_corrected_h for r in rows if math.isfinite(r.makespan_corrected_h)]
    if not spans:
        return rows
    end = max(spans)
    return [replace(r, energy_common_corrected_kwh=r.energy_corrected_kwh + r.idle_power_w
                    * (end - r.makespan_corrected_h) / 1000.0) for r in rows]


def idle_while_queued(
    samples: Sequence[tuple[float, int]], waits: Sequence[tuple[float, float]],
) -> float:
    """Share of GPU samples ``(t, processes)`` with an idle GPU while a job was waiting.

    ``waits``: each job's (submit, first start) interval, same clock as the samples.
    Under whole GPUs this is the cost of Slurm's own latencies (scheduler passes,
    prolog, epilog) plus GPUs held back for a job that needs more of them; it shrinks
    as the time scale makes those latencies small next to job lengths.
    """
    if not samples:
        return math.nan
    idle = 0
    for t, procs in samples:
        if procs == 0 and any(s <= t < e for s, e in waits):
            idle += 1
    return idle / len(samples)
