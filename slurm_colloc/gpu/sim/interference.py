"""How much co-located jobs slow each other down on one GPU.

Model (fitted, see ``benchmarks/interference_fit.py``): a job runs at a fraction

    rate = min(1, C / S) ** alpha

of its speed alone, where ``S`` is the summed SM demand (each job's GPU utilisation
when alone, in %) of all jobs on the GPU, itself included. Below ``C`` the jobs fit in
the GPU's idle gaps and nobody slows down; above it they compete and every job slows
by the same factor. ``alpha < 1`` says contention hurts less than proportional time
slicing would (``alpha = 1``), which is what MPS's concurrent kernels buy.

The constants were fitted on the Lucid (ASPLOS '23) measurements of real training
jobs alone and in pairs sharing a GPU (``/work/shared/data/colocation``). They are
stored here rather than fitted at run time because the data is not shipped with the
package; ``tests/unit/test_sim_interference.py`` re-fits them when the data is
present and fails if these numbers drift from what the data says.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class InterferenceModel:
    """``rate = min(1, capacity_pct / S) ** alpha`` with ``S`` the summed SM demand."""

    capacity_pct: float
    alpha: float

    def rate(self, demands_pct: Iterable[float]) -> float:
        """Fraction of its solo speed each job on a GPU with these demands achieves."""
        total = sum(max(0.0, d) for d in demands_pct)
        if total <= self.capacity_pct or total <= 0:
            return 1.0
        return float((self.capacity_pct / total) ** self.alpha)


LUCID_FIT = InterferenceModel(capacity_pct=96.0, alpha=0.52)
"""Fit on 1,388 Lucid pairs (2,776 job speeds): MAE 0.070 vs 0.097 for "no slowdown"
(``python benchmarks/interference_fit.py`` prints the current figures)."""

DEFAULT_MODEL = LUCID_FIT
