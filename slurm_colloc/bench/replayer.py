"""Replay a trace through real Slurm: one devcluster per policy, all in the same run.

Each policy gets its own devcluster (own root, ports and simulated GPUs) so the
policies see the same arrivals at the same wall times and the same machine load.
Arrivals are compressed by ``time_scale`` (trace seconds per wall second); the
simulated GPUs use the same scale, so a job's work, its slowdown from co-tenants and
the GPUs' energy counters are all in trace time. Slurm's own latencies (scheduler
passes, prolog/epilog, the 10 s requeue delay) are *not* compressed: they cost
``time_scale`` times more trace time than on a real cluster, which penalises every
policy per job start and recovery more than reality does.

With ``nodes`` > 1 the trace's GPUs are split over that many alike hosts (each in its
own namespaces, :class:`~slurm_colloc.devcluster.layout.Spec` ``uniform``), so the
capacity is the one-node run's and only the number of hosts differs; the GPUs are
numbered across hosts (host ``h``'s GPU ``i`` is ``h * gpus_per_node + i``).
"""

from __future__ import annotations

import logging
import math
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from slurm_colloc.bench.collect import JobOutcome, collect, records_settled
from slurm_colloc.bench.policies import Policy
from slurm_colloc.bench.sampler import GpuSampler
from slurm_colloc.bench.trace import Trace, TraceJob
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.layout import MAX_NODES, Layout, Spec
from slurm_colloc.gpu.sim.state import init_state
from slurm_colloc.slurm.adapter import TERMINAL_STATES, SlurmCli, SlurmError

log = logging.getLogger("colloc.bench")
REJECTED_TOO_BIG = "offers at most"


@dataclass(frozen=True)
class ReplayConfig:
    """How to run a replay."""

    time_scale: float = 120.0
    root_base: str = "/var/lib/colloc-replay"
    port_base: int = 21810
    keep_clusters: bool = False
    poll_s: float = 2.0
    timeout_s: float = 3600.0
    settle_s: float = 60.0
    estimator_command: str = ""
    """Program the cli_filter runs as the estimator ('' = the installed ``colloc``)."""
    nodes: int = 1
    """Compute hosts the trace's GPUs are split over (same total capacity)."""
    time_limit_factor: float = 0.0
    """Each job asks for ``--time`` = this many times its solo run time (wall minutes,
    rounded up, at least 1); 0: no time limits (Slurm's backfill then cannot plan, so a
    job needing wholly free GPUs waits until some happen to drain). Sites set limits;
    the factor stands for users' over-asking and must cover co-location's slowdown, or
    a slowed job times out (a lost job in the results)."""


@dataclass
class PolicyRun:
    """One policy's replay of one trace."""

    policy: Policy
    cluster: Cluster
    workdir: Path
    jobs: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, Path] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    """Jobs whose estimate exceeded a GPU: the user resubmitted with --gres=gpu:1."""
    submit_errors: dict[str, str] = field(default_factory=dict)
    sampler: GpuSampler | None = None
    outcomes: list[JobOutcome] = field(default_factory=list)
    finished_wall: float = 0.0
    error: str = ""


def gpus_per_node(trace: Trace, nodes: int) -> int:
    """The trace's GPUs split evenly over ``nodes`` hosts; ValueError (with what to do)
    where they do not divide or a job asks for more GPUs than one host has."""
    if not 1 <= nodes <= MAX_NODES or trace.gpus % nodes:
        raise ValueError(f"--nodes {nodes}: the trace's {trace.gpus} GPUs do not split "
                         f"evenly over that many hosts; choose a divisor up to {MAX_NODES}")
    per = trace.gpus // nodes
    widest = max((j.gpus for j in trace.jobs), default=1)
    if widest > per:
        raise ValueError(f"--nodes {nodes}: {per} GPUs per host, but a job of the trace "
                         f"asks for {widest} on one host; use fewer hosts")
    return per


def cluster_for(trace: Trace, policy: Policy, index: int, cfg: ReplayConfig) -> Cluster:
    """The devcluster of policy number ``index``: its own root and port block."""
    base = cfg.port_base + 10 * index
    spec = Spec(
        gpus=gpus_per_node(trace, cfg.nodes), gpu_memory_mib=trace.gpu_memory_mib, cpus=96,
        memory_mib=98304, cluster_name=f"replay{index}", ctld_port=base,
        slurmd_port=base + 1, dbd_port=base + 2, mysql_port=base + 3,
        node_scripts=policy.node_scripts, nodes=cfg.nodes, uniform=cfg.nodes > 1,
        mps_protocol=policy.mps_protocol, spread_shards=policy.spread_shards,
        sm_capacity_pct=policy.sm_capacity_pct, priority_weight_tres=policy.priority_weight_tres,
    )
    return Cluster(Layout(Path(f"{cfg.root_base}-{policy.name}")), spec)


