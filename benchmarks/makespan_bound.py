"""Lower bounds on the makespan any scheduler could reach on a trace, under the
simulation's own contention model.

    python benchmarks/makespan_bound.py --trace philly90h
    python benchmarks/makespan_bound.py --trace heavy60h --results benchmarks/results/issue25
    python benchmarks/makespan_bound.py --trace-file my_trace.csv --gpus 4 --json
    python benchmarks/makespan_bound.py --trace philly90h --whole-makespan-h 13.57

Why: the trace replay (``benchmarks/replay.py``) measures the makespan of its policies;
the issue targets ask colloc for at most 0.65x of whole-gpu's makespan on philly90h and
0.80x on heavy60h. Whether such a target is reachable at all depends on how much work
the trace holds and when it arrives, not on any scheduler: this script computes, in
trace hours,

* the **arrival bound**: ``max(arrival + work)`` over the jobs (no job runs faster than
  alone);
* a **work bound** per sharing mode: ``max over t0`` (every arrival time) of ``t0 +
  sum(w * work * gpus for the jobs arriving at or after t0) / G``, ``G`` the cluster's
  GPUs, ``w`` the share of one GPU a job uses up per unit of its work:

  - ``exclusive``: ``w = 1`` (whole GPUs, the whole-gpu policy);
  - ``time-sliced``: ``w = g``, the job's utilisation alone
    (:func:`~slurm_colloc.gpu.sim.activity.util_from_sm_activity`, a fraction): separate
    contexts (jobs of different users under legacy per-user MPS servers) share the
    GPU's time, capacity 1 (:data:`~slurm_colloc.gpu.sim.interference.TIME_SLICED`);
  - ``one-server``: ``w = s / C``, ``s`` its SM activity alone (a fraction) and ``C``
    :data:`~slurm_colloc.gpu.sim.interference.MPS_FIT`'s capacity (1.08): one MPS
    server per GPU (MPS v3, or jobs of one user);

  multi-GPU jobs hold whole GPUs and never share: ``w = 1`` in every mode;
* per mode the bound ``max(arrival bound, work bound)``.

Under the model's saturation term a tenant with busy share ``x`` alone and slowdown
``(1 - x) + x k`` consumes ``x`` per unit of its work, and the tenants' consumption adds
up to at most the capacity, so ``w`` above is the least a unit of work can cost.

**What the bounds ignore** (all of it only makes a real schedule longer, so the bounds
are optimistic): the contention term's slowdown below saturation, the time-sliced
context-switch cost, memory limits and OOMs, packing (work is treated as fluid: any job
spread over any GPUs), start-up and start lag, the Slurm scheduling cadence, and
whether a real policy would pick the best co-tenants. ``time-sliced`` also treats every
pair of co-tenants as different users; jobs of one user share one server, which is
what ``one-server`` bounds.

The ratio to whole-gpu's makespan uses ``--whole-makespan-h`` or the median
``makespan_h`` of the ``whole-gpu`` row of ``<results>/<trace>_summary.csv`` (what
``replay.py --repeats`` writes). A bound ratio above the target means no scheduler
reaches the target on this trace.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from slurm_colloc.bench import generators, profiles
from slurm_colloc.bench.trace import Trace, TraceJob
from slurm_colloc.bench.trace_file import TraceFileError, load_trace_file
from slurm_colloc.gpu.sim.activity import util_from_sm_activity
from slurm_colloc.gpu.sim.interference import MPS_FIT

TARGETS: dict[str, float] = {"philly90h": 0.65, "heavy60h": 0.80}
"""Issue targets: colloc's makespan over whole-gpu's, at most."""

MODES = ("exclusive", "time-sliced", "one-server")
"""Sharing modes, from the costliest per unit of work to the cheapest."""

Weight = Callable[[TraceJob], float]


def exclusive_weight(job: TraceJob) -> float:
    """Whole GPUs: every job uses up its GPUs all the time."""
    return 1.0


def time_sliced_weight(job: TraceJob) -> float:
    """Utilisation alone (fraction) for a 1-GPU job; 1 for a multi-GPU job."""
    if job.gpus > 1:
        return 1.0
    return min(1.0, max(0.0, util_from_sm_activity(job.sm_pct) / 100.0))


def one_server_weight(job: TraceJob, capacity: float = MPS_FIT.capacity) -> float:
    """SM activity alone (fraction) over the MPS capacity for a 1-GPU job; 1 for a
    multi-GPU job."""
    if job.gpus > 1:
        return 1.0
    return min(1.0, max(0.0, job.sm_pct / 100.0)) / capacity


WEIGHTS: dict[str, Weight] = {
    "exclusive": exclusive_weight,
    "time-sliced": time_sliced_weight,
    "one-server": one_server_weight,
}


def arrival_bound_s(jobs: Sequence[TraceJob]) -> float:
    """Latest solo finish: ``max(arrival + work)``, trace seconds (0 for no jobs)."""
    return max((j.arrival_s + j.work_s for j in jobs), default=0.0)


def work_bound_s(jobs: Sequence[TraceJob], gpus: int, weight: Weight) -> float:
    """``max over t0`` (each arrival time) of ``t0 + sum(w * work * gpus of the jobs
    arriving at or after t0) / gpus``, trace seconds (0 for no jobs)."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    best = 0.0
    tail = 0.0  # weighted GPU-seconds of the jobs arriving at or after t0
    ordered = sorted(jobs, key=lambda j: j.arrival_s, reverse=True)
    for i, j in enumerate(ordered):
        tail += weight(j) * j.work_s * j.gpus
        # only once every job at this arrival time is in the tail
        if i + 1 == len(ordered) or ordered[i + 1].arrival_s != j.arrival_s:
            best = max(best, j.arrival_s + tail / gpus)
    return best


