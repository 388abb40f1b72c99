"""A fast, pure-Python simulation of one GPU node under a RAD-RM-like manager (no Slurm).

Why: a diagnostic of the simulation's *models* (interference, memory/OOM, activity,
power), free of the replayer's Slurm latencies: the thesis's policies
(:mod:`.thesis_policies`) play a thesis-like trace (:mod:`.thesis_trace`) in seconds,
and the results are set beside the thesis's hardware numbers. It is not the product
and not a replay.

Model (time-stepped, ``dt`` seconds):

* A dispatched job first starts (``startup_s``: CUDA context, data loader; a context's
  worth of memory, no SM activity), then holds ``steady_mib`` and runs; it reaches its
  true peak at ``peak_at`` of its work.
* Progress per second is the job's rate under its co-tenants from the repo's contention
  model (:data:`~slurm_colloc.gpu.sim.interference.MPS_FIT` for MPS,
  :data:`~.interference.TIME_SLICED` for streams).
* A job whose memory grows past the card's dies of OOM (the one that asked, as on
  hardware); it goes to the recovery queue and restarts from zero.
* The monitor reports SM activity averaged over a ``window_s`` window (thesis: 90 s,
  1 s samples; tenants combined by :func:`~.activity.combined_pct`) and memory in use
  now (nvidia-smi).
* Energy is summed step by step (the last step is counted whole: at most ``dt`` of
  power too much).
* Every ``decision_s`` the manager takes queued jobs FIFO, the recovery queue first
  (strict priority: a blocked head blocks the rest), at most ``per_decision`` of them.
* Power per GPU from :func:`~slurm_colloc.gpu.sim.power.power_w` on the combined SM
  activity; energy is summed over the run.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from slurm_colloc.bench.thesis_policies import GpuView, JobView, Policy
from slurm_colloc.bench.trace import Trace, TraceJob
from slurm_colloc.gpu.sim.activity import combined_pct
from slurm_colloc.gpu.sim.interference import MPS_FIT, TIME_SLICED, ContentionModel
from slurm_colloc.gpu.sim.power import A100_IDLE_W, A100_SXM_MAX_W, power_w

CONTEXT_MIB = 500
"""Memory of a CUDA context before the job allocates its own (A100, PyTorch)."""


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the diagnostic; defaults follow the thesis's description."""

    dt: float = 5.0
    decision_s: float = 5.0
    per_decision: int = 1
    startup_s: float = 30.0
    window_s: float = 90.0
    collocation: str = "mps"
    """``mps`` (one server per GPU) or ``streams`` (separate contexts, time-sliced)."""
    idle_w: float = A100_IDLE_W
    max_w: float = A100_SXM_MAX_W

    @property
    def model(self) -> ContentionModel:
        """The contention model of :attr:`collocation`."""
        return TIME_SLICED if self.collocation == "streams" else MPS_FIT


@dataclass
class Running:
    """A job on a GPU."""

    job: TraceJob
    gpu: int
    start: float
    done_s: float = 0.0
    mem_mib: int = CONTEXT_MIB

    def running_at(self, t: float, cfg: SimConfig) -> bool:
        """Past its start-up (its kernels run)."""
        return t >= self.start + cfg.startup_s

    def want_mib(self, t: float, cfg: SimConfig) -> int:
        """Memory it holds at ``t`` by its own profile."""
        if not self.running_at(t, cfg):
            return CONTEXT_MIB
        if self.done_s >= self.job.peak_at * self.job.work_s:
            return self.job.peak_mib
        return self.job.steady_mib


@dataclass
class JobRecord:
    """What happened to one job."""

    arrival: float
    first_start: float = -1.0
    last_start: float = -1.0
    finish: float = -1.0
    ooms: int = 0


@dataclass
class RunResult:
    """Outcome of one simulated run."""

    policy: str
    makespan_s: float
    energy_j: float
    jobs: dict[str, JobRecord]
    gpus: int
    idle_w: float
    busy_smact_pct: float = 0.0

    @property
    def ooms(self) -> int:
        """OOM crashes in the run."""
        return sum(r.ooms for r in self.jobs.values())

    def energy_over(self, window_s: float) -> float:
        """Energy (J) over a common window: idle GPUs after this run's makespan."""
        return self.energy_j + max(0.0, window_s - self.makespan_s) * self.gpus * self.idle_w

    def mean(self, what: str) -> float:
        """Mean over jobs of ``wait``, ``exec`` or ``jct`` (seconds, thesis 6.3.4)."""
        vals = []
        for r in self.jobs.values():
            jct, ex = r.finish - r.arrival, r.finish - r.last_start
            vals.append({"wait": jct - ex, "exec": ex, "jct": jct}[what])
        return sum(vals) / len(vals) if vals else 0.0


