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

That fit describes jobs that share one MPS server (one user's jobs: Lucid ran its
pairs under MPS). Jobs that do not, i.e. clients of different users' MPS servers on
one GPU, or processes outside MPS, hold separate CUDA contexts, and the GPU runs one
context at a time: the driver time-slices them, without MPS's concurrent kernels.
:func:`rate_for` picks the model by that rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


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

TIME_SLICED = InterferenceModel(capacity_pct=96.0, alpha=1.0)
"""Separate CUDA contexts on one GPU (several users' MPS servers, processes outside
MPS): an assumption until measured on hardware (``colloc selftest --gpu`` times two
clients of one user against two users). ``alpha = 1``: contention costs in
proportion, with no gain from concurrent kernels, because contexts take turns.
``capacity_pct`` is the fitted one, so that time slicing is never kinder than MPS:
below it the jobs fill each other's idle gaps, as they do under MPS."""


class Tenant(Protocol):
    """What :func:`rate_for` needs of a GPU process (a :class:`~.state.ProcRecord`)."""

    @property
    def sm_pct(self) -> float:
        """SM demand alone on the GPU, %."""

    @property
    def mps_server(self) -> int:
        """PID of its MPS server; 0 outside MPS."""


def shares_one_server(tenants: Sequence[Tenant]) -> bool:
    """True if the GPU's tenants run concurrently: one alone, or clients of one server."""
    if len(tenants) <= 1:
        return True
    servers = {t.mps_server for t in tenants}
    return len(servers) == 1 and 0 not in servers


def rate_for(tenants: Sequence[Tenant]) -> float:
    """Speed, as a fraction of solo, of every job on a GPU running ``tenants``.

    One MPS server's clients share the GPU's SMs concurrently (:data:`DEFAULT_MODEL`);
    anything else on the GPU is a separate context, and the driver time-slices
    contexts (:data:`TIME_SLICED`), whatever each process's own server does.
    """
    model = DEFAULT_MODEL if shares_one_server(tenants) else TIME_SLICED
    return model.rate(t.sm_pct for t in tenants)


def thread_cap(demand_pct: float, active_thread_pct: float) -> float:
    """Speed limit of a job allowed ``active_thread_pct`` of the SMs, as a fraction of solo.

    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` confines a client's kernels to that share of
    the SMs; a job that alone would keep ``demand_pct`` of them busy then does at most
    ``active_thread_pct / demand_pct`` of its work per second (no limit when it would
    not have used more).
    """
    if demand_pct <= 0 or active_thread_pct >= demand_pct:
        return 1.0
    return max(0.0, active_thread_pct) / demand_pct