@dataclass(frozen=True)
class ModeBound:
    """One sharing mode's bounds, trace hours."""

    mode: str
    work_h: float
    bound_h: float
    """``max(arrival bound, work bound)``."""


def mode_bounds(jobs: Sequence[TraceJob], gpus: int) -> tuple[float, list[ModeBound]]:
    """The arrival bound (h) and every mode's bounds, in :data:`MODES` order."""
    arrival_h = arrival_bound_s(jobs) / 3600.0
    out = []
    for mode in MODES:
        work_h = work_bound_s(jobs, gpus, WEIGHTS[mode]) / 3600.0
        out.append(ModeBound(mode, work_h, max(arrival_h, work_h)))
    return arrival_h, out


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.strip().lower()).strip("_")


def makespan_column(columns: Sequence[str]) -> str | None:
    """The summary column holding the makespan in hours (the median where there are
    median/min/max columns): ``makespan_h_median``, ``makespan h``, ``makespan_h`` ...;
    never a ratio (``makespan_vs_whole``) or a corrected one."""
    cands = [c for c in columns if _norm(c).startswith("makespan_h")
             or _norm(c) in ("makespan", "makespan_hours")]
    for pick in ("median", ""):
        for c in cands:
            if pick in _norm(c):
                return c
    return None


def whole_makespan_from_summary(path: Path, policy: str = "whole-gpu") -> float | None:
    """Median (over rows) whole-gpu makespan, hours, of a ``<trace>_summary.csv``; None
    when the file, the row or a usable column is missing."""
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            col = makespan_column(list(reader.fieldnames or []))
            pol = next((c for c in reader.fieldnames or [] if _norm(c) == "policy"), None)
            if col is None or pol is None:
                return None
            values = []
            for row in reader:
                if (row.get(pol) or "").strip() != policy:
                    continue
                try:
                    v = float(row.get(col) or "nan")
                except ValueError:
                    continue
                if math.isfinite(v) and v > 0:
                    values.append(v)
    except OSError:
        return None
    return statistics.median(values) if values else None


@dataclass(frozen=True)
class Report:
    """Everything the script prints, JSON-ready."""

    trace: str
    jobs: int
    gpus: int
    arrival_h: float
    modes: list[ModeBound]
    whole_makespan_h: float | None
    target: float | None


def ratio(r: Report, hours: float) -> float | None:
    """``hours`` over whole-gpu's makespan, None when that is not known."""
    return hours / r.whole_makespan_h if r.whole_makespan_h else None


