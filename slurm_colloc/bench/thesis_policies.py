"""The collocation thesis's resource manager (RAD-RM, chapter 6) as small placement policies.

Why: issue 24 asks whether the simulation, driven by the same placement rules as the
thesis's hardware runs, lands near its published per-policy results. These objects
only *choose*: given what RAD-RM's monitor sees of each GPU, return a GPU index or
``None`` (wait). The fast simulator (:mod:`.fastsim`) plays them; nothing here knows
Slurm.

Rules, as published (thesis 6.2.2, 6.2.3, 6.3.3):

* **Exclusive**: an idle GPU (no tenant), any; otherwise wait.
* **Round robin (RR)**: the next GPU in cyclic order, no condition ("RR (no
  condition)", table 6.3); OOMs are left to the recovery queue.
* **MAGM** / **LUG**: among GPUs with SMACT <= a threshold (80 %) and more than a
  minimum of free memory (5 GB; 2 GB in some runs), the one with the most free memory
  (MAGM) or the lowest SMACT (LUG). Without an estimator, "free memory" is what
  nvidia-smi reports now; with an estimator the job's estimate must also fit.
* **Oracles** (OFF/OBF/OWF/OLUG): the job's true need plus a 2 GB margin must fit and
  SMACT must be < 80 %; first fit / least free (best fit) / most free (worst fit) /
  lowest SMACT. The oracle knows every job's true memory, so a GPU's free memory is
  the card minus its tenants' true peaks.
* **Recovery queue**: a job that died of OOM is retried before any other, on an idle
  GPU (the exclusive rule) -- :meth:`Policy.choose_recovery`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

GIB = 1024


@dataclass(frozen=True)
class GpuView:
    """One GPU as RAD-RM's monitor reports it at a decision."""

    index: int
    tenants: int
    used_mib: int
    """Memory in use now (nvidia-smi)."""
    capacity_mib: int
    smact_pct: float
    """SM activity averaged over the monitor's window (dcgm), %."""
    known_peaks_mib: int = 0
    """Sum of the tenants' true peaks (what an oracle knows)."""

    @property
    def free_mib(self) -> int:
        """Free memory as nvidia-smi reports it."""
        return self.capacity_mib - self.used_mib

    @property
    def oracle_free_mib(self) -> int:
        """Free memory once every tenant reaches its true peak."""
        return self.capacity_mib - self.known_peaks_mib


@dataclass(frozen=True)
class JobView:
    """What RAD-RM knows of the job at the head of the queue."""

    name: str
    true_mib: int
    estimate_mib: int | None = None
    """A memory estimator's answer (None: no estimator)."""


def _idle(gpus: Sequence[GpuView]) -> int | None:
    for g in gpus:
        if g.tenants == 0:
            return g.index
    return None


@dataclass
class Policy:
    """Base: exclusive placement (an idle GPU or wait)."""

    name: str = "exclusive"

    def choose(self, job: JobView, gpus: Sequence[GpuView]) -> int | None:
        """GPU index for ``job``, or None to keep it queued."""
        return _idle(gpus)

    def choose_recovery(self, job: JobView, gpus: Sequence[GpuView]) -> int | None:
        """A job back from an OOM runs alone first (thesis 6.2.3)."""
        return _idle(gpus)


@dataclass
class RoundRobin(Policy):
    """Cyclic order, no gate: the next GPU whatever its load."""

    name: str = "rr"
    _next: int = field(default=0, repr=False)

    def choose(self, job: JobView, gpus: Sequence[GpuView]) -> int | None:
        """The GPU after the last one chosen."""
        if not gpus:
            return None
        g = gpus[self._next % len(gpus)].index
        self._next += 1
        return g


ORDERS = ("most_free", "least_smact", "first", "least_free")


@dataclass
class Gated(Policy):
    """MAGM, LUG and the oracles: gate on SMACT and memory, then order.

    ``memory``: ``"measured"`` (nvidia-smi free >= ``min_free_mib``), ``"estimate"``
    (measured free >= the estimate + ``margin_mib``, and >= ``min_free_mib``) or
    ``"oracle"`` (free after every tenant's true peak >= true need + ``margin_mib``).
    """

    name: str = "magm"
    order: str = "most_free"
    smact_max: float | None = 80.0
    min_free_mib: int = 5 * GIB
    memory: str = "measured"
    margin_mib: int = 0
    strict_smact: bool = False
    """Oracles use 'SMACT < 80 %', MAGM/LUG 'SMACT <= 80 %'."""

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order {self.order!r} not in {ORDERS}")
        if self.memory not in ("measured", "estimate", "oracle"):
            raise ValueError(f"memory {self.memory!r}")

    def fits(self, job: JobView, g: GpuView) -> bool:
        """The thesis's gates for one GPU."""
        if self.smact_max is not None:
            over = g.smact_pct >= self.smact_max if self.strict_smact else (
                g.smact_pct > self.smact_max)
            if over:
                return False
        if self.memory == "oracle":
            return g.oracle_free_mib >= job.true_mib + self.margin_mib
        if g.free_mib < self.min_free_mib:
            return False
        if self.memory == "estimate" and job.estimate_mib is not None:
            return g.free_mib >= job.estimate_mib + self.margin_mib
        return True

    def _free(self, g: GpuView) -> int:
        return g.oracle_free_mib if self.memory == "oracle" else g.free_mib

    def choose(self, job: JobView, gpus: Sequence[GpuView]) -> int | None:
        """The best gated GPU by :attr:`order` (ties: lowest index)."""
        ok = [g for g in gpus if self.fits(job, g)]
        if not ok:
            return None
        if self.order == "first":
            return ok[0].index
        keys = {
            "most_free": lambda g: (-self._free(g), g.index),
            "least_free": lambda g: (self._free(g), g.index),
            "least_smact": lambda g: (g.smact_pct, g.index),
        }
        return min(ok, key=keys[self.order]).index


def thesis_policies() -> dict[str, Policy]:
    """Fresh policy objects under the thesis's names (RR keeps a cursor: one per run)."""
    def oracle(name: str, order: str) -> Gated:
        return Gated(name, order=order, memory="oracle", margin_mib=2 * GIB, strict_smact=True)

    return {
        "exclusive": Policy(),
        "rr": RoundRobin(),
        "magm": Gated("magm", smact_max=None, min_free_mib=0),
        "magm-80": Gated("magm-80", min_free_mib=0),
        "magm-80-2g": Gated("magm-80-2g", min_free_mib=2 * GIB),
        "magm-80-5g": Gated("magm-80-5g"),
        "lug-80-5g": Gated("lug-80-5g", order="least_smact"),
        "lug-80-2g": Gated("lug-80-2g", order="least_smact", min_free_mib=2 * GIB),
        "magm-75-5g": Gated("magm-75-5g", smact_max=75.0),
        "magm-85-5g": Gated("magm-85-5g", smact_max=85.0),
        "magm-est": Gated("magm-est", smact_max=None, min_free_mib=0, memory="estimate"),
        "magm-80-est": Gated("magm-80-est", min_free_mib=0, memory="estimate"),
        "off": oracle("off", "first"),
        "obf": oracle("obf", "least_free"),
        "owf": oracle("owf", "most_free"),
        "olug": oracle("olug", "least_smact"),
        # not the thesis's: the replayer's colloc-oracle rule (true memory, first fit, no
        # SMACT gate, no margin), to tell the contention model from the replay's lags
        "off-mem": Gated("off-mem", order="first", smact_max=None, memory="oracle"),
    }
