"""The node collector: one process per node samples every GPU and files it per job.

Per interval (``sample_interval_s``, 1 s) it reads all GPUs through the GPU backend,
attributes each GPU process to its Slurm job (:mod:`.attribution`), and appends to
each running attempt's series (:mod:`.store`): the job's own memory, the GPU's
utilisation, SM activity/occupancy and DRAM activity where measured (DCGM, or the
sim backend), power, the energy attributed to the job and the other jobs on the GPU.

Energy attribution: NVML has no per-process energy, so each GPU's energy between two
samples is split over its jobs in proportion to their memory (documented in
docs/report.md as an approximation).

Enforcement (:mod:`.enforce`): each GPU's attributed processes are also checked
against their job's allocation and MPS membership; a job over its limit (or outside
MPS) is killed or flagged per configuration and a root-only verdict is recorded. It
reuses the sample and the attribution already made: no extra GPU or /proc reads.

Prometheus (:mod:`.prometheus_export`): with ``prometheus_textfile`` set, each step
ends by writing every open attempt's latest row, labelled and sized from root's meta,
as node_exporter's textfile; an attempt closed (not seen for ``GONE_AFTER_S``) leaves it.

Life cycle: the prolog starts it when it is not running
(:mod:`slurm_colloc.node.metrics_launch`). What it starts is a supervisor
(:mod:`.supervisor`) that holds an exclusive ``flock`` in root's private
``metrics_dir/collector/`` (:mod:`.liveness`: no user can open, hence hold, it), so a
second copy exits at once, and runs this module's sampling loop as a worker, restarted
when it dies or stalls; a worker whose supervisor is killed starts a new one
(:mod:`.spawn`). No exception of a step ends the loop (see :meth:`Collector.step`).
It exits by itself after ``collector_idle_exit_s`` without GPU jobs (and none in root's
MPS bookkeeping, no record in root's spool, no epilog owed: :func:`work_left`), except
with ``--stay``: under the systemd unit (``collector_unit``,
:mod:`slurm_colloc.node.collector_start`) it stays up and systemd restarts it if it
dies. It prunes job directories older than ``metrics_retention_days`` once
an hour.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType

from slurm_colloc import procfs
from slurm_colloc.config import CollocConfig
from slurm_colloc.detach import spawn_module
from slurm_colloc.gpu.backend import GpuBackend, GpuBackendError, GpuSample
from slurm_colloc.metrics import enforce, liveness, spawn, store
from slurm_colloc.metrics.attribution import Attributor, JobTag, start_ticks
from slurm_colloc.metrics.guard import Failures
from slurm_colloc.mps import missed_epilogs, release_confirm
from slurm_colloc.mps.control import STATE_FILE, DaemonIdentity
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.mps.v3 import V3_DIR

ORPHANED = 3
""":func:`serve`'s status when its supervisor died and the worker hands over (issue 28)."""
GONE_AFTER_S = 5.0
"""A job not seen on any GPU for this long has its pending rows flushed, file closed."""
PRUNE_EVERY_S = 3600.0
SLUID_RESCAN_S = 5.0
"""An unknown SLUID (26.05 job cgroup) rereads the changed metas at most this often: a
job with no meta here (no GPU given by Slurm) must not make every step rescan."""
OWNER_TTL_S = 60.0
"""A job's owner read from its meta is re-read after this long (never cached unknown)."""

log = logging.getLogger("colloc.metrics.collector")

Key = tuple[str, int]  # (job id, attempt)


@dataclass
class _Open:
    writer: store.SeriesWriter
    pending: dict[int, store.Row] = field(default_factory=dict)
    last_seen: float = 0.0


