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

Life cycle: the prolog starts it when it is not running (:mod:`.launch`); it holds an
exclusive ``flock`` on ``metrics_dir/collector.pid`` while alive, so a second copy
exits at once; it exits by itself after ``collector_idle_exit_s`` without GPU jobs;
it prunes job directories older than ``metrics_retention_days`` once an hour.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuBackend, GpuBackendError, GpuSample
from slurm_colloc.metrics import enforce, store
from slurm_colloc.metrics.attribution import Attributor, JobTag, start_ticks
from slurm_colloc.mps.tenancy import Tenancy

PID_FILE = store.PID_FILE
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
        self._energy: dict[int, tuple[float, float | None]] = {}
        self._uids: dict[str, tuple[int, float]] = {}  # job -> (owner, when read)
        self._unattributed: set[int] = set()
        self._tenancy_cache: dict[tuple[int, int], list[int]] = {}
        self.last_job_seen = clock()
        self.enforcer = enforcer or enforce.Enforcer(cfg, clock=clock)
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
        """Sample once; returns the memory (MiB) seen per (job, attempt)."""
        now = self.clock()
        seen: dict[Key, int] = {}
        pids: set[int] = set()
        enforcing = self.enforcer.active
        self._tenancy_cache.clear()
        if enforcing:
            self.enforcer.begin_step()
        for s in self.backend.sample_all():
            denergy = self._energy_delta(s)
            gpu = self._slurm_index(s.index)
            per_job: dict[Key, int] = {}
            entries: list[enforce.Entry] = []
            for p in s.processes:
                pids.add(p.pid)
                ident = self.attributor.identity(p.pid) or self._by_tenancy(p.pid, gpu)
                if ident is None:
                    continue
                ident = self._held_to_mps_job(ident, gpu)
                tag = ident[1]
                entries.append((p, ident[0], tag))
                k = (tag.job_id, tag.attempt)
                per_job[k] = per_job.get(k, 0) + p.used_mib
            if enforcing and entries:
                try:
                    self.enforcer.observe(gpu, entries)
                except OSError as e:  # the verdict store; metrics go on regardless
                    log.warning("enforcement on GPU %d: %s", gpu, e)
            total = sum(per_job.values())
            for k, mem in per_job.items():
                share = mem / total if total else 1.0 / len(per_job)
                tenants = tuple(sorted({j for j, _ in per_job if j != k[0]}, key=store._job_key))
                row = store.Row(
                    t=now, gpu=gpu, mem_mib=float(mem), mem_max_mib=mem,
                    gpu_mem_mib=s.memory_used_mib, util_pct=s.utilization_pct,
                    sm_pct=s.sm_activity_pct, occ_pct=s.sm_occupancy_pct,
                    dram_pct=s.dram_activity_pct, power_w=s.power_w,
                    energy_j=denergy * share, tenants=tenants,
                )
                self._add(k, row, now)
                seen[k] = seen.get(k, 0) + mem
        self.attributor.forget_missing(pids)
        self._unattributed &= pids
        if enforcing:
            self.enforcer.end_step()
        if seen:
            self.last_job_seen = now
        for k in [k for k, o in self.open.items() if now - o.last_seen > GONE_AFTER_S]:
            self.close_job(k)
        return seen

    def _add(self, k: Key, row: store.Row, now: float) -> None:
        o = self.open.get(k)
        if o is None:
            path = store.series_path(self.metrics_dir, k[0], k[1])
            o = self.open[k] = _Open(store.SeriesWriter(path, self.cfg.metrics_max_rows))
        o.last_seen = now
        prev = o.pending.get(row.gpu)
        merged = row if prev is None else replace(store.merge_rows(prev, row), t=prev.t)
        if merged.n >= o.writer.stride:
            o.writer.append(merged)
            o.pending.pop(row.gpu, None)
        else:
            o.pending[row.gpu] = merged

    def close_job(self, k: Key) -> None:
        """Flush an attempt's pending rows and close its file."""
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


# ------------------------------------------------------------------ process ---


def acquire_lock(metrics_dir: str, tries: int = 5) -> int | None:
    """Take the collector lock; None when another collector holds it."""
    d = store.ensure_dir(Path(metrics_dir))
    fd = os.open(d / PID_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            time.sleep(0.05 * (i + 1))  # a prolog may be probing the lock right now
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd
    os.close(fd)
    return None


def serve(cfg: CollocConfig, backend: GpuBackend, *, max_seconds: float | None = None) -> int:
    """The collector's main loop (returns when idle, on SIGTERM, or after max_seconds)."""
    stop = False

    def _stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    c = Collector(cfg, backend)
    started = time.monotonic()
    next_prune = 0.0
    interval = cfg.sample_interval_s
    tick = time.monotonic()
    try:
        while not stop:
            try:
                c.step()
            except GpuBackendError as e:
                log.warning("GPU backend: %s", e)
            except OSError as e:
                log.warning("metrics store: %s", e)
            if time.monotonic() >= next_prune:
                next_prune = time.monotonic() + PRUNE_EVERY_S
                open_jobs = {k[0] for k in c.open}
                removed = store.prune(cfg.metrics_dir, cfg.metrics_retention_days, keep=open_jobs)
                if removed:
                    log.info("pruned %d old job series", len(removed))
                with contextlib.suppress(OSError):
                    enforce.prune_verdicts(cfg.metrics_dir, cfg.metrics_retention_days)
            if not c.open and c.clock() - c.last_job_seen > cfg.collector_idle_exit_s:
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
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m slurm_colloc.metrics.collector [--conf FILE] [--seconds N]``."""
    from slurm_colloc import config as cfgmod
    from slurm_colloc.gpu.select import backend_from_config

    p = argparse.ArgumentParser(prog="colloc-collector", description=__doc__.split("\n\n")[0])
    p.add_argument("--conf", help="colloc.conf (default $COLLOC_CONF or /etc/slurm/colloc.conf)")
    p.add_argument("--seconds", type=float, help="stop after this long (benchmarks, tests)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s colloc: collector: %(message)s")
    cfg = cfgmod.load(a.conf)
    if cfg.log_file:
        with contextlib.suppress(OSError):
            fh = logging.FileHandler(cfg.log_file)
            fh.setFormatter(logging.Formatter("%(asctime)s colloc: collector: %(message)s"))
            logging.getLogger().addHandler(fh)
    fd = acquire_lock(cfg.metrics_dir)
    if fd is None:
        return 0  # another collector is running
    with contextlib.suppress(OSError):
        os.nice(5)
    backend = backend_from_config(cfg)
    log.info("started (pid %d, backend %s, every %.1fs; over limit: %s, outside MPS: %s)",
             os.getpid(), backend.name, cfg.sample_interval_s, cfg.enforce_over_limit,
             cfg.enforce_outside_mps)
    try:
        return serve(cfg, backend, max_seconds=a.seconds)
    finally:
        backend.close()
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
