"""How much co-located jobs slow each other down on one GPU: n tenants, each its own rate.

Model (fitted on pairs, see ``benchmarks/interference_fit.py``). Tenant ``i`` of a GPU
has a solo SM demand ``u_i`` (its GPU utilisation alone, as a fraction); ``O_i`` is the
summed demand of the *other* tenants. Its slowdown (time per unit of work relative to
running alone, ``1 / rate``) is the larger of two effects:

* **contention**: ``1 + a * u_i**p * O_i**q``. Concurrent kernels compete for SMs,
  caches and memory bandwidth; a job that keeps the GPU busier suffers more (``p``)
  and the pressure grows faster than linearly with the others' load (``q > 1``).
  The factor differs per tenant whenever their demands differ: the pairs measure it
  (a 90 % job next to a 30 % one slows down more than its partner).
* **saturation**: once the summed demand exceeds what the GPU can serve, the GPU
  phases of every job stretch by a common factor ``k`` so that the tenants' busy
  shares add up to the capacity ``C``: ``sum_i u_i / ((1 - u_i) + u_i * k) = C``;
  tenant ``i``'s slowdown is ``(1 - u_i) + u_i * k`` (its non-GPU time does not stretch).
  ``C > 1`` under one MPS server (concurrent kernels fill each other's idle SMs);
  ``C = 1`` for separate CUDA contexts, which the driver time-slices: several users'
  MPS servers on one GPU, or processes outside MPS.

Both terms extend to any number of tenants without new constants. ``a, p, q`` are
fitted on the Lucid (ASPLOS '23) pairs (1,388 pairs sharing a GPU under MPS, each
job's speed normalised to its speed alone, ``/work/shared/data/colocation``) by least
absolute slowdown error; ``C`` is the value that then minimises the same error
(1.25; weakly identified: the error is flat above it because two tenants rarely
saturate a GPU, and clearly worse below it). Checked, not fitted, against published
multi-job MPS measurements on an A100: three co-located training jobs run +50-110 %
slower each, seven small jobs 2-2.5x (``interference_fit.py --json``).

The constants are stored here because the data is not shipped with the package;
``tests/unit/test_interference_model.py`` re-fits them when the data is present and
fails if they drift.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol


def saturation_stretch(demands: Sequence[float], capacity: float) -> float:
    """The common stretch ``k >= 1`` of GPU phases: ``sum u / ((1 - u) + u k) = capacity``.

    ``demands`` are fractions (0..1). 1.0 when the summed demand fits the capacity.
    """
    us = [min(1.0, max(0.0, u)) for u in demands]
    if sum(us) <= capacity or capacity <= 0:
        return 1.0
    lo, hi = 1.0, 2.0
    while sum(u / ((1 - u) + u * hi) for u in us) > capacity:
        hi *= 2.0
        if hi > 1e9:
            return hi
    for _ in range(60):
        k = (lo + hi) / 2
        if sum(u / ((1 - u) + u * k) for u in us) > capacity:
            lo = k
        else:
            hi = k
    return (lo + hi) / 2


@dataclass(frozen=True)
class ContentionModel:
    """Per-tenant slowdown ``max(1 + a u^p O^q, (1 - u) + u k(C))`` (module docstring)."""

    a: float
    p: float
    q: float
    capacity: float
    """GPU capacity in solo-demand units (1.0 = one job busy 100 % of the time)."""

    def slowdowns(self, demands_pct: Iterable[float]) -> list[float]:
        """Slowdown (time per unit of work / alone) of every tenant, in order."""
        us = [min(1.0, max(0.0, d / 100.0)) for d in demands_pct]
        if len(us) <= 1:
            return [1.0] * len(us)
        total = sum(us)
        k = saturation_stretch(us, self.capacity)
        out = []
        for u in us:
            others = total - u
            cont = 1.0 + self.a * u**self.p * others**self.q if u > 0 and others > 0 else 1.0
            out.append(max(cont, (1.0 - u) + u * k))
        return out

    def rates(self, demands_pct: Iterable[float]) -> list[float]:
        """Fraction of its solo speed each tenant achieves, in order."""
        return [1.0 / s for s in self.slowdowns(demands_pct)]

    def rate(self, demands_pct: Sequence[float]) -> float:
        """Rate of the *first* tenant (its own demand first, then its co-tenants')."""
        if not demands_pct:
            return 1.0
        return self.rates(demands_pct)[0]


MPS_FIT = ContentionModel(a=0.7474, p=1.728, q=1.665, capacity=1.25)
"""Fit on 1,388 Lucid pairs (2,776 job speeds). Leave-one-model-out slowdown error and
the multi-job checks: ``python benchmarks/interference_fit.py --json``
(``benchmarks/results/interference.json``)."""

DEFAULT_MODEL = MPS_FIT
LUCID_FIT = MPS_FIT

TIME_SLICED = replace(MPS_FIT, capacity=1.0)
"""Separate CUDA contexts on one GPU (several users' MPS servers, processes outside
MPS): the driver runs one context at a time, so the summed busy share cannot exceed
one GPU (``C = 1``); the same contention while it is below. Never kinder than MPS.
An assumption until measured on hardware (``colloc selftest --gpu`` times two
clients of one user against two users)."""


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


def model_for(tenants: Sequence[Tenant]) -> ContentionModel:
    """One MPS server's clients: :data:`MPS_FIT`; anything else: :data:`TIME_SLICED`."""
    return DEFAULT_MODEL if shares_one_server(tenants) else TIME_SLICED


def rate_for(tenants: Sequence[Tenant], pid: int | None = None) -> float:
    """Speed, as a fraction of solo, of one job on a GPU running ``tenants``.

    The job is the tenant whose ``pid`` is given (the first tenant when ``pid`` is
    None or not among them). One MPS server's clients share the GPU's SMs
    concurrently (:data:`MPS_FIT`); anything else on the GPU is a separate context,
    and the driver time-slices contexts (:data:`TIME_SLICED`).
    """
    if not tenants:
        return 1.0
    me = 0
    if pid is not None:
        for i, t in enumerate(tenants):
            if getattr(t, "pid", None) == pid:
                me = i
                break
    return model_for(tenants).rates([t.sm_pct for t in tenants])[me]


def thread_cap(demand_pct: float, active_thread_pct: float) -> float:
    """Speed limit of a job allowed ``active_thread_pct`` of the SMs, as a fraction of solo.

    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` confines a client's kernels to that share of
    the SMs; a job that alone would keep ``demand_pct`` of them busy then does at most
    ``active_thread_pct / demand_pct`` of its work per second (no limit when it would
    not have used more). Its recorded demand is capped as well, so its co-tenants see
    less pressure from it (:mod:`.simjob`).
    """
    if demand_pct <= 0 or active_thread_pct >= demand_pct:
        return 1.0
    return max(0.0, active_thread_pct) / demand_pct