class Collector:
    """Samples GPUs and keeps per-job series; :meth:`step` is one interval's work."""

    def __init__(
        self, cfg: CollocConfig, backend: GpuBackend, attributor: Attributor | None = None,
        clock: Callable[[], float] = time.time, enforcer: enforce.Enforcer | None = None,
    ) -> None:
        """Nothing is read until the first :meth:`step`."""
        self.cfg = cfg
        self.metrics_dir = cfg.metrics_dir
        self.backend = backend
        self.clock = clock
        self._sluids = store.SluidIndex(cfg.metrics_dir)
        self._sluid_scan_at: float | None = None
        self.attributor = attributor or Attributor(
            uid_of_job=self._uid_of_job, job_of_sluid=self._job_of_sluid)
        self.open: dict[Key, _Open] = {}
        self.latest: dict[Key, dict[int, store.Row]] = {}
        """Each open attempt's last raw row per GPU (the Prometheus export's input)."""
        self._export = _exporter(cfg, backend, clock)
        self._energy: dict[int, tuple[float, float | None]] = {}
        self._uids: dict[str, tuple[int, float]] = {}  # job -> (owner, when read)
        self._unattributed: set[int] = set()
        self._servers_seen: set[tuple[int, int]] = set()  # (pid, ticks) logged as servers
        self._tenancy_cache: dict[tuple[int, int], list[int]] = {}
        self.last_job_seen = clock()
        self.staying_for: str | None = None
        """Why it last stayed past ``collector_idle_exit_s`` (:func:`work_left`), logged once."""
        self.enforcer = enforcer or enforce.Enforcer(cfg, clock=clock)
        self.failures = Failures(log)
        self._slurm_of: dict[int, int] | None = None

    def _slurm_index(self, backend_index: int) -> int:
        """Slurm's index of the backend's GPU ``backend_index``.

        Samples come by NVML index; everything colloc keeps per GPU (MPS tenancy,
        allocations, series rows) is by Slurm's index, which follows the device files'
        minor numbers and need not be NVML's order. The map is built once: GPUs do not
        change under a running collector. If it cannot be built the indices are taken
        as equal (and it says so once), which is right wherever minors follow PCI order.
        """
        if self._slurm_of is None:
            from slurm_colloc.gpu.identity import GpuIdentityError, GpuMap

            try:
                gmap = GpuMap.from_backend(self.backend)
                self._slurm_of = {g.index: i for i, g in enumerate(gmap.gpus)}
            except (GpuIdentityError, GpuBackendError) as e:
                log.warning("GPU order unknown (%s): taking NVML indices as Slurm's", e)
                self._slurm_of = {}
            except Exception as e:  # noqa: BLE001 - or every GPU would fail every step
                self.failures.failed("GPU order", e)
                self._slurm_of = {}
        return self._slurm_of.get(backend_index, backend_index)

    def _uid_of_job(self, job: str) -> int | None:
        """The job's owner as the prolog recorded it (root's meta), None when unknown.

        Only known owners are cached, and only for :data:`OWNER_TTL_S`: an id with no
        meta yet may be a job that has not started here. A user who claims another
        user's next job ids (``SLURM_JOB_ID=<future id>``) before they exist once
        made root remember "no owner" for good; the owner's own processes then failed
        the check and were all charged to its newest job, which root killed (issue 23).
        """
        now = self.clock()
        hit = self._uids.get(job)
        if hit is not None and 0 <= now - hit[1] < OWNER_TTL_S:
            return hit[0]
        uid = None
        for a in reversed(store.attempts_on_node(self.metrics_dir, job)):
            meta = store.read_meta(self.metrics_dir, job, a)
            if meta is not None:
                uid = meta.uid
                break
        if uid is None:
            self._uids.pop(job, None)
            return None
        if len(self._uids) > 4096:
            self._uids.clear()
        self._uids[job] = (uid, now)
        return uid

    def _job_of_sluid(self, sluid: str) -> str | None:
        """The job the prolog recorded with this SLUID (root's metas; rescans on a miss)."""
        job = self._sluids.job_of(sluid)
        now = self.clock()
        last = self._sluid_scan_at
        if job is None and (last is None or not 0 <= now - last < SLUID_RESCAN_S):
            self._sluid_scan_at = now
            self._sluids.refresh()
            job = self._sluids.job_of(sluid)
        return job

    def _mps_jobs(self, gpu: int, uid: int) -> list[int]:
        """uid's MPS jobs on ``gpu`` from root's bookkeeping (cached for one step)."""
        key = (gpu, uid)
        if key not in self._tenancy_cache:
            self._tenancy_cache[key] = Tenancy(Path(self.cfg.mps_root)).jobs_of(gpu, uid)
        return self._tenancy_cache[key]

    def _held_to_mps_job(self, ident: tuple[int, JobTag], gpu: int) -> tuple[int, JobTag]:
        """A process of a user with MPS jobs on this GPU counts against one of them.

        Its own claim (environment, or a job of the same user elsewhere or long
        finished, with no limit or a larger one) must not take it out of its
        allocation: only a job root registered on this GPU for that user is accepted.
        """
        ticks, tag = ident
        if tag.uid == 0:
            return ident
        mine = self._mps_jobs(gpu, tag.uid)
        if not mine or (tag.job_id.isdigit() and int(tag.job_id) in mine):
            return ident
        job = str(max(mine))
        attempts = store.attempts_on_node(self.metrics_dir, job)
        return ticks, JobTag(job, attempts[-1] if attempts else 0, "tenancy", tag.uid)

    def _daemons_for(self, gpu: int, owner: int) -> list[DaemonIdentity]:
        """The control daemons whose children may be MPS servers on ``gpu`` for ``owner``.

        Root's own records only (``daemon.json``, root 0600, learnt while the pipe
        directory was root's): the legacy daemon of (GPU, owner), and the node's v3
        daemon (its servers run as root, one per GPU).
        """
        root = Path(self.cfg.mps_root)
        paths = [root / V3_DIR / "state" / STATE_FILE]
        if owner != 0:
            paths.insert(0, Tenancy(root).daemon_state(gpu, owner))
        return [d for d in map(DaemonIdentity.load, paths) if d is not None]

    def _mps_server(self, pid: int, gpu: int) -> bool:
        """``pid`` is an MPS server that root's verified control daemon runs.

        On hardware the legacy server runs as its user outside every job's cgroup, and
        NVML lists it as a compute process but not as an MPS client: taken for one of
        the user's processes it was charged to the user's newest job as "outside MPS"
        (an ``outside_mps`` verdict on every shard job, and ``enforce_outside_mps=kill``
        killed the server; issue 23). A server is recognised only as a child of the
        daemon root started and recorded (pid, start time, owner, program and pipe
        directory checked in /proc), started after it, owned by the daemon's user
        (root for v3), and running the daemon's program or ``nvidia-cuda-mps-server``
        beside it. A user cannot make a process of theirs a child of root's daemon, so
        nothing here is the user's to claim. It is charged to no job and never
        counts as outside MPS; it is logged once.
        """
        try:
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return False
        ticks = start_ticks(pid)
        ppid = procfs.parent(pid)
        if ticks is None or ppid is None:
            return False
        for daemon in self._daemons_for(gpu, owner):
            if daemon.pid != ppid or ticks < daemon.start_ticks or not daemon.matches():
                continue
            if not _same_program(pid, daemon.pid):
                continue
            if start_ticks(pid) != ticks or procfs.parent(pid) != ppid:
                return False  # gone or replaced while we looked
            if (pid, ticks) not in self._servers_seen:
                if len(self._servers_seen) > 4096:
                    self._servers_seen.clear()
                self._servers_seen.add((pid, ticks))
                log.info("GPU %d: process %d of uid %d is the MPS server of daemon %d: "
                         "charged to no job", gpu, pid, owner, daemon.pid)
            return True
        return False

    def _by_tenancy(self, pid: int, gpu: int) -> tuple[int, JobTag] | None:
        """A GPU process no job claims (or that claims a job it does not own).

        Without proctrack/cgroup the job comes from the process's own environment,
        which its owner controls: ``SLURM_JOB_ID=<another job>`` would hide its memory
        from enforcement. Root's MPS bookkeeping (:mod:`slurm_colloc.mps.tenancy`)
        says which jobs its owner has on this GPU; the memory is charged to the
        newest of them, so mislabelling never escapes the owner's allocation.
        """
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return None
        if uid == 0:
            return None
        jobs = self._mps_jobs(gpu, uid)
        ticks = start_ticks(pid)
        if not jobs or ticks is None:
            if pid not in self._unattributed:
                self._unattributed.add(pid)
                log.warning("GPU %d: process %d of uid %d belongs to no GPU job on this node "
                            "(a job using a GPU Slurm did not give it?)", gpu, pid, uid)
            return None
        job = str(max(jobs))
        attempts = store.attempts_on_node(self.metrics_dir, job)
        return ticks, JobTag(job, attempts[-1] if attempts else 0, "tenancy", uid)

    def _energy_delta(self, s: GpuSample) -> float:
        prev = self._energy.get(s.index)
        self._energy[s.index] = (s.timestamp, s.energy_j)
        if prev is None:
            return 0.0
        t0, e0 = prev
        if s.energy_j is not None and e0 is not None:
            return max(0.0, s.energy_j - e0)
        if s.power_w is not None:
            return max(0.0, s.power_w * (s.timestamp - t0))
        return 0.0

    def step(self) -> dict[Key, int]:
        """Sample once; returns the memory (MiB) seen per (job, attempt).

        Only the backend's own failure (:class:`GpuBackendError`, no sample at all)
        leaves here. Everything after it is isolated: an exception for one process
        skips that process, one for a GPU that GPU, one for a job's series that
        series; each is logged (rate limited, :class:`~.guard.Failures`) and the rest
        of the sample, enforcement included, goes on. A process's environment and
        files are its owner's: no value there may end the loop for the node.
        """
        now = self.clock()
        seen: dict[Key, int] = {}
        pids: set[int] = set()
        enforcing = self.enforcer.active
        self._tenancy_cache.clear()
        if enforcing:
            self._guarded("enforcement (start of step)", self.enforcer.begin_step)
        for s in self.backend.sample_all():
            try:
                self._step_gpu(s, now, enforcing, seen, pids)
            except Exception as e:  # noqa: BLE001 - one GPU's failure is that GPU's
                self.failures.failed(f"GPU {s.index}", e)
        self._guarded("attribution cache", lambda: self.attributor.forget_missing(pids))
        self._unattributed &= pids
        if enforcing:
            self._guarded("enforcement (end of step)", self.enforcer.end_step)
        if seen:
            self.last_job_seen = now
        for k in [k for k, o in self.open.items() if now - o.last_seen > GONE_AFTER_S]:
            self._guarded("closing a series", lambda k=k: self.close_job(k))  # type: ignore[misc]
        self._guarded("Prometheus textfile", lambda: self._export(self.latest))
        return seen

    def _guarded(self, where: str, fn: Callable[[], object]) -> None:
        """Run ``fn``; a failure is logged (rate limited), never raised."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the loop must go on
            self.failures.failed(where, e)

    def _identify(self, pid: int, gpu: int) -> tuple[int, JobTag] | None:
        """The process's (start ticks, job) as the collector charges it, or None.

        An MPS server of root's daemon is charged to nothing (:meth:`_mps_server`),
        asked first: its cgroup or environment must not make it a job's process."""
        if self._mps_server(pid, gpu):
            return None
        ident = self.attributor.identity(pid) or self._by_tenancy(pid, gpu)
        return None if ident is None else self._held_to_mps_job(ident, gpu)

    def _step_gpu(self, s: GpuSample, now: float, enforcing: bool,
                  seen: dict[Key, int], pids: set[int]) -> None:
        """One GPU's part of :meth:`step` (its processes isolated one by one)."""
        denergy = self._energy_delta(s)
        gpu = self._slurm_index(s.index)
        per_job: dict[Key, int] = {}
        entries: list[enforce.Entry] = []
        for p in s.processes:
            pids.add(p.pid)
            try:
                ident = self._identify(p.pid, gpu)
            except Exception as e:  # noqa: BLE001 - one process never stops the sample
                self.failures.failed(f"GPU {gpu}: attributing a process", e)
                continue
            if ident is None:
                continue
            tag = ident[1]
            entries.append((p, ident[0], tag))
            k = (tag.job_id, tag.attempt)
            per_job[k] = per_job.get(k, 0) + p.used_mib
        if enforcing and entries:
            try:
                self.enforcer.observe(gpu, entries)
            except Exception as e:  # noqa: BLE001 - the verdict store; metrics go on
                self.failures.failed(f"enforcement on GPU {gpu}", e)
        total = sum(per_job.values())
        for k, mem in per_job.items():
            seen[k] = seen.get(k, 0) + mem
            share = mem / total if total else 1.0 / len(per_job)
            tenants = tuple(sorted({j for j, _ in per_job if j != k[0]}, key=store._job_key))
            row = store.Row(
                t=now, gpu=gpu, mem_mib=float(mem), mem_max_mib=mem,
                gpu_mem_mib=s.memory_used_mib, util_pct=s.utilization_pct,
                sm_pct=s.sm_activity_pct, occ_pct=s.sm_occupancy_pct,
                dram_pct=s.dram_activity_pct, power_w=s.power_w,
                energy_j=denergy * share, tenants=tenants,
            )
            try:
                self._add(k, row, now)
            except Exception as e:  # noqa: BLE001 - one job's series is that job's
                self.failures.failed(f"GPU {gpu}: writing a job's series", e)

    def _add(self, k: Key, row: store.Row, now: float) -> None:
        o = self.open.get(k)
        if o is None:
            path = store.series_path(self.metrics_dir, k[0], k[1])
            o = self.open[k] = _Open(store.SeriesWriter(path, self.cfg.metrics_max_rows))
        o.last_seen = now
        self.latest.setdefault(k, {})[row.gpu] = row
        prev = o.pending.get(row.gpu)
        merged = row if prev is None else replace(store.merge_rows(prev, row), t=prev.t)
        if merged.n >= o.writer.stride:
            o.writer.append(merged)
            o.pending.pop(row.gpu, None)
        else:
            o.pending[row.gpu] = merged

    def close_job(self, k: Key) -> None:
        """Flush an attempt's pending rows and close its file."""
        self.latest.pop(k, None)
        o = self.open.pop(k, None)
        if o is None:
            return
        for row in o.pending.values():
            with contextlib.suppress(OSError):
                o.writer.append(row)
        o.writer.close()

    def close(self) -> None:
        """Flush and close everything."""
        for k in list(self.open):
            self.close_job(k)
        self._guarded("Prometheus textfile", lambda: self._export(self.latest))  # jobs gone