@dataclass
class _State:
    cfg: SimConfig
    gpus: int
    gpu_mib: int
    running: list[Running] = field(default_factory=list)
    queue: deque[TraceJob] = field(default_factory=deque)
    recovery: deque[TraceJob] = field(default_factory=deque)
    windows: list[deque[float]] = field(default_factory=list)
    rate_cache: dict[tuple[float, ...], list[float]] = field(default_factory=dict)

    def on(self, g: int) -> list[Running]:
        return [r for r in self.running if r.gpu == g]

    def smact_now(self, g: int, t: float) -> float:
        return combined_pct([r.job.sm_pct for r in self.on(g) if r.running_at(t, self.cfg)])

    def view(self, g: int) -> GpuView:
        ten = self.on(g)
        win = self.windows[g]
        return GpuView(
            index=g, tenants=len(ten), used_mib=sum(r.mem_mib for r in ten),
            capacity_mib=self.gpu_mib, smact_pct=sum(win) / len(win) if win else 0.0,
            known_peaks_mib=sum(r.job.peak_mib for r in ten),
        )

    def rates(self, demands: tuple[float, ...]) -> list[float]:
        if demands not in self.rate_cache:
            self.rate_cache[demands] = self.cfg.model.rates(demands)
        return self.rate_cache[demands]


def _dispatch(st: _State, policy: Policy, t: float, recs: dict[str, JobRecord]) -> None:
    """One decision: recovery queue first, then the main queue, FIFO, strict heads."""
    placed = 0
    while placed < st.cfg.per_decision and (st.recovery or st.queue):
        rec = bool(st.recovery)
        job = st.recovery[0] if rec else st.queue[0]
        view = [st.view(g) for g in range(st.gpus)]
        jv = JobView(job.name, job.peak_mib, job.guess_mib)
        g = policy.choose_recovery(jv, view) if rec else policy.choose(jv, view)
        if g is None:
            return
        (st.recovery if rec else st.queue).popleft()
        st.running.append(Running(job, g, t))
        r = recs[job.name]
        r.last_start = t
        if r.first_start < 0:
            r.first_start = t
        placed += 1


def _advance(st: _State, t: float, recs: dict[str, JobRecord]) -> None:
    """Progress every running job by one step; finish the jobs that complete in it."""
    dt, cfg = st.cfg.dt, st.cfg
    for g in range(st.gpus):
        act = [r for r in st.on(g) if r.running_at(t, cfg)]
        rates = st.rates(tuple(r.job.sm_pct for r in act))
        for r, rate in zip(act, rates, strict=True):
            left = r.job.work_s - r.done_s
            if rate * dt >= left:
                recs[r.job.name].finish = t + left / rate
                r.done_s = r.job.work_s
            else:
                r.done_s += rate * dt
    for r in [r for r in st.running if r.done_s >= r.job.work_s]:
        st.running.remove(r)


def _memory(st: _State, t: float, recs: dict[str, JobRecord]) -> None:
    """Grow each job's memory to its profile; the job that cannot get it dies (OOM)."""
    for g in range(st.gpus):
        for r in sorted(st.on(g), key=lambda r: r.start):
            want = r.want_mib(t, st.cfg)
            if want <= r.mem_mib:
                r.mem_mib = want
                continue
            used = sum(o.mem_mib for o in st.on(g))
            if used - r.mem_mib + want > st.gpu_mib:
                st.running.remove(r)
                recs[r.job.name].ooms += 1
                st.recovery.append(r.job)
            else:
                r.mem_mib = want


def simulate(trace: Trace, policy: Policy, cfg: SimConfig | None = None) -> RunResult:
    """Play ``trace`` on its node under ``policy``; returns per-job records and energy."""
    cfg = cfg or SimConfig()
    if any(abs(x / cfg.dt - round(x / cfg.dt)) > 1e-9 for x in (cfg.decision_s, cfg.startup_s)):
        raise ValueError("decision_s and startup_s must be multiples of dt")
    st = _State(cfg, trace.gpus, trace.gpu_memory_mib)
    st.windows = [deque(maxlen=max(1, round(cfg.window_s / cfg.dt))) for _ in range(st.gpus)]
    recs = {j.name: JobRecord(j.arrival_s) for j in trace.jobs}
    pending = deque(sorted(trace.jobs, key=lambda j: j.arrival_s))
    t, energy, next_decision, smact_busy = 0.0, 0.0, 0.0, []
    while pending or st.queue or st.recovery or st.running:
        while pending and pending[0].arrival_s <= t:
            st.queue.append(pending.popleft())
        if t >= next_decision:
            _dispatch(st, policy, t, recs)
            next_decision = t + cfg.decision_s
        _memory(st, t, recs)
        for g in range(st.gpus):
            s = st.smact_now(g, t)
            st.windows[g].append(s)
            energy += power_w(s, cfg.idle_w, cfg.max_w) * cfg.dt
            if s > 0:
                smact_busy.append(s)
        _advance(st, t, recs)
        t += cfg.dt
        if t > 1e7:
            raise RuntimeError(f"{policy.name}: no progress (a job no GPU can take?)")
    makespan = max(r.finish for r in recs.values())
    busy = sum(smact_busy) / len(smact_busy) if smact_busy else 0.0
    return RunResult(policy.name, makespan, energy, recs, trace.gpus, cfg.idle_w, busy)
