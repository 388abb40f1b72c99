"""Traces built like the collocation thesis's 90-task and 60-task traces (chapter 6.3.2).

Why separate from :mod:`.generators`: these follow the thesis's description exactly
(class mix, one node of four A100 40 GB, every task on one GPU) so that the diagnostic
policies (:mod:`.thesis_policies`) are compared with its published table on a trace of
the same shape, not on the replayer's own traces.

* 90 tasks: 65 % light, 27 % medium, 8 % large ("mostly lighter models that would
  benefit more easily from collocation").
* 60 tasks: only medium and large, 83 % / 17 % ("a stress test for collocation").
* Arrivals: the thesis takes the submission times of a subset of the Philly trace in a
  time window, trimmed to one server. The Philly trace is not in the shared data, so
  arrivals are Philly-like bursts (:func:`.generators.philly_arrivals`) over a share of
  the exclusive lower bound on makespan (a queue builds up, as in the thesis).
* Job profiles: drawn per class from measured profiles (Lucid, timm A100 peaks,
  :class:`.generators.ProfilePools`); run time per class from the repo's
  Helios/Venus-like log-normal (the thesis follows the task lengths of [196]).
"""

from __future__ import annotations

import random

from slurm_colloc.bench.generators import ProfilePools, philly_arrivals
from slurm_colloc.bench.profiles import load_lucid, load_summaries, load_timm_peaks
from slurm_colloc.bench.trace import SIZE_CLASSES, Trace, TraceJob

GIB = 1024
GPUS = 4
GPU_MIB = 40 * GIB
ARRIVAL_FRAC = 0.4
"""Arrivals span 40 % of the exclusive lower bound (the replayer's philly90 choice)."""

THESIS_MIXES = {
    "thesis90": (90, (0.65, 0.27, 0.08)),
    "thesis60": (60, (0.0, 0.83, 0.17)),
}


def default_pools() -> ProfilePools:
    """Measured profiles from the shared data (as the replayer's traces use)."""
    return ProfilePools(load_lucid(), load_timm_peaks(), load_summaries())


def class_list(rng: random.Random, n: int, mix: tuple[float, float, float]) -> list[str]:
    """``n`` size classes in the mix's proportions (rounded; rest to the largest share)."""
    counts = [round(n * f) for f in mix]
    counts[counts.index(max(counts))] += n - sum(counts)
    classes = [c for c, k in zip(SIZE_CLASSES, counts, strict=True) for _ in range(k)]
    rng.shuffle(classes)
    return classes


def thesis_trace(name: str, pools: ProfilePools, seed: int = 1) -> Trace:
    """The thesis-like trace ``name`` (``thesis90`` or ``thesis60``), reproducible by seed."""
    n, mix = THESIS_MIXES[name]
    rng = random.Random(f"{name}:{seed}")  # noqa: S311 - reproducible, not crypto
    draft = [pools.job(rng, f"{name}-{i:03d}", 0.0, c, GPU_MIB, p_summary=0.85)
             for i, c in enumerate(class_list(rng, n, mix))]
    span = ARRIVAL_FRAC * sum(j.work_s for j in draft) / GPUS
    jobs = tuple(
        TraceJob(**{**j.__dict__, "arrival_s": a})
        for j, a in zip(draft, philly_arrivals(rng, n, span), strict=True)
    )
    desc = f"{n} tasks like the thesis's {name[6:]}-task trace, 1 node x 4 A100 40 GB"
    return Trace(name, desc, GPUS, GPU_MIB, jobs)