def warm_compute_history(trace: Trace, summaries: dict[str, str],
                         uid_of: Callable[[str], int | None]) -> dict[tuple[int, str], int]:
    """The compute-history table a site would have after these jobs' earlier runs.

    Why: compute admission sizes a job by its user's measured runs of the same model;
    a replay starts on an empty accounting database, so the table root's timer would
    have written (``colloc admin compute-history``) is written from the trace: per
    (user, summary fingerprint), the largest ``sm_pct`` of the trace's jobs, as
    :func:`~slurm_colloc.accounting.compute_history.expected_sm` keeps it. Jobs
    without a summary (``--colloc-mem``) have no fingerprint and get the prior.
    """
    from slurm_colloc.estimators import parse_summary

    fps: dict[str, str] = {}
    out: dict[tuple[int, str], int] = {}
    for job in trace.jobs:
        text = summaries.get(job.summary or "")
        uid = uid_of(job.user) if job.user else None
        if text is None or uid is None or job.gpus != 1:
            continue
        if job.summary not in fps:
            fps[job.summary] = parse_summary(text).fingerprint()
        key = (uid, fps[job.summary])
        sm = max(1, min(100, math.ceil(job.sm_pct)))
        out[key] = max(out.get(key, 0), sm)
    return out


def sim_dirs(cluster: Cluster) -> list[Path]:
    """Each host's simulated-GPU state directory, in host order (GPU numbering order)."""
    if not cluster.spec.multi_node:
        return [cluster.layout.sim]
    return [cluster.layout.node_dir(n.name) / "sim" for n in cluster.spec.node_plans()]


def time_limit_args(job: TraceJob, cfg: ReplayConfig) -> list[str]:
    """``--time=M`` (wall minutes) for ``cfg.time_limit_factor`` x the job's solo work."""
    if cfg.time_limit_factor <= 0:
        return []
    minutes = math.ceil(job.work_s * cfg.time_limit_factor / cfg.time_scale / 60)
    return [f"--time={max(1, minutes)}"]


def job_script(job: TraceJob, simjob: Path | str = "colloc-simjob") -> str:
    """The batch script: a simulated training job with the job's true profile.

    ``simjob``: the lab's launcher (the cluster's ``lab_bin``); the runtime wheel has no
    ``colloc-simjob`` on PATH.

    A multi-GPU job runs one simjob per allocated GPU (data-parallel ranks, each with
    the job's profile); the job ends when its slowest rank does, and fails if any does.
    """
    argv = [
        str(simjob), "--mem", f"{job.steady_mib}M", "--peak", f"{job.peak_mib}M",
        "--peak-at", f"{job.peak_at}", "--sm-activity", f"{job.sm_pct}",
        "--seconds", f"{job.work_s}",
    ]
    head = (
        "#!/bin/bash\n"
        f"# trace job {job.name}: {job.model} batch {job.batch_size} ({job.source})\n"
        'echo "attempt ${SLURM_RESTART_COUNT:-0} GPU ${CUDA_VISIBLE_DEVICES:-none} '
        'limit ${CUDA_MPS_PINNED_DEVICE_MEM_LIMIT:-none}"\n'
    )
    if job.gpus <= 1:
        return head + f"exec {shlex.join(argv)}\n"
    return head + (
        'IFS=, read -ra devs <<< "${CUDA_VISIBLE_DEVICES:-0}"\n'
        "pids=()\n"
        f'for d in "${{devs[@]:0:{job.gpus}}}"; do\n'
        f'  CUDA_VISIBLE_DEVICES="$d" {shlex.join(argv)} &\n'
        "  pids+=($!)\n"
        "done\n"
        "trap 'kill -TERM \"${pids[@]}\" 2>/dev/null' TERM\n"
        "rc=0\n"
        'for p in "${pids[@]}"; do wait "$p" || rc=$?; done\n'
        "exit $rc\n"
    )


def ensure_user(cluster: Cluster, user: str) -> None:
    """A Unix user (system account, no home) with a Slurm association on ``cluster``."""
    import pwd

    try:
        pwd.getpwnam(user)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/bash",
                        user], check=True, capture_output=True)
    cluster.add_user(user)


