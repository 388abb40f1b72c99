"""How much co-located jobs slow each other down on one GPU: n tenants, each its own rate.

**Input: each tenant's SM activity alone on the GPU, in %** (DCGM's SMACT, the share of
SMs with a warp resident, averaged over time; what the traces carry in ``sm_pct`` and
:class:`~.state.ProcRecord` holds). Not nvidia-smi's GPU utilisation (the share of time
any kernel runs): where the model needs that, it maps SM activity back with
:func:`~.activity.util_from_sm_activity` (GPUMemNet's A100 runs). Tenant ``i`` has SM
activity ``s_i`` and utilisation ``g_i`` (fractions). Its slowdown (time per unit of
work relative to running alone, ``1 / rate``) is the larger of two effects:

* **contention**: ``1 + a * g_i**p * B_i**q``, ``B_i = 1 - prod_{j != i} (1 - g_j)``: the
  share of time at least one other tenant runs kernels (independent busy periods; for
  a pair simply the partner's utilisation). Concurrent kernels compete for SMs, caches
  and memory bandwidth while they overlap; a job that keeps the GPU busier suffers more
  (``p``). ``B`` cannot exceed one, so contention alone never makes a crowded GPU do
  less work than running its jobs in turn: crowding is the saturation term's business.
* **saturation**: once the summed demand exceeds what the GPU can serve, the busy
  phases of every job stretch by a common factor ``k`` so that the tenants' busy
  shares add up to the capacity ``C``: ``sum_i x_i / ((1 - x_i) + x_i * k) = C``;
  tenant ``i``'s slowdown is ``(1 - x_i) + x_i * k``. Under one MPS server kernels of
  all clients run at once and the limit is the SMs: ``x = s`` (SM activity),
  ``C`` about one GPU's SMs. Separate CUDA contexts (several users' MPS servers,
  processes outside MPS, the thesis's "naive" collocation) are time-sliced by the
  driver, one context at a time: ``x = g`` (utilisation, time) and ``C = 1``.

``a, p, q`` are fitted on the Lucid (ASPLOS '23) pairs (1,388 pairs under MPS, each
job's speed normalised to its speed alone, ``/work/shared/data/colocation``) by least
absolute slowdown error; pairs only ever have one partner, so how contention adds up
for three and more tenants (``B``) is a modelling choice, the one that keeps a
time-sliced crowded GPU at the speed of running its jobs in turn, as the thesis
measured. ``C`` is the value that minimises the pairs' error (on SM activity mapped
from their utilisation). Checked, not fitted, against the collocation thesis's A100
figures (chapter 4, ``/work/shared/docs/reading``): three MPS jobs +50-110 %, seven
small jobs 2-2.5x, two small jobs about as fast as one, large models time-sliced about
as long as in turn, MPS still ahead; the recommender + ResNet152 table. Per-regime
held-out errors: ``python benchmarks/interference_fit.py``
(``benchmarks/results/interference.json``, docs/benchmarks.md).

The constants are stored here because the data is not shipped with the package;
``tests/unit/test_interference_model.py`` re-fits them when the data is present and
fails if they drift.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from slurm_colloc.gpu.sim.activity import sm_activity_from_util, util_from_sm_activity


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


def others_busy(busy: Sequence[float], i: int) -> float:
    """Share of time at least one tenant other than ``i`` is busy (independent phases)."""
    return 1.0 - math.prod(1.0 - b for j, b in enumerate(busy) if j != i)


@dataclass(frozen=True)
class ContentionModel:
    """Per-tenant slowdown ``max(1 + a g^p B^q, (1 - x) + x k(C))`` (module docstring)."""

    a: float
    p: float
    q: float
    capacity: float
    """Saturation capacity: in SM-activity units (1.0 = every SM busy all the time) under
    one MPS server, in time units (1.0 = a kernel running all the time) if time-sliced."""
    time_sliced: bool = False
    """Separate contexts: saturation on utilisation (time), not on SM activity."""
    switch_cost: float = 0.0
    """Time-sliced only: share of the GPU's time lost to switching contexts when they
    alternate evenly; scaled by how much the GPU must alternate (the other contexts'
    busy time over the busiest one's, at most 1), so a tiny co-tenant costs a busy job
    little (:meth:`effective_capacity`)."""

    def effective_capacity(self, busy: Sequence[float]) -> float:
        """Capacity left after context switches (time-sliced), else :attr:`capacity`."""
        if not self.time_sliced or not self.switch_cost or len(busy) < 2:
            return self.capacity
        top = max(busy)
        if top <= 0:
            return self.capacity
        alternation = min(1.0, (sum(busy) - top) / top)
        return self.capacity * (1.0 - self.switch_cost * alternation)

    def slowdowns(self, demands_pct: Iterable[float]) -> list[float]:
        """Slowdown (time per unit of work / alone) of every tenant, in order.

        ``demands_pct``: each tenant's SM activity alone on the GPU, % (module docstring).
        """
        sm = [min(1.0, max(0.0, d / 100.0)) for d in demands_pct]
        if len(sm) <= 1:
            return [1.0] * len(sm)
        util = [min(1.0, util_from_sm_activity(100.0 * s) / 100.0) for s in sm]
        busy = util if self.time_sliced else sm
        k = saturation_stretch(busy, self.effective_capacity(busy))
        out = []
        for i, g in enumerate(util):
            others = others_busy(util, i)
            cont = 1.0 + self.a * g**self.p * others**self.q if g > 0 and others > 0 else 1.0
            out.append(max(cont, (1.0 - busy[i]) + busy[i] * k))
        return out

    def rates(self, demands_pct: Iterable[float]) -> list[float]:
        """Fraction of its solo speed each tenant achieves, in order."""
        return [1.0 / s for s in self.slowdowns(demands_pct)]

    def rate(self, demands_pct: Sequence[float]) -> float:
        """Rate of the *first* tenant (its own demand first, then its co-tenants')."""
        if not demands_pct:
            return 1.0
        return self.rates(demands_pct)[0]


MPS_FIT = ContentionModel(a=0.7474, p=1.728, q=1.665, capacity=1.08)
"""Fit on 1,388 Lucid pairs (2,776 job speeds). Held-out errors per regime and the
thesis checks: ``python benchmarks/interference_fit.py``
(``benchmarks/results/interference.json``)."""

DEFAULT_MODEL = MPS_FIT
LUCID_FIT = MPS_FIT

CONTEXT_SWITCH_COST = 0.10
"""Share of a time-sliced GPU's time lost when its contexts alternate evenly. Measured on
an H100 (driver 580, ``benchmarks/hw_colocation.py``, two runs): two to four saturating
tenants as separate contexts, or on two MPS servers, did 0.88-0.92 of one job's work
per second (bf16 GEMMs, small fp32 GEMMs and copies alike). Scaled down when one
context dominates (:meth:`ContentionModel.effective_capacity`): the thesis measured a
ResNet152 beside a 5 % recommender, time-sliced, only 5.7 % slower."""

TIME_SLICED = replace(MPS_FIT, capacity=1.0, time_sliced=True, switch_cost=CONTEXT_SWITCH_COST)
"""Separate CUDA contexts on one GPU (several users' MPS servers, processes outside
MPS): the driver runs one context at a time, so the summed busy *time* cannot exceed
the GPU's (``C = 1`` on utilisation) less the context switches
(:data:`CONTEXT_SWITCH_COST`); the same contention while it is below. Never kinder than
MPS. Checked on the thesis's naive collocation (large models about as long as in turn;
recommender + ResNet152) and on the H100 runs (``benchmarks/hw_check.py``)."""


class Tenant(Protocol):
    """What :func:`rate_for` needs of a GPU process (a :class:`~.state.ProcRecord`)."""

    @property
    def sm_pct(self) -> float:
        """SM activity alone on the GPU (DCGM SMACT), % (the model's input)."""

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


def contexts(tenants: Sequence[Tenant]) -> list[list[int]]:
    """The GPU's contexts, as lists of tenant indices: one per MPS server (its clients),
    one per process outside MPS."""
    groups: dict[int, list[int]] = {}
    alone: list[list[int]] = []
    for i, t in enumerate(tenants):
        if t.mps_server:
            groups.setdefault(t.mps_server, []).append(i)
        else:
            alone.append([i])
    return [*groups.values(), *alone]


def _union_util_pct(sm_pcts: Sequence[float]) -> float:
    """Busy time (%) of a context whose clients alone show ``sm_pcts`` SM activity."""
    idle = math.prod(1.0 - min(1.0, util_from_sm_activity(s) / 100.0) for s in sm_pcts)
    return 100.0 * (1.0 - idle)


def rate_for(tenants: Sequence[Tenant], pid: int | None = None) -> float:
    """Speed, as a fraction of solo, of one job on a GPU running ``tenants``.

    The job is the tenant whose ``pid`` is given (the first tenant when ``pid`` is
    None or not among them). One MPS server's clients share the GPU's SMs
    concurrently (:data:`MPS_FIT`); separate contexts (each MPS server, each process
    outside MPS) are time-sliced by the driver (:data:`TIME_SLICED`), and the slices go
    to *contexts*, not to processes: a server with two clients gets about the time a
    server with one gets, which its clients then share under MPS. On an H100 the lone
    client of one server ran 1.6x faster than each of two sharing the other
    (``benchmarks/results/hardware``); splitting time per process gave them equal speed.
    """
    if not tenants:
        return 1.0
    me = 0
    if pid is not None:
        for i, t in enumerate(tenants):
            if getattr(t, "pid", None) == pid:
                me = i
                break
    sm = [t.sm_pct for t in tenants]
    if shares_one_server(tenants):
        return DEFAULT_MODEL.rates(sm)[me]
    groups = contexts(tenants)
    if all(len(g) == 1 for g in groups):
        return TIME_SLICED.rates(sm)[me]
    # each context's busy time as the SM activity the time-sliced model takes
    ctx = [sm_activity_from_util(_union_util_pct([sm[i] for i in g])) for g in groups]
    mine = next(c for c, g in enumerate(groups) if me in g)
    sliced = TIME_SLICED.slowdowns(ctx)[mine]
    group = groups[mine]
    inner = DEFAULT_MODEL.slowdowns([sm[i] for i in group])[group.index(me)]
    return 1.0 / (sliced * inner)


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
