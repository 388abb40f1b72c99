"""What a job's accounting lines say about its GPU use: the records, and GPU-hours
held and saved per attempt. Shared by the period summary (:mod:`.admin`) and the
job table (:mod:`.jobs`) so both count the same way.

A job "shared a GPU" only when another job was on the same GPU at the same time:
either another job of the same report ran on the same node and GPU index during an
overlapping time (:func:`period_usage` sweeps the attempts' times per GPU), or the
attempt's accounting record names co-tenants (jobs outside the report; the record
names them without times, so the whole attempt counts as shared). Holding fewer
shards than a GPU has is not sharing: a job that ran alone had the GPU to itself and
saved nothing (issue 27: "Collocated 28" counted jobs that ran alone, and their
"saved" GPU-hours exceeded those allocated).

Per attempt of ``h`` hours (sacct's elapsed; one GPU):

- **whole-GPU-equivalent** ``h``: what the attempt would have held without colloc;
- **allocated**: while alone, the whole GPU (``dt``); while sharing with jobs of the
  report, its shards' part of the shards on the GPU then (``dt * s / sum(s)``: the
  GPU's time split by what each job held); while sharing with jobs the report does
  not have, ``dt * s / shards_per_gpu`` (the others are taken to hold the rest);
- **saved** = whole-GPU-equivalent - allocated: the GPU time other jobs ran on.

So allocated + saved = whole-GPU-equivalent exactly, saved is 0 for a job that ran
alone, and over one GPU's jobs the allocated hours sum to the time the GPU was busy.
Saved exceeds allocated only where more than two jobs shared a GPU at once (four
jobs on a GPU for an hour: 1 GPU-hour allocated, 3 saved).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from slurm_colloc.accounting.codec import try_decode
from slurm_colloc.accounting.record import Attempt, JobRecord
from slurm_colloc.accounting.submit_record import CollocRecord, parse_record
from slurm_colloc.config import RecordField
from slurm_colloc.oom.patterns import GPU_CRASH_CAUSES
from slurm_colloc.report.inquirer import JobRow


def job_records(lines: Sequence[JobRow], prefer: RecordField = "admin_comment",
                ) -> tuple[JobRecord | None, CollocRecord | None]:
    """The accounting record (the last readable one; in ``record_field`` or, failing
    that, the other comment field) and job_submit's record (AdminComment)."""
    rec: JobRecord | None = None
    sub: CollocRecord | None = None
    for ln in lines:
        found = (try_decode(t) for t in ln.record_texts(prefer))
        rec = next((r for r in found if r is not None), None) or rec
        sub = sub or parse_record(ln.admin_comment)
    return rec, sub


@dataclass
class Usage:
    """A job's GPU-hours: allocated + saved = whole-GPU-equivalent."""

    gpu_hours: float = 0.0
    """Allocated: the GPU time this job held (see the module's rules)."""
    gpu_hours_saved: float = 0.0
    whole_gpu_hours: float = 0.0
    """What the job would have held with a whole GPU per attempt."""
    gpu_crashes: int = 0
    shared: bool = False
    """Some attempt shared its GPU with another job (overlap or recorded co-tenant)."""
    co_tenants: set[str] = field(default_factory=set)
    """Jobs of the report seen on the same GPU at the same time."""


@dataclass(frozen=True)
class Span:
    """One attempt's time on one GPU: the unit the sharing sweep works on."""

    job: str
    hours: float
    shards: int
    spg: int
    node: str | None = None
    gpu: int | None = None
    start: float | None = None
    end: float | None = None
    co_tenants: tuple[str, ...] = ()
    """Recorded co-tenants (job ids, base ids of array tasks included)."""

    @property
    def key(self) -> tuple[str, int] | None:
        """(node, GPU index) when the attempt's place and times are known."""
        if (self.node and self.gpu is not None and self.start is not None
                and self.end is not None and self.end > self.start):
            return self.node, self.gpu
        return None


def spans(job: str, lines: Sequence[JobRow], attempts: Sequence[Attempt], spg: int,
          now: float) -> list[Span]:
    """The spans of one job's attempts; an attempt's hours are its accounting line's
    elapsed when the lines match the attempts one to one, else its recorded start and
    end; a running attempt ends ``now``."""
    out = []
    one_to_one = len(lines) == len(attempts)
    for i, a in enumerate(attempts):
        ln = lines[i] if one_to_one else None
        start: float | None = a.start if a.start is not None else (ln.start if ln else None)
        end: float | None = a.end if a.end is not None else (ln.end if ln else None)
        if end is None and start is not None and ln is not None and ln.state == "RUNNING":
            end = now
        el: float | None = ln.elapsed_s if ln is not None else None
        if el is None and start is not None and end is not None:
            el = end - start
        shards = min(spg, a.shards or spg)
        out.append(Span(job, max(0, el or 0) / 3600, max(1, shards), spg, a.node, a.gpu,
                        start, end, tuple(a.co_tenants)))
    return out