def _exporter(cfg: CollocConfig, backend: GpuBackend, clock: Callable[[], float],
              ) -> Callable[[Mapping[Key, Mapping[int, store.Row]]], None]:
    """What writes ``prometheus_textfile`` after each sample (nothing when it is empty;
    :mod:`.prometheus_export`)."""
    if not cfg.prometheus_textfile:
        return lambda latest: None
    from slurm_colloc.metrics.prometheus_export import TextfileExporter

    return TextfileExporter(cfg, backend, clock=clock).write


SERVER_PROGRAM = "nvidia-cuda-mps-server"
"""The MPS server's executable, installed beside ``nvidia-cuda-mps-control``."""


def _exe(pid: int) -> str | None:
    """The real path of the process's executable (a link /proc resolves; no file read)."""
    try:
        return os.path.realpath(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return None


def _same_program(pid: int, daemon_pid: int) -> bool:
    """``pid`` runs the MPS server program of the daemon ``daemon_pid``.

    ``nvidia-cuda-mps-server`` beside the daemon's executable (the hardware's layout),
    or the daemon's own executable (a forked child before its exec; the simulation's
    servers, which run the daemon's interpreter).
    """
    exe, daemon_exe = _exe(pid), _exe(daemon_pid)
    if exe is None or daemon_exe is None:
        return False
    return exe in (daemon_exe, os.path.join(os.path.dirname(daemon_exe), SERVER_PROGRAM))


# ------------------------------------------------------------------ process ---


def acquire_lock(metrics_dir: str, tries: int = 5) -> int | None:
    """Take the collector lock; None when another collector holds it.

    The lock lives in root's private directory (:mod:`.liveness`): no user can open
    it, so no user can hold it and keep collectors out.
    """
    return liveness.acquire_lock(metrics_dir, tries)


def _jobs_registered(cfg: CollocConfig) -> bool:
    """Any shared-GPU job registered on this node (root's MPS bookkeeping)?

    The idle exit waits for none: a job that does not touch its GPU for
    ``collector_idle_exit_s`` and then goes over its limit must still meet a collector.
    """
    try:
        return bool(Tenancy(Path(cfg.mps_root)).all_jobs())
    except (OSError, ValueError):
        return True  # unknown: stay


def work_left(cfg: CollocConfig, now: float | None = None) -> str | None:
    """Why the collector must stay though no GPU job is seen (None: nothing to do).

    Issue 28: with slurmdbd away longer than ``collector_idle_exit_s`` and no new job
    on the node, an idled-out collector left 3 records in root's spool after slurmdbd
    came back: nothing replayed them. So it stays while the spool holds a record
    (:func:`slurm_colloc.accounting.spool.holds_work`: bounded by the entries' age)
    or a saved job context says an epilog is owed and not given up
    (:func:`slurm_colloc.mps.missed_epilogs.owed`). Only root's files are read.
    """
    from slurm_colloc.accounting import spool

    t = time.time() if now is None else now
    if _jobs_registered(cfg):
        return "jobs registered"
    try:
        if spool.holds_work(spool.spool_dir_of(cfg.evidence_dir), t):
            return "records in root's spool"
        if missed_epilogs.owed(cfg.mps_root, missed_epilogs.state_dir(cfg.evidence_dir), t):
            return "an epilog owed"
        if release_confirm.pending(release_confirm.state_dir(cfg.evidence_dir), t):
            return "a requeue's release to confirm"
    except OSError:
        return "root's state unreadable"
    return None


def _idle(cfg: CollocConfig, c: Collector) -> bool:
    """No GPU job seen for ``collector_idle_exit_s`` and no work left: time to go."""
    if c.open or c.clock() - c.last_job_seen <= cfg.collector_idle_exit_s:
        return False
    why = work_left(cfg)
    if why is not None and why != c.staying_for:
        log.info("no GPU jobs for %.0fs, staying: %s", cfg.collector_idle_exit_s, why)
    c.staying_for = why
    return why is None


def serve(cfg: CollocConfig, backend: GpuBackend, *, max_seconds: float | None = None,
          heartbeat: liveness.Heartbeat | None = None,
          parent: int | None = None, stay: bool = False) -> int:
    """The collector's main loop (returns when idle, on SIGTERM, or after max_seconds).

    ``stay``: never idle out (run by systemd, which keeps it up: ``--stay``).

    No exception of a step ends it: a failing sample is logged (rate limited) and the
    next one is taken. ``heartbeat`` is touched after each completed sample (the
    supervisor restarts a worker whose heartbeat stops); ``parent``: the supervisor's
    pid, whose death ends the loop (its lock is gone): :data:`ORPHANED` then asks the
    caller to start a new supervisor (:mod:`.spawn`), 0 is every other end.
    """
    stop = False

    def _stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    c = Collector(cfg, backend)
    started = time.monotonic()
    status = 0
    due: dict[str, float] = {}
    interval = cfg.sample_interval_s
    tick = time.monotonic()
    try:
        while not stop:
            what = _parent_check(parent, stop, max_seconds, started)
            if what != "run":
                status = ORPHANED if what == "respawn" else 0
                break
            try:
                c.step()
            except GpuBackendError as e:
                c.failures.failed("GPU backend", e)
            except Exception as e:  # noqa: BLE001 - no step may end enforcement
                c.failures.failed("collector step", e)
            else:
                if heartbeat is not None:
                    c._guarded("heartbeat", heartbeat.beat)
            _chores(cfg, c, due)
            if not stay and _idle(cfg, c):
                log.info("no GPU jobs for %.0fs, exiting", cfg.collector_idle_exit_s)
                break
            if max_seconds is not None and time.monotonic() - started >= max_seconds:
                break
            tick += interval
            delay = tick - time.monotonic()
            if delay < 0:  # fell behind (suspended?): resynchronise, don't burst
                tick = time.monotonic()
                delay = 0
            time.sleep(delay)
    finally:
        c.close()
    return status


def _parent_check(parent: int | None, stopping: bool, max_seconds: float | None,
                  started: float) -> str:
    """Before each step: is the supervisor still there? (:func:`.spawn.respawn_decision`)"""
    left = None if max_seconds is None else max_seconds - (time.monotonic() - started)
    what = spawn.respawn_decision(parent=parent, ppid=os.getppid(), stopping=stopping,
                                  env=os.environ, seconds_left=left)
    if what != "run":
        log.warning("supervisor %s gone (%s)", parent,
                    "starting a new one" if what == "respawn" else "exiting")
    return what


def _chores(cfg: CollocConfig, c: Collector, due: dict[str, float]) -> None:
    """What the loop does now and then: prune old series (hourly) and, issue 28, start
    the node's record writer while root's spool holds records accounting has not
    confirmed (every :data:`slurm_colloc.accounting.spool.REPLAY_EVERY_S`), so a
    record reaches accounting soon after slurmdbd is back even if no job ends."""
    from slurm_colloc import slurmd_watch
    from slurm_colloc.accounting import spool

    now = time.monotonic()
    if now >= due.get("prune", 0.0):
        due["prune"] = now + PRUNE_EVERY_S
        c._guarded("pruning old series", lambda: _prune(cfg, c))
    if now >= due.get("replay", 0.0):
        due["replay"] = now + spool.REPLAY_EVERY_S
        c._guarded("record replay",
                   lambda: spool.kick(spool.spool_dir_of(cfg.evidence_dir), dict(os.environ)))
    if now >= due.get("late-epilog", 0.0):
        due["late-epilog"] = now + missed_epilogs.LOOK_EVERY_S
        c._guarded("late epilog", lambda: _late_epilogs(cfg))
    if now >= due.get("release-confirm", 0.0):  # issue 28: files only; Slurm when due
        due["release-confirm"] = now + release_confirm.LOOK_EVERY_S
        c._guarded("release confirmation", lambda: release_confirm.kick(
            release_confirm.state_dir(cfg.evidence_dir), dict(os.environ), time.time()))
    if now >= due.get("stuck-prologs", 0.0):  # issue 28: a /proc read; Slurm only after
        due["stuck-prologs"] = now + slurmd_watch.LOOK_EVERY_S  # a slurmd restart
        c._guarded("stuck prologs", lambda: slurmd_watch.kick(cfg, dict(os.environ)))


def _late_epilogs(cfg: CollocConfig) -> None:
    """Issue 28: start the late epilog (detached, root) when root's state holds saved
    job contexts no epilog consumed that are due a look (no Slurm question here)."""
    if missed_epilogs.due(cfg.mps_root, missed_epilogs.state_dir(cfg.evidence_dir),
                          time.time()):
        spawn_module(missed_epilogs.LATE_EPILOG_MODULE, (), dict(os.environ))


def _prune(cfg: CollocConfig, c: Collector) -> None:
    open_jobs = {k[0] for k in c.open}
    removed = store.prune(cfg.metrics_dir, cfg.metrics_retention_days, keep=open_jobs)
    if removed:
        log.info("pruned %d old job series", len(removed))
    with contextlib.suppress(OSError):
        enforce.prune_verdicts(cfg.metrics_dir, cfg.metrics_retention_days)


LOG_FORMAT = "%(asctime)s colloc: collector: %(message)s"


def _logging(cfg: CollocConfig, worker: bool) -> None:
    """To stderr and root's log file, one line per record (:mod:`slurm_colloc.log_escape`).

    A worker logs to stderr only: its supervisor points that at the log file (which
    also catches a hard crash's traceback); a file handler as well doubled every line.
    """
    from slurm_colloc.log_escape import EscapingFormatter

    fmt = EscapingFormatter(LOG_FORMAT)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(fmt)
    root.addHandler(err)
    if cfg.log_file and not worker:
        from slurm_colloc.log_handlers import file_handler, syslog_handler

        try:
            root.addHandler(file_handler(cfg.log_file, fmt))
        except OSError as e:
            log.warning("log file %s: %s", cfg.log_file, e)
        # under systemd stderr is the journal already: syslog would say it twice
        sl = None if os.environ.get("JOURNAL_STREAM") else syslog_handler()
        if sl is not None:
            root.addHandler(sl)


def _worker(cfg: CollocConfig, seconds: float | None, parent: int | None,
            stay: bool = False, conf: str | None = None) -> int:
    """Sample until idle; an exception that still escapes is logged and reported.

    Orphaned (its supervisor killed), it starts a new supervisor once its GPU backend
    and files are closed, then exits (:mod:`.spawn`, issue 28)."""
    from slurm_colloc.gpu.select import backend_from_config
    from slurm_colloc.metrics.supervisor import write_crash

    with contextlib.suppress(OSError):
        os.nice(5)
    began = time.monotonic()
    try:
        heartbeat = liveness.Heartbeat(cfg.metrics_dir)
        backend = backend_from_config(cfg)
        try:
            log.info("worker started (pid %d, backend %s, every %.1fs; over limit: %s, "
                     "outside MPS: %s)", os.getpid(), backend.name, cfg.sample_interval_s,
                     cfg.enforce_over_limit, cfg.enforce_outside_mps)
            rc = serve(cfg, backend, max_seconds=seconds, heartbeat=heartbeat,
                       parent=parent, stay=stay)
        finally:
            backend.close()
            heartbeat.close()
    except Exception as e:
        log.exception("collector worker failed")
        write_crash(cfg.metrics_dir, f"{type(e).__name__}: {e}")
        return 1
    if rc == ORPHANED and parent is not None:
        left = None if seconds is None else seconds - (time.monotonic() - began)
        spawn.hand_over(cfg.metrics_dir, parent,
                        spawn.supervisor_args(conf=conf, stay=stay, seconds_left=left))
        return 0
    return rc


def _lock(metrics_dir: str, stay: bool, poll_s: float = 1.0) -> int | None:
    """The collector lock; with ``stay`` wait for it (a collector a prolog started
    before the unit ran holds it until it idles out, then the unit's takes over)."""
    fd = acquire_lock(metrics_dir)
    if fd is None and stay:
        log.info("another collector holds the lock; waiting for it to end")
        while fd is None:
            time.sleep(poll_s)
            fd = acquire_lock(metrics_dir, tries=1)
    return fd


def main(argv: list[str] | None = None) -> int:
    """``python -m slurm_colloc.metrics.collector [--conf FILE] [--seconds N]``.

    Without flags: the supervisor (takes the lock, runs and restarts the worker:
    :mod:`.supervisor`). ``--worker`` is the sampling loop it runs;
    ``--no-supervisor`` runs that loop under the lock in this process (benchmarks).
    """
    from slurm_colloc import config as cfgmod
    from slurm_colloc.metrics.supervisor import Supervisor

    p = argparse.ArgumentParser(prog="colloc-collector", description=__doc__.split("\n\n")[0])
    p.add_argument("--conf", help="colloc.conf (default $COLLOC_CONF or /etc/slurm/colloc.conf)")
    p.add_argument("--seconds", type=float, help="stop after this long (benchmarks, tests)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--supervisor", type=int, help=argparse.SUPPRESS)
    p.add_argument("--no-supervisor", action="store_true",
                   help="sample in this process, no restarts (benchmarks)")
    p.add_argument("--stay", action="store_true",
                   help="no idle exit, and wait for a running collector to end instead of "
                        "exiting (the systemd unit's mode: colloc admin collector-unit)")
    a = p.parse_args(argv)
    cfg = cfgmod.load(a.conf)
    _logging(cfg, worker=a.worker)
    if a.worker:
        return _worker(cfg, a.seconds, a.supervisor, a.stay, a.conf)
    try:
        fd = _lock(cfg.metrics_dir, a.stay)
    except OSError as e:
        log.error("cannot take the collector lock (%s): not starting", e)
        return 1
    if fd is None:
        return 0  # another collector is running
    try:
        if a.no_supervisor:
            return _worker(cfg, a.seconds, None, a.stay)
        args = ["--worker", "--supervisor", str(os.getpid())] + (["--stay"] if a.stay else [])
        args += ["--conf", a.conf] if a.conf else []
        args += ["--seconds", str(a.seconds)] if a.seconds is not None else []
        sup = Supervisor(cfg.metrics_dir, [sys.executable, "-I", "-m", __spec__.name
                                           if __spec__ else "slurm_colloc.metrics.collector",
                                           *args],
                         stall_s=max(60.0, 30 * cfg.sample_interval_s),
                         log_file=cfg.log_file or None)
        signal.signal(signal.SIGTERM, sup.stop)
        signal.signal(signal.SIGINT, sup.stop)
        log.info("supervisor started (pid %d)", os.getpid())
        return sup.run()
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
