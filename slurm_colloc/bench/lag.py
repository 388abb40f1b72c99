"""Start lag (Slurm start -> first process on a GPU) and its correction (issue 24, item 1).

A replay compresses the trace by ``scale`` but not Slurm's own latencies: a prolog
that takes 7 s of wall time costs 7 x 120 s = 14 trace minutes at x120 and half
that at x60. Such latency does not scale with compression, so here it counts at its
real duration in trace time: a job whose first process reached its GPU ``L`` wall
seconds after Slurm started it is charged ``L`` trace seconds, not ``L x scale``.

The committed result files have no per-job GPU record, only per-GPU samples (memory,
process count) every wall second. A job's arrival on a GPU is recognised by the
memory it adds: the sim's first footprint of a job is exactly its steady memory, so
the first step up by that amount on any GPU at or after the job's Slurm start is the
job's first process. Steps shared by two jobs in one sample interval are missed (the
job is then "unmatched": its lag is unknown and replaced by the policy's median).

Rule for the corrected figures (all in trace hours):

* a job's excess is ``lag_trace x (1 - 1/scale)``: what compression added;
* stretch by GPU time = (run time - lag) / solo work; by Slurm time = run time / work;
* corrected makespan = makespan - the excess along the critical chain (walk back from
  the last job to end: each job that waited was started by the latest end before its
  start; a job started on arrival ends the chain);
* corrected energy = energy - GPUs x idle power x (makespan - corrected makespan): the
  active energy is the jobs' work and does not move, only idle time is removed.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """A change of one GPU's memory between two samples."""

    t: float
    gpu: int
    delta_mib: int
    delta_procs: int


@dataclass(frozen=True)
class JobTimes:
    """One job of one policy, times in trace hours after trace start."""

    name: str
    submit_h: float
    start_h: float
    end_h: float
    steady_mib: int
    gpus: int = 1
    work_h: float = math.nan
    completed: bool = True
    attempts: int = 1


@dataclass(frozen=True)
class Lag:
    """A job's matched start lag (None: not recognised in the samples)."""

    name: str
    lag_h: float | None
    gpu: int | None


def steps(samples: Sequence[tuple[float, int, int, int]]) -> list[Step]:
    """Memory/process changes of every GPU from samples ``(t, gpu, memory_mib, procs)``."""
    by_gpu: dict[int, list[tuple[float, int, int]]] = {}
    for t, gpu, mem, procs in samples:
        by_gpu.setdefault(gpu, []).append((t, mem, procs))
    out = []
    for gpu, series in by_gpu.items():
        series.sort()
        for (_, m0, p0), (t1, m1, p1) in itertools.pairwise(series):
            if m1 != m0 or p1 != p0:
                out.append(Step(t1, gpu, m1 - m0, p1 - p0))
    out.sort(key=lambda s: (s.t, s.gpu))
    return out


def _fits(step: Step, mib: int, tol: float) -> bool:
    return step.delta_procs >= 0 and abs(step.delta_mib - mib) <= max(64.0, tol * mib)


def match_lags(jobs: Sequence[JobTimes], found: Sequence[Step], *, horizon_h: float = 0.5,
               tol: float = 0.03) -> list[Lag]:
    """Each job's first process: the first unused step up by its steady memory.

    Jobs are taken in Slurm start order, each step is used once; a multi-GPU job
    needs a step on each of its GPUs and its lag is its slowest rank's. ``horizon_h``
    bounds the search (trace hours after the start).
    """
    times = [s.t for s in found]
    used: set[int] = set()
    out = []
    for job in sorted(jobs, key=lambda j: (j.start_h, j.name)):
        got: list[int] = []
        i = bisect.bisect_left(times, job.start_h - 1e-9)
        while i < len(found) and found[i].t - job.start_h <= horizon_h and len(got) < job.gpus:
            on = {found[k].gpu for k in got}
            if i not in used and found[i].gpu not in on and _fits(found[i], job.steady_mib, tol):
                got.append(i)
            i += 1
        if len(got) < job.gpus:
            out.append(Lag(job.name, None, None))
            continue
        used.update(got)
        out.append(Lag(job.name, found[got[-1]].t - job.start_h, found[got[0]].gpu))
    return out


