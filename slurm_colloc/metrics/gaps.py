"""Where an attempt's sampling had holes, and why: the report's "sampling:" line.

A job's series has a row per sample (or per ``n`` merged samples once compacted), and
only while the job has a process on its GPU. So a stretch of the attempt without rows
is one of two things:

* **the collector was not running** (killed, crashed with its supervisor, the node's
  collector stopped): nothing was sampled *and nothing was enforced*; or
* **the job had no process on its GPU** (still loading data, between two programs,
  finished its GPU work): nothing to sample, which is normal at the start and the end.

:func:`sampling_gaps` (pure) finds the holes: between rows more than
:data:`GAP_FACTOR` sampling intervals apart (a row of ``n`` samples covers ``n``
intervals), and before the first / after the last row. Each is put down to the
collector when the collector's own record (``down``: :func:`collector_down`, from its
events file and, at the epilog, its lock and heartbeat) says it was not running for
most of it, else to the job. A hole at the start or the end that the collector does
not explain is dropped: a job that imports its framework for 20 s before touching
the GPU has no sampling problem. The epilog files what it finds in the attempt's
record (``MetricsSummary.gaps``), so the report shows it from any host.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from slurm_colloc.metrics import liveness, store

GAP_FACTOR = 3.0
"""Rows further apart than this many sampling intervals leave a hole."""
EDGE_GRACE_S = 10.0
"""A hole at the start or end shorter than this is not one (the collector a prolog
starts samples its first job a second or two after that job began)."""
COLLECTOR, JOB = "collector", "job"
MAX_GAPS = 16
"""Holes kept per attempt (the longest; the total counts them all)."""

Span = tuple[float, float]


@dataclass(frozen=True)
class Gap:
    """A stretch of the attempt with no sample (epoch seconds) and its cause."""

    start: float
    end: float
    cause: str
    """:data:`COLLECTOR` (not running: nothing sampled or enforced) or :data:`JOB`
    (no process of the job on its GPU)."""

    @property
    def seconds(self) -> float:
        """Its length."""
        return self.end - self.start


def sampled_spans(rows: Sequence[store.Row], interval: float) -> list[Span]:
    """The stretches the rows cover, merged where rows are at most
    :data:`GAP_FACTOR` intervals apart (all GPUs of the attempt together)."""
    interval = max(interval, 1e-3)
    tol = GAP_FACTOR * interval
    spans: list[Span] = []
    for r in sorted((r for r in rows if math.isfinite(r.t)), key=lambda r: r.t):
        end = r.t + max(1, r.n) * interval
        if spans and r.t - spans[-1][1] <= tol:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((r.t, end))
    return spans


def _overlap(a: float, b: float, spans: Sequence[Span]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)


def sampling_gaps(rows: Sequence[store.Row], start: float, end: float, interval: float,
                  down: Sequence[Span] = ()) -> list[Gap]:
    """The holes of the attempt ``[start, end]`` (see the module docstring), oldest
    first; at most :data:`MAX_GAPS` (the longest)."""
    if not (math.isfinite(start) and math.isfinite(end)) or end <= start:
        return []
    spans = [(max(a, start), min(b, end)) for a, b in sampled_spans(rows, interval)
             if b > start and a < end]
    edge = max(GAP_FACTOR * interval, EDGE_GRACE_S)
    holes: list[tuple[float, float, bool]] = []  # (from, to, at an edge)
    t = start
    for a, b in spans:
        if a > t:
            holes.append((t, a, t == start))
        t = max(t, b)
    if not spans:
        holes.append((start, end, True))
    elif t < end:
        holes.append((t, end, True))
    out = []
    for a, b, at_edge in holes:
        if b - a <= (edge if at_edge else GAP_FACTOR * interval):
            continue
        cause = COLLECTOR if _overlap(a, b, down) >= (b - a) / 2 else JOB
        if cause == JOB and at_edge:
            continue
        out.append(Gap(a, b, cause))
    if len(out) > MAX_GAPS:
        keep = sorted(out, key=lambda g: -g.seconds)[:MAX_GAPS]
        out = sorted(keep, key=lambda g: g.start)
    return out


def collector_down(metrics_dir: str, start: float, end: float,
                   now: float | None = None, stall_s: float = 60.0) -> list[Span]:
    """When no collector sampled on this node during ``[start, end]``, as far as root's
    records tell: the events file's gaps; the ``stall_s`` before each ``stalled``
    event (the worker ran but sampled nothing until its supervisor killed it); and,
    when no collector holds the lock now, the time since its last completed sample
    (its heartbeat): a supervisor killed with SIGKILL writes no event, and the events
    file only notices after :data:`~.liveness.STALE_AFTER_S`."""
    now = time.time() if now is None else now
    events = liveness.read_events(metrics_dir)
    down = list(liveness.gaps(events, start, end, now) or [])
    down += [(max(start, e.t - stall_s), min(end, e.t)) for e in events
             if e.kind == liveness.STALLED and start < e.t and e.t - stall_s < end]
    if not liveness.collector_running(metrics_dir):
        age = liveness.heartbeat_age(metrics_dir, now)
        since = now - age if age is not None else start
        if since < end:
            down.append((max(start, since), end))
    return down