def whole_gpu_args(rejected: list[str], whole_mib: int) -> list[str]:
    """A whole GPU for a job job_submit refused as larger than one GPU.

    On a colloc node a whole GPU is all of its shards (``--colloc-mem`` = what jobs can
    have of a GPU, ``whole_mib``), never ``--gres=gpu:1``: Slurm 22.05 does not keep
    gres/gpu and gres/shard jobs off each other's device, and a gpu:1 job was seen
    placed on a GPU that shard jobs were using (it then ran out of memory next to them).
    """
    if any(a.startswith("--colloc") for a in rejected):
        return [f"--colloc-mem={whole_mib}M"]
    return ["--gres=gpu:1"]


def fit_to_gpu(args: list[str], shards_per_gpu: int, shard_mib: int) -> list[str]:
    """Requests above one GPU's shards lowered to all of them (what a user asks next).

    The trace's guesses are capped at the card's nominal memory (40 GiB), but only
    ``shards_per_gpu`` shards of it are for jobs (driver reserve, MPS servers:
    :mod:`slurm_colloc.gpu.budget`); Slurm would refuse ``shard:40`` outright.
    """
    out = []
    for a in args:
        if a.startswith("--gres=shard:") and a.rsplit(":", 1)[1].isdigit():
            a = f"--gres=shard:{min(int(a.rsplit(':', 1)[1]), shards_per_gpu)}"
        elif a.startswith("--colloc-mem=") and a.endswith("M") and a[13:-1].isdigit():
            a = f"--colloc-mem={min(int(a[13:-1]), shards_per_gpu * shard_mib)}M"
        out.append(a)
    return out