def quantisation_h(period_s: float, scale: float, clock_s: float = 1.0) -> float:
    """Mean overstatement of a measured lag by the two clocks it is read from, trace hours.

    sacct floors a start to the whole second (the true start is ``clock_s / 2`` later
    on average) and a process is seen at the first sample after it appeared (half a
    sample period late on average). At x120 with 1 s samples that is 2 trace minutes
    of a lag that never happened.
    """
    return (period_s / 2 + clock_s / 2) * scale / 3600.0


def debiased(lags: Sequence[Lag], bias_h: float) -> list[Lag]:
    """The lags less the clocks' mean overstatement (never below zero)."""
    return [Lag(lg.name, None if lg.lag_h is None else max(0.0, lg.lag_h - bias_h), lg.gpu)
            for lg in lags]


def sample_period_s(samples: Sequence[tuple[float, int, int, int]], scale: float) -> float:
    """Median wall seconds between two samples of one GPU (``t`` in trace hours)."""
    by_gpu: dict[int, list[float]] = {}
    for t, gpu, _, _ in samples:
        by_gpu.setdefault(gpu, []).append(t)
    gaps = sorted(b - a for ts in by_gpu.values() for a, b in itertools.pairwise(sorted(ts))
                  if b > a)
    return gaps[len(gaps) // 2] * 3600.0 / scale if gaps else math.nan


def ledger_lags(jobs: Sequence[JobTimes], first_h: Mapping[str, float]) -> list[Lag]:
    """Lags from the GPU ledger: each job's first process on a GPU (trace hours) minus
    its Slurm start; None where the ledger cannot say.

    A requeued job (``attempts`` > 1) gets None: its first process may be a later
    attempt's. An attempt that dies at its first allocation (an out-of-memory at start
    under a short ``--colloc-mem``) never registers on a GPU, so the ledger's first
    sighting is the next attempt's, hours later, and that wait is the queue for a
    whole GPU, not a start lag (heavy60h-041: 5-8 trace hours, which the critical-chain
    correction then removed from the makespan). Such jobs take the median lag.
    """
    out = []
    for j in jobs:
        first = first_h.get(j.name)
        lag = None if first is None or j.attempts > 1 else max(0.0, first - j.start_h)
        out.append(Lag(j.name, lag, None))
    return out


def filled(lags: Sequence[Lag]) -> dict[str, float]:
    """Lag per job in trace hours, unmatched jobs at the median of the matched ones."""
    known = sorted(lg.lag_h for lg in lags if lg.lag_h is not None)
    med = known[len(known) // 2] if known else 0.0
    return {lg.name: lg.lag_h if lg.lag_h is not None else med for lg in lags}


LAG_SHARE_LIMIT = 0.15
"""Largest start lag, as a share of the median job's work in trace time, at which a
replay's co-location figures are trusted (:func:`lag_share`). Set between what was
measured on 26.05: at 6-13 % (heavy60h x120, philly90h x60 run 1) raw and corrected
makespans agreed within 0.03; at 18 % (x60 run 2) 0.05; at 130-210 % (philly90h x120)
they were 0.26-0.30 apart and neither matched x60. An x30 run would say more."""


def lag_share(lag_s: float, scale: float, work_h: Sequence[float]) -> float:
    """A policy's median start lag (real seconds), compressed into trace time, as a
    share of the median job's work (trace hours); nan where either is unknown.

    Why: a lag keeps each job off its GPU, so the GPU holds fewer co-tenants and the
    jobs that run are slowed less. The correction (:func:`excess_h`) gives back the
    lag's time but cannot give back that crowding: on philly90h at x120 (lags of 13-21 s,
    26-42 trace minutes a job) colloc's corrected makespan was 0.67x of whole GPUs with
    a GPU-time stretch of 1.23, and at x60 (2-3 s) 0.82x with 1.47, raw and corrected
    alike. Above :data:`LAG_SHARE_LIMIT` the replay says to lower ``--time-scale``.
    """
    works = sorted(w for w in work_h if math.isfinite(w) and w > 0)
    if not works or not math.isfinite(lag_s):
        return math.nan
    return lag_s * scale / 3600.0 / works[len(works) // 2]


def excess_h(lag_h: float, scale: float) -> float:
    """Trace hours compression added to a latency of ``lag_h`` trace hours."""
    return lag_h * (1.0 - 1.0 / scale) if scale > 1 else 0.0


def stretch(jobs: Sequence[JobTimes], lag_h: dict[str, float]) -> tuple[float, float]:
    """Work-weighted stretch (sum of run time / sum of work) by Slurm and by GPU time.

    Completed single-attempt jobs only (a requeued job's start is its first
    attempt's). GPU time = Slurm run time minus the start lag.
    """
    one = [j for j in jobs if j.completed and j.attempts == 1 and j.work_h > 0]
    work = sum(j.work_h for j in one)
    if not work:
        return math.nan, math.nan
    slurm = sum(j.end_h - j.start_h for j in one)
    gpu = sum(j.end_h - j.start_h - lag_h.get(j.name, 0.0) for j in one)
    return slurm / work, gpu / work


def critical_chain(jobs: Sequence[JobTimes], *, slack_h: float = 1e-6) -> list[str]:
    """Names of the jobs on the chain that ends the makespan, last job first.

    A job that started later than its submission (plus ``slack_h``) was started
    by a release: its predecessor is the job with the latest end at or before its
    start. A job that started on arrival ends the chain.
    """
    done = [j for j in jobs if math.isfinite(j.end_h)]
    if not done:
        return []
    ends = sorted(done, key=lambda j: j.end_h)
    cur = ends[-1]
    chain = [cur.name]
    seen = {cur.name}
    while cur.start_h - cur.submit_h > slack_h:
        before = [j for j in ends if j.end_h <= cur.start_h + slack_h and j.name not in seen]
        if not before:
            break
        cur = before[-1]
        chain.append(cur.name)
        seen.add(cur.name)
    return chain


def handovers_h(jobs: Sequence[JobTimes], chain: Sequence[str]) -> list[float]:
    """Gaps on the chain between a job's end and the start of the job it released.

    Slurm's epilog, its next scheduling pass and the job's launch: latency that does
    not scale with compression either, kept apart from the start lag because part of
    it (a scheduler pass) is a site's cost too at any compression.
    """
    by = {j.name: j for j in jobs}
    return [max(0.0, by[a].start_h - by[b].end_h) for a, b in itertools.pairwise(chain)]


def corrected_makespan(jobs: Sequence[JobTimes], lag_h: dict[str, float], scale: float,
                       *, handovers: bool = False) -> tuple[float, float]:
    """(makespan, makespan without the compression excess of the critical chain's lags).

    ``handovers``: also remove the excess of the chain's handover gaps
    (:func:`handovers_h`).
    """
    ends = [j.end_h for j in jobs if math.isfinite(j.end_h)]
    if not ends:
        return math.nan, math.nan
    span = max(ends)
    chain = critical_chain(jobs)
    cut = sum(excess_h(lag_h.get(n, 0.0), scale) for n in chain)
    if handovers:
        cut += sum(excess_h(g, scale) for g in handovers_h(jobs, chain))
    return span, span - cut


def corrected_energy_kwh(energy_kwh: float, removed_h: float, gpus: int,
                         idle_w: float) -> float:
    """Energy without the idle power of the ``removed_h`` trace hours of excess latency."""
    return energy_kwh - gpus * idle_w * removed_h / 1000.0
