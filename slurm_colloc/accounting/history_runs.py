"""Which runs the estimator's history may learn from, and what it says about them.

Why (issue 27): when the collector stopped in the middle of a job, its 8 s of 16
were filed as the run's peak (5.0 GiB; the job printed 6,144 MiB) and the next run
was sized too small. A peak is only the job's peak when the whole attempt was
watched and the job ran to its end. So each attempt of a user's job is one of:

* **measured**: the job COMPLETED, this attempt was its last (not requeued, no OOM),
  it has real samples, the collector never stopped during it (no ``collector``
  sampling gap, :mod:`slurm_colloc.metrics.gaps`), and the job never reported using
  more than we sampled. Its peak is a measurement: it may lower an estimate made
  from the model summary (and sets the history's peak for its batch size).
* **bound**: it was sampled but is incomplete (sampling gaps, killed by colloc's
  enforcement or a signal, GPU OOM, requeued, the job FAILED / was CANCELLED /
  TIMED OUT, or it reported a larger figure than sampled). Its peak (or the larger
  reported figure) is a *lower bound* on what the job needs: it may raise the next
  estimate of that batch size and larger ones, never lower it.
* **ignored**: nothing usable was measured (no samples, no model key).

:func:`classify` is pure and is the one place that decides; the accounting history
(:mod:`.history`), the compute table (:mod:`.compute_history`), ``colloc estimate``
and the per-job report all use it, so what the report says the next estimate came
from is what the estimator used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from slurm_colloc.accounting.record import Attempt, JobRecord
from slurm_colloc.estimators.history_scaling import HISTORY_MARGIN, scale_history

MAX_PEAK_MIB = 1 << 24
"""A larger "peak" (16 TiB) is not a measurement."""

Key = tuple[str, int, int, str, str]
"""(fingerprint, batch size, seq len or 0, optimizer, precision), as SqliteHistory."""
Use = Literal["measured", "bound", "ignored"]


@dataclass(frozen=True)
class UserJob:
    """One finished job of the user as accounting shows it, with its colloc record."""

    job_id: str
    state: str
    """Slurm's base state of the job (COMPLETED, FAILED, CANCELLED, TIMEOUT, ...)."""
    record: JobRecord
    signal: int = 0
    """The signal that ended the job (sacct's ``N:S`` second half), 0 when none."""


@dataclass(frozen=True)
class Run:
    """One attempt as the history sees it."""

    job_id: str
    attempt: int
    key: Key | None
    use: Use
    peak_mib: int | None
    """What the history takes from it: the measured peak, or the lower bound (the
    larger of the sampled peak and a figure the job reported); None when ignored."""
    reason: str = ""
    """Why it is not a measurement ("" for a measured run)."""

    @property
    def label(self) -> str:
        """``101`` for a first attempt, ``101.1`` for its requeued run."""
        return self.job_id if self.attempt == 0 else f"{self.job_id}.{self.attempt}"


def valid_fingerprint(v: str | None) -> str | None:
    """``v`` lowercased when it is 1-64 hex digits, else None (a user-given key)."""
    if not v:
        return None
    fp = v.lower()
    if len(fp) > 64 or any(c not in "0123456789abcdef" for c in fp):
        return None
    return fp


def attempt_key(a: Attempt) -> Key | None:
    """The history key of an attempt's estimate, or None when it has none."""
    e = a.estimate
    if e is None:
        return None
    fp = valid_fingerprint(e.fingerprint)
    b = e.batch_size
    if fp is None or isinstance(b, bool) or not isinstance(b, int) or not 0 < b < 1 << 31:
        return None
    seq = e.seq_len if isinstance(e.seq_len, int) and 0 < e.seq_len < 1 << 31 else 0
    return (fp, b, seq, e.optimizer or "adam", e.precision or "fp32")


def sampled_peak(a: Attempt) -> int | None:
    """The attempt's sampled peak when it has real samples, else None."""
    m = a.metrics
    if m is None or m.samples <= 0 or m.peak_mib is None:
        return None
    if isinstance(m.peak_mib, bool) or not 0 < m.peak_mib <= MAX_PEAK_MIB:
        return None
    return m.peak_mib