def report_json(r: Report) -> str:
    """The report as JSON: per mode its bounds, ratio and whether it is under the target
    (``below_target`` false: no scheduler reaches the target in that mode)."""
    d = asdict(r)
    d["arrival_ratio"] = ratio(r, r.arrival_h)
    for m, row in zip(r.modes, d["modes"], strict=True):
        q = ratio(r, m.bound_h)
        row["ratio"] = q
        row["below_target"] = None if q is None or r.target is None else q <= r.target
    return json.dumps(d, indent=2)


def _fmt_ratio(q: float | None) -> str:
    return "-" if q is None else f"{q:.3f}"


def report_text(r: Report) -> str:
    """A small plain table of the bounds, ratios and the target check."""
    whole = "unknown" if r.whole_makespan_h is None else f"{r.whole_makespan_h:.2f} h"
    target = "none" if r.target is None else f"{r.target:.2f}"
    lines = [f"{r.trace}: {r.jobs} jobs, {r.gpus} GPUs, whole-gpu makespan {whole}, "
             f"target ratio {target}",
             "(optimistic lower bounds: no contention below saturation, no context "
             "switches, start-up or Slurm cadence; fluid packing)", "",
             f"{'bound':<12} {'work h':>8} {'bound h':>8} {'/ whole':>8}  target",
             f"{'arrival':<12} {'-':>8} {r.arrival_h:8.2f} "
             f"{_fmt_ratio(ratio(r, r.arrival_h)):>8}"]
    for m in r.modes:
        q = ratio(r, m.bound_h)
        if q is None or r.target is None:
            verdict = "-"
        else:
            verdict = ("not ruled out (bound below)" if q <= r.target
                       else "ruled out (bound above)")
        lines.append(f"{m.mode:<12} {m.work_h:8.2f} {m.bound_h:8.2f} "
                     f"{_fmt_ratio(q):>8}  {verdict}")
    return "\n".join(lines) + "\n"


def load_trace(name: str | None, path: Path | None, gpus: int | None) -> Trace:
    """The generated trace ``name`` (as ``replay.py --trace`` builds it) or a CSV file."""
    summaries = profiles.load_summaries()
    if path is not None:
        return load_trace_file(path, gpus=gpus or 4, summaries=summaries)
    assert name is not None
    pools = generators.ProfilePools(
        profiles.load_lucid(), profiles.load_timm_peaks(), summaries,
        held_out_only=name in generators.HELD_OUT_TRACES)
    return generators.GENERATORS[name](pools)


def build_report(trace: Trace, gpus: int, whole_h: float | None) -> Report:
    """The bounds of ``trace`` on ``gpus`` GPUs, with the whole-gpu makespan if known."""
    arrival_h, modes = mode_bounds(trace.jobs, gpus)
    return Report(trace.name, len(trace.jobs), gpus, arrival_h, modes, whole_h,
                  TARGETS.get(trace.name))


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, compute the bounds, print the table (or JSON)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", choices=sorted(generators.GENERATORS), default="philly90h")
    src.add_argument("--trace-file", type=Path, help="CSV trace (docs/benchmarks.md)")
    p.add_argument("--gpus", type=int, help="GPUs of the whole cluster (default: the "
                   "trace's, 4 for the replay's traces, one node or two of 2)")
    whole = p.add_mutually_exclusive_group()
    whole.add_argument("--whole-makespan-h", type=float, help="whole-gpu makespan, hours")
    whole.add_argument("--results", type=Path,
                       help="read whole-gpu's median makespan from DIR/<trace>_summary.csv")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    a = p.parse_args(argv)
    if a.gpus is not None and a.gpus < 1:
        p.error(f"--gpus {a.gpus}: must be >= 1")
    try:
        trace = load_trace(a.trace, a.trace_file, a.gpus)
    except TraceFileError as e:
        sys.stderr.write(f"{e}\n")
        return 2
    whole_h = a.whole_makespan_h
    if a.results is not None:
        summary = a.results / f"{trace.name}_summary.csv"
        whole_h = whole_makespan_from_summary(summary)
        if whole_h is None:
            sys.stderr.write(f"{summary}: no whole-gpu makespan found; ratios left out\n")
    r = build_report(trace, a.gpus or trace.gpus, whole_h)
    sys.stdout.write(report_json(r) + "\n" if a.json else report_text(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