def _allocated_fraction(sp: Span, group: Sequence[Span], known: set[str],
                        u: Usage) -> float:
    """The part of ``sp``'s time it held the GPU (1 = alone all along)."""
    unseen = any(t.split("_")[0] not in known and t != sp.job for t in sp.co_tenants)
    alone_share = min(1.0, sp.shards / sp.spg) if unseen else 1.0
    if sp.key is None:
        if sp.co_tenants:
            u.shared = True
        return min(1.0, sp.shards / sp.spg) if sp.co_tenants else 1.0
    assert sp.start is not None and sp.end is not None
    others = [o for o in group if o is not sp and o.start is not None and o.end is not None
              and o.start < sp.end and o.end > sp.start]
    cuts = sorted({sp.start, sp.end, *(t for o in others for t in (o.start, o.end)
                                       if t is not None and sp.start < t < sp.end)})
    held = 0.0
    for t0, t1 in itertools.pairwise(cuts):
        on = [o for o in others if o.start is not None and o.end is not None
              and o.start <= t0 and o.end >= t1]
        if on:
            u.shared = True
            u.co_tenants.update(o.job for o in on if o.job != sp.job)
            held += (t1 - t0) * sp.shards / (sp.shards + sum(o.shards for o in on))
        else:
            held += (t1 - t0) * alone_share
    if unseen:
        u.shared = True
    return held / (sp.end - sp.start)


def period_usage(jobs: Mapping[str, tuple[Sequence[JobRow], Sequence[Attempt]]], spg: int,
                 now: float | None = None) -> dict[str, Usage]:
    """Usage of every job of a report, sharing judged across all of them (pure but
    for ``now``, the end of attempts still running)."""
    t = time.time() if now is None else now
    all_spans: dict[str, list[Span]] = {}
    for j, (lines, attempts) in jobs.items():
        try:
            all_spans[j] = spans(j, lines, attempts, spg, t)
        except (ArithmeticError, ValueError, TypeError):
            continue  # absurd figures: left out here, named by the caller
    by_gpu: dict[tuple[str, int], list[Span]] = {}
    for sps in all_spans.values():
        for sp in sps:
            if sp.key is not None:
                by_gpu.setdefault(sp.key, []).append(sp)
    known = {j.split("_")[0] for j in jobs} | set(jobs)
    out: dict[str, Usage] = {}
    for j, sps in all_spans.items():
        u = Usage()
        try:
            for sp, a in zip(sps, jobs[j][1], strict=True):
                frac = _allocated_fraction(sp, by_gpu.get(sp.key, []) if sp.key else [],
                                           known, u)
                u.whole_gpu_hours += sp.hours
                u.gpu_hours += sp.hours * frac
                u.gpu_hours_saved += sp.hours * (1 - frac)
                if a.oom and a.oom.cause in GPU_CRASH_CAUSES:
                    u.gpu_crashes += 1
        except (ArithmeticError, ValueError, TypeError):
            continue
        out[j] = u
    return out


def report_usage(by_job: Mapping[str, Sequence[JobRow]], spg: int,
                 prefer: RecordField = "admin_comment",
                 now: float | None = None) -> dict[str, Usage]:
    """:func:`period_usage` of a report's jobs grouped by raw id (lines oldest first);
    a job whose records cannot be read is left out here (its caller names it)."""
    jobs: dict[str, tuple[Sequence[JobRow], Sequence[Attempt]]] = {}
    for j, lines in by_job.items():
        try:
            rec, _ = job_records(lines, prefer)
        except Exception:  # noqa: BLE001, S112 - the caller folds it again and says why
            continue
        jobs[j] = (lines, rec.attempts if rec else ())
    return period_usage(jobs, spg, now)


def attempt_usage(lines: Sequence[JobRow], attempts: Sequence[Attempt], spg: int,
                  job: str = "", now: float | None = None) -> Usage:
    """One job on its own (co-tenants only from its record): :func:`period_usage` of
    a report that holds just this job."""
    key = job or (lines[0].job_id if lines else "")
    u = period_usage({key: (lines, attempts)}, spg, now).get(key)
    if u is None:
        raise OverflowError("elapsed time out of range")
    return u