def _mib(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_PEAK_MIB \
        else None


def reported(a: Attempt) -> tuple[int, str] | None:
    """The most the record says the job reached beyond the samples, and who says so:
    an OOM line's failed allocation on top of what the process held
    (``OomInfo.alloc_mib`` + ``in_use_mib``, :mod:`slurm_colloc.oom.alloc`: a refused
    allocation never shows in a sample), or the collector's enforcement verdict's
    peak. None when the record has neither (records before issue 27)."""
    figures: list[tuple[int, str]] = []
    alloc = _mib(a.oom.alloc_mib) if a.oom is not None else None
    if a.oom is not None and alloc is not None:
        figures.append((min(MAX_PEAK_MIB, alloc + (_mib(a.oom.in_use_mib) or 0)),
                        "the job's OOM message asked for"))
    seen = _mib(a.enforcement.peak_mib) if a.enforcement is not None else None
    if seen is not None:
        figures.append((seen, "the collector's verdict saw"))
    return max(figures) if figures else None


def reported_mib(a: Attempt) -> int | None:
    """:func:`reported`'s figure alone."""
    r = reported(a)
    return r[0] if r else None


def _killed_by_enforcement(a: Attempt) -> str:
    v = a.enforcement
    if v is None or v.action != "killed":
        return ""
    return f"killed by colloc's enforcement ({v.kind or 'verdict'})"


def collector_gap_s(a: Attempt) -> int:
    """Seconds of the attempt when the collector was not running (nothing sampled)."""
    m = a.metrics
    if m is None:
        return 0
    return sum(max(0, int(g[1])) for g in m.gaps if len(g) == 3 and g[2] == "collector")


def _incomplete(a: Attempt, job: UserJob | None, last: bool) -> str:
    """Why the attempt's peak is not the job's whole peak ("" when it is)."""
    killed = _killed_by_enforcement(a)
    if killed:
        return killed
    if a.oom is not None and a.oom.cause != "none":
        return f"ended by {a.oom.cause}"
    if a.requeue is not None and a.requeue.requeued:
        return "requeued"
    gap = collector_gap_s(a)
    if gap > 0:
        span = a.metrics.span_s if a.metrics is not None else None
        of = f" of {span} s" if isinstance(span, int) and span > 0 else ""
        return f"sampling gaps (collector down {gap} s{of})"
    if job is not None and last and job.state != "COMPLETED":
        if job.signal:
            return f"killed by signal {job.signal} (job {job.state})"
        return f"job {job.state}"
    if job is not None and not last:
        return "an earlier attempt"
    return ""


def classify(a: Attempt, job: UserJob | None = None, last: bool = True) -> Run:
    """What the history takes from attempt ``a`` of ``job`` (module docstring).

    ``job`` None: only the record is known (the epilog's own view), the job is taken
    as COMPLETED; ``last``: ``a`` is the job's final attempt.
    """
    jid = job.job_id if job is not None else ""
    key = attempt_key(a)
    peak = sampled_peak(a)
    if key is None:
        return Run(jid, a.attempt, None, "ignored", None, "no model fingerprint")
    if peak is None:
        return Run(jid, a.attempt, key, "ignored", None, "not measured")
    reason = _incomplete(a, job, last)
    said = reported(a)
    if said is not None and said[0] > peak:
        more = f"{said[1]} {said[0]} MiB, {peak} MiB sampled"
        return Run(jid, a.attempt, key, "bound", said[0],
                   f"{reason}; {more}" if reason else more)
    if reason:
        return Run(jid, a.attempt, key, "bound", peak, reason)
    return Run(jid, a.attempt, key, "measured", peak)


def runs_of(jobs: Iterable[UserJob]) -> list[Run]:
    """Every attempt of the jobs, classified (pure), newest job first as given."""
    out = []
    for job in jobs:
        n = len(job.record.attempts)
        out += [classify(a, job, i == n - 1) for i, a in enumerate(job.record.attempts)]
    return out


def peaks_of(runs: Iterable[Run], use: Use = "measured") -> dict[Key, int]:
    """Largest peak per key over the runs of one kind (``measured`` or ``bound``)."""
    out: dict[Key, int] = {}
    for r in runs:
        if r.use == use and r.key is not None and r.peak_mib is not None:
            out[r.key] = max(out.get(r.key, 0), r.peak_mib)
    return out


def floor_mib(bounds: dict[int, int], batch_size: int) -> int | None:
    """The least estimate the lower bounds allow at ``batch_size``: the largest bound
    at that batch size or a smaller one (peaks do not shrink with the batch), plus the
    history margin; None when no bound applies."""
    below = [p for b, p in bounds.items() if 0 < b <= batch_size and p > 0]
    return math.ceil(max(below) * (1 + HISTORY_MARGIN)) if below else None


@dataclass
class Provenance:
    """Which runs of one model (fingerprint, seq len, optimizer, precision) the next
    estimate at ``batch_size`` comes from, and which it set aside."""

    batch_size: int
    used: list[Run] = field(default_factory=list)
    """Measured runs whose peaks the history answer is computed from."""
    bounds: list[Run] = field(default_factory=list)
    """Incomplete runs whose peak may only raise the estimate (a floor)."""
    ignored: list[Run] = field(default_factory=list)
    history_mib: int | None = None
    """The answer from measured runs alone (None: none, or it needs the summary)."""
    method: str = ""
    """``exact``, ``fit``, ``anchored`` (history_scaling), or ``""``."""
    floor_mib: int | None = None

    @property
    def next_mib(self) -> int | None:
        """The next estimate as far as history alone decides it (None: the summary's
        estimate, raised to :attr:`floor_mib` when that is set)."""
        if self.history_mib is None:
            return None
        return max(self.history_mib, self.floor_mib or 0)

    def to_json(self) -> dict[str, object]:
        """Stable keys: what ``colloc estimate --json`` and the report's JSON carry."""
        return {
            "batch_size": self.batch_size, "next_mib": self.next_mib, "method": self.method,
            "at_least_mib": self.floor_mib,
            "used": [{"job": r.job_id, "attempt": r.attempt, "peak_mib": r.peak_mib}
                     for r in self.used],
            "not_used": [{"job": r.job_id, "attempt": r.attempt, "peak_mib": r.peak_mib,
                          "use": r.use, "reason": r.reason}
                         for r in self.bounds + self.ignored],
            "summary": self.line(),
        }

    def line(self) -> str:
        """One line for people, e.g. ``6.5 GiB from jobs 101, 104 (105 not used:
        sampling gaps (collector down 8 s of 16); counts as at least 5.3 GiB)``."""
        used = _labels(self.used)
        if self.next_mib is not None:
            head = f"{_gib(self.next_mib)} from job{'s' if len(used) > 1 else ''} {', '.join(used)}"
        elif self.used:
            head = f"from the model summary scaled by job{'s' if len(used) > 1 else ''} " \
                   f"{', '.join(used)}"
        else:
            head = "from the model summary (no complete measurement)"
        if self.floor_mib is not None and (self.history_mib or 0) < self.floor_mib:
            head += f", raised to at least {_gib(self.floor_mib)} by incomplete runs" \
                if self.history_mib is not None else f", at least {_gib(self.floor_mib)}"
        aside = [f"{r.label} not used: {r.reason}" for r in (self.bounds + self.ignored)[:5]]
        more = len(self.bounds) + len(self.ignored) - len(aside)
        if more > 0:
            aside.append(f"{more} more not used")
        return head + (f" ({'; '.join(aside)})" if aside else "")


def _labels(runs: Sequence[Run]) -> list[str]:
    seen: list[str] = []
    for r in runs:
        if r.label not in seen:
            seen.append(r.label)
    return seen


def _gib(mib: int) -> str:
    """GiB to one decimal, rounded up (an estimate shown smaller than it is misleads)."""
    return f"{math.ceil(mib / 102.4 - 1e-9) / 10:.1f} GiB"


class _NeedsSummary(Exception):
    """The history answer needs the summary estimator (one measured batch size)."""


def _no_cold(_b: int) -> int:
    raise _NeedsSummary


def provenance(runs: Iterable[Run], fingerprint: str, batch_size: int, seq_len: int | None,
               optimizer: str, precision: str) -> Provenance:
    """The runs of the model behind the next estimate at ``batch_size`` (pure).

    Runs of other models are left out entirely (not "ignored": they are not this
    model's). The history-only figure is computed where the summary is not needed
    (a measured run at this batch size, or a line through two or more).
    """
    fp = fingerprint.lower()
    mine = [r for r in runs if r.key is not None and r.key[0] == fp
            and r.key[2:] == (seq_len or 0, optimizer, precision)]
    p = Provenance(batch_size)
    for r in mine:
        {"measured": p.used, "bound": p.bounds, "ignored": p.ignored}[r.use].append(r)
    points = {k[1]: v for k, v in peaks_of(mine).items()}
    p.floor_mib = floor_mib({k[1]: v for k, v in peaks_of(mine, "bound").items()},
                            batch_size)
    try:
        s = scale_history(points, batch_size, _no_cold)
    except _NeedsSummary:
        s = None
        p.method = "anchored"
    if s is not None:
        p.history_mib, p.method = s.estimate_mib, s.method
    _set_aside_other_batches(p)
    return p


def _set_aside_other_batches(p: Provenance) -> None:
    """Runs that do not enter the figure at ``p.batch_size`` move to ``ignored``: a
    bound at a larger batch (it says nothing about a smaller one) and, when a run at
    this very batch size was measured (``exact``), runs at larger batch sizes."""
    b = p.batch_size

    def aside(r: Run, why: str) -> Run:
        return Run(r.job_id, r.attempt, r.key, "ignored", r.peak_mib, why)

    if p.method == "exact":
        p.ignored += [aside(r, f"batch {_batch(r)}; measured at batch {b}")
                      for r in p.used if _batch(r) > b]
        p.used = [r for r in p.used if _batch(r) <= b]
    p.ignored += [aside(r, f"{r.reason}, at the larger batch {_batch(r)}")
                  for r in p.bounds if _batch(r) > b]
    p.bounds = [r for r in p.bounds if _batch(r) <= b]


def _batch(r: Run) -> int:
    return r.key[1] if r.key is not None else 0
