"""What a simulated GPU reports as busy: one job's SM activity, and several jobs' together.

Two measured facts the simulation used to get wrong (issue 24):

* **Utilisation is not SM activity.** nvidia-smi's GPU utilisation is the share of time
  *any* kernel runs; DCGM's SM activity (SMACT) is the share of time an SM has a warp
  resident, averaged over all SMs (``/work/shared/docs/reading/profiling-monitoring-dl-
  training.md`` 3.2.1). On an A100 a job at 30 % utilisation keeps about a fifth of its
  SMs busy. :func:`sm_activity_from_util` maps one to the other with a monotone
  piecewise-linear curve through the per-decile medians of GPUMemNet's 3,000 A100 runs
  that measured both (``gpu-memory/gpumemnet_mlp_a100.csv``), fitted on 70 % of the
  runs and checked on the other 30 % (``benchmarks/power_fit.py``). The runs stop at
  about 90 % utilisation; above it the curve rises to :data:`SMACT_AT_FULL_UTIL`, an
  assumption (neither SMACT nor SMOCC reaches 100 %: the profiling paper, Fig. 1).
* **Busy shares do not add.** Two jobs that each run kernels part of the time overlap
  part of that time; the Lucid pairs (1,388 pairs on one GPU) measured their combined
  utilisation at a median 0.87 of ``min(100, u1 + u2)``, lowest (0.79-0.83) when the sum
  is 60-100 % and about 1.0 above 160 %. :func:`combined_pct` blends the capped sum with
  the union of independent busy periods, ``1 - prod(1 - u_i)``, with the weight
  :data:`OVERLAP_WEIGHT` fitted on the pairs (``benchmarks/power_fit.py``: fit on 70 % of
  the model pairs, error reported on the rest). The same combination is applied to SM
  activity: an SM is idle only when no tenant has a warp on it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

UTIL_TO_SMACT: tuple[tuple[float, float], ...] = (
    (0.0, 0.0), (8.9, 0.7), (16.8, 3.0), (25.4, 8.1), (36.5, 21.6), (44.4, 34.8),
    (54.5, 46.3), (65.8, 58.0), (74.4, 69.4), (82.4, 77.9), (100.0, 92.0),
)
"""(GPU utilisation %, SM activity %) knots: per-decile medians of GPUMemNet's A100 runs
(fit split), then :data:`SMACT_AT_FULL_UTIL` at 100 %."""
SMACT_AT_FULL_UTIL = 92.0
"""SM activity of a job that keeps a kernel running all the time: an assumption (no run
in the data set is above ~90 % utilisation)."""
OVERLAP_WEIGHT = 0.84
"""Weight of the independent-overlap union in :func:`combined_pct` (1 - weight on the
capped sum), fitted on the Lucid pairs by ``benchmarks/power_fit.py``."""


def sm_activity_from_util(util_pct: float) -> float:
    """SM activity (%) of a job measured at ``util_pct`` GPU utilisation on an A100."""
    u = min(100.0, max(0.0, util_pct))
    for (u0, s0), (u1, s1) in itertools.pairwise(UTIL_TO_SMACT):
        if u <= u1:
            return s0 + (s1 - s0) * ((u - u0) / (u1 - u0) if u1 > u0 else 0.0)
    return UTIL_TO_SMACT[-1][1]


def combined_pct(demands_pct: Iterable[float], weight: float = OVERLAP_WEIGHT) -> float:
    """Busy share (%) of a GPU whose tenants alone would be busy ``demands_pct``.

    ``weight * union + (1 - weight) * min(100, sum)``, where the union is the busy share
    if the tenants' busy periods were independent. One tenant: its own demand.
    """
    us = [min(1.0, max(0.0, d / 100.0)) for d in demands_pct]
    if not us:
        return 0.0
    union = 1.0 - math.prod(1.0 - u for u in us)
    capped = min(1.0, sum(us))
    return 100.0 * (weight * union + (1.0 - weight) * capped)


def util_from_sm_activity(sm_pct: float) -> float:
    """Inverse of :func:`sm_activity_from_util`: the utilisation (%) a job at ``sm_pct``
    SM activity shows in nvidia-smi (the curve is strictly increasing)."""
    s = min(UTIL_TO_SMACT[-1][1], max(0.0, sm_pct))
    for (u0, s0), (u1, s1) in itertools.pairwise(UTIL_TO_SMACT):
        if s <= s1:
            return u0 + (u1 - u0) * ((s - s0) / (s1 - s0) if s1 > s0 else 0.0)
    return 100.0