class Replayer:
    """Bring clusters up, submit the trace to each policy, wait, collect."""

    def __init__(self, trace: Trace, policies: list[Policy], cfg: ReplayConfig,
                 summaries: dict[str, str]) -> None:
        """Plan the runs; nothing starts until :meth:`run`."""
        self.trace, self.cfg, self.summaries = trace, cfg, summaries
        self.runs = [
            PolicyRun(p, cluster_for(trace, p, i, cfg),
                      Path(f"{cfg.root_base}-{p.name}") / "replay")
            for i, p in enumerate(policies)
        ]
        self.t0 = 0.0
        self.wall_s = 0.0

    # ------------------------------------------------------------------ clusters
    def up(self) -> None:
        """Bring every policy's cluster up (one after the other: 2-core machine)."""
        for r in self.runs:
            r.cluster.down()
            secs = r.cluster.up(timeout=120)
            for d, host in zip(sim_dirs(r.cluster), r.cluster.spec.node_plans(), strict=True):
                init_state(d, gpu_count=host.gpus, memory_mib=host.gpu_memory_mib,
                           time_scale=self.cfg.time_scale)
            r.workdir.mkdir(parents=True, exist_ok=True)
            r.workdir.chmod(0o1777)
            for user in sorted({j.user for j in self.trace.jobs if j.user}):
                ensure_user(r.cluster, user)
            if r.policy.sm_capacity_pct:
                self._write_compute_history(r)
            log.info("%s: cluster up in %.0fs at %s", r.policy.name, secs, r.cluster.layout.root)

    def _write_compute_history(self, r: PolicyRun) -> None:
        from slurm_colloc.accounting import compute_history as ch

        table = warm_compute_history(self.trace, self.summaries, ch.uid_by_name)
        ch.write(r.cluster.layout.colloc_var / "compute-history", table)
        log.info("%s: compute history of %d (user, model) entries", r.policy.name, len(table))

    def down(self) -> None:
        """Stop every cluster (keeps nothing but what was collected)."""
        for r in self.runs:
            r.cluster.down()

    # ------------------------------------------------------------------ one policy
    def _summary_file(self, r: PolicyRun, job: TraceJob) -> Path | None:
        if not job.summary:
            return None
        if job.summary in self.summaries:
            text, stem = self.summaries[job.summary], job.summary
        elif Path(job.summary).is_file():  # a trace file's own summary file
            text, stem = Path(job.summary).read_text(), Path(job.summary).stem
        else:
            return None
        p = r.workdir / "summaries" / f"{stem}.txt"
        if not p.exists():
            p.parent.mkdir(exist_ok=True)
            p.parent.chmod(0o755)
            p.write_text(text)
            p.chmod(0o644)
        return p

    def _sbatch(self, r: PolicyRun, job: TraceJob, args: list[str]) -> tuple[int | None, str]:
        script = r.workdir / f"{job.name}.sbatch"
        script.write_text(job_script(job, r.cluster.layout.lab_bin / "colloc-simjob"))
        out = r.workdir / f"{job.name}.out"
        r.outputs[job.name] = out
        env = r.cluster.env()
        if self.cfg.estimator_command:
            env["COLLOC_ESTIMATOR_COMMAND"] = self.cfg.estimator_command
        script.chmod(0o644)
        limit = time_limit_args(job, self.cfg)
        argv = ["sbatch", "--parsable", f"--job-name={job.name}", f"--output={out}",
                "--open-mode=append", f"--chdir={r.workdir}", *limit, *args, str(script)]
        if job.user:  # the user's own submission: their uid, their MPS server
            argv = ["runuser", "-u", job.user, "--", *argv]
        cp = subprocess.run(argv, env=env, capture_output=True, text=True, check=False,
                            timeout=120)
        if cp.returncode != 0:
            return None, (cp.stderr.strip() or cp.stdout.strip())[:500]
        return int(cp.stdout.strip().split(";")[0]), ""

    def _submit_all(self, r: PolicyRun) -> None:
        shard_mib = r.cluster.spec.shard_mib
        spg = r.cluster.spec.shards_per_gpu
        for job in sorted(self.trace.jobs, key=lambda j: j.arrival_s):
            delay = self.t0 + job.arrival_s / self.cfg.time_scale - time.time()
            if delay > 0:
                time.sleep(delay)
            args = fit_to_gpu(r.policy.args(job, self._summary_file(r, job), shard_mib),
                              spg, shard_mib)
            jid, err = self._sbatch(r, job, args)
            if jid is None and REJECTED_TOO_BIG in err:
                r.fallbacks.append(job.name)  # what a user does next: ask for a whole GPU
                jid, err = self._sbatch(r, job, whole_gpu_args(args, spg * shard_mib))
            if jid is None:
                r.submit_errors[job.name] = err
                log.warning("%s: %s: sbatch failed: %s", r.policy.name, job.name, err)
            else:
                r.jobs[job.name] = jid

    def _states(self, slurm: SlurmCli) -> dict[str, str]:
        # squeue --json lists every job the controller still holds, finished ones too
        try:
            return {str(jid): job.state for jid, job in slurm.jobs().items()}
        except SlurmError:
            return {}  # a slow controller: the caller polls again

    def _wait(self, r: PolicyRun, slurm: SlurmCli) -> None:
        ids = {str(j) for j in r.jobs.values()}
        deadline = time.monotonic() + self.cfg.timeout_s
        stable = 0
        while time.monotonic() < deadline:
            states = self._states(slurm)
            gone = [j for j in ids if j not in states]
            done = all(states.get(j, "COMPLETED") in TERMINAL_STATES for j in ids)
            if done and gone:  # purged from the controller: accounting must agree
                acc = {a.job_id: a.state.split()[0] for a in slurm.accounting(gone)}
                done = all(acc.get(j, "") in TERMINAL_STATES for j in gone)
            stable = stable + 1 if done else 0
            if stable >= 3:  # an epilog requeue turns a finished job PENDING again
                r.finished_wall = time.time()
                return
            time.sleep(self.cfg.poll_s)
        r.error = f"timed out after {self.cfg.timeout_s:.0f}s"

    def _run_policy(self, r: PolicyRun) -> None:
        slurm = SlurmCli(env=r.cluster.env())
        try:
            self._submit_all(r)
            self._wait(r, slurm)
            deadline = time.monotonic() + self.cfg.settle_s
            while (r.policy.node_scripts and not records_settled(slurm, r.jobs)
                   and time.monotonic() < deadline):
                time.sleep(2)
            r.outcomes = collect(slurm, r.jobs, r.outputs)
        except (SlurmError, OSError, subprocess.SubprocessError) as e:
            r.error = f"{type(e).__name__}: {e}"
            log.error("%s: replay failed: %s", r.policy.name, r.error)

    # ------------------------------------------------------------------ all
    def run(self) -> None:
        """Replay the trace on every policy at once; blocks until all finished."""
        for r in self.runs:
            r.sampler = GpuSampler(sim_dirs(r.cluster), period=1.0)
        # start a little ahead so every thread is ready for the first arrival
        self.t0 = float(math.floor(time.time()) + 2)  # sacct has whole seconds
        for r in self.runs:
            assert r.sampler is not None
            r.sampler.start()
        threads = [threading.Thread(target=self._run_policy, args=(r,), name=r.policy.name)
                   for r in self.runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in self.runs:
            assert r.sampler is not None
            r.sampler.stop()
        self.wall_s = time.time() - self.t0


def trace_hours(wall_s: float, scale: float) -> float:
    """Wall seconds of the compressed replay as hours of the real trace."""
    return wall_s * scale / 3600.0 if math.isfinite(wall_s) else math.nan
