"""Promises checked (issue 28, item 4): a GPU never holds more shards than it has.

Slurm's gres bookkeeping is what keeps a GPU's shard jobs within the GPU. When it is
wrong (seen: slurmctld restarted while jobs ran, and an OOM'd job's rerun on "a
whole GPU" got its 39 shards on a GPU already running four recovered 3-shard jobs:
51 shards on a 39-shard GPU, every job at 0.22x), the prolog is the last place that
knows: the GPU's MPS registrations (:class:`~slurm_colloc.mps.tenancy.Tenancy`
markers) and each registered job's shards (the context its prolog saved from
Slurm's JSON, root-owned; else root's copy of its limits).

What the prolog does about it (:func:`over_promise`, then :func:`refuse`):

* it logs the GPU, its capacity (``shards_per_gpu`` of :mod:`slurm_colloc.gpu.budget`,
  colloc.conf's effective settings for the GPU's model and node) and every job on it;
* it does not co-locate the newcomer: no MPS registration, no daemon start;
* it requeues the newcomer (``scontrol requeue``, not held: it goes back to the queue
  and Slurm places it again after its usual requeue delay), outside every GPU lock.

Never a non-zero exit (that drains the node and holds the job: docs/node.md). Bounded:
a job is refused at most :data:`MAX_REFUSALS` times (root's count in
``mps_root/refused/<jobid>``); after that, or when the requeue itself fails, it runs
co-located as before and the log says so. Registered jobs are not touched: they were
there first and did nothing wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm_colloc.mps.control import read_small_file, write_root_file
from slurm_colloc.mps.tenancy import Tenancy, ensure_root_dir
from slurm_colloc.node.job import JobContext
from slurm_colloc.slurm.adapter import SlurmAdapter, SlurmError
from slurm_colloc.slurm.squeue_json import SlurmJob

MAX_REFUSALS = 3
"""Times one job is sent back before it runs co-located anyway (logged)."""
REFUSED_DIR = "refused"
STALE_S = 7 * 86400
"""Refusal counts older than this are forgotten (a job cancelled while pending)."""


class OverPromise(RuntimeError):
    """The newcomer's shards and the registered jobs' exceed what the GPU holds."""

    def __init__(self, gpu: int, capacity: int, newcomer: int, shards: int,
                 registered: dict[int, int]) -> None:
        self.gpu, self.capacity, self.newcomer, self.shards = gpu, capacity, newcomer, shards
        self.registered = dict(registered)
        jobs = ", ".join(f"{j}:{s}" for j, s in sorted(registered.items()))
        super().__init__(
            f"GPU {gpu} holds {capacity} shards; registered jobs hold "
            f"{sum(registered.values())} ({jobs}) and job {newcomer} asks {shards}: "
            f"{self.total} shards promised"
        )

    @property
    def total(self) -> int:
        return self.shards + sum(self.registered.values())


def job_shards(tenancy: Tenancy, job_id: int, shard_mib: int) -> int:
    """A registered job's shards from root state: its prolog's saved context (Slurm's
    JSON), else root's copy of its limits (``COLLOC_LIMIT_MIB`` / shard size); 0 when
    neither is readable."""
    text = tenancy.read_job_context(job_id)
    if text is not None:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            shards = json.loads(text).get("shards")
            if isinstance(shards, int) and not isinstance(shards, bool) and 0 <= shards < 1 << 20:
                return shards
    limits = tenancy.read_job_limits(job_id) or ""
    for line in limits.splitlines():
        key, _, value = line.partition("=")
        if key == "COLLOC_LIMIT_MIB" and value.isdigit() and len(value) < 9 and shard_mib > 0:
            return int(value) // shard_mib
    return 0


def holds_shards(tenancy: Tenancy, gpu: int, uid: int, job: int,
                 jobs: Mapping[int, SlurmJob], taken: float | None) -> bool:
    """Whether a registered job still holds its shards in Slurm's eyes.

    Listed RUNNING (or suspended...): yes. Listed COMPLETING or over: no, Slurm gave
    its shards back at its end, only its epilog has not released MPS yet (a
    newcomer in its place is no over-promise). Not listed: yes if it registered
    after the snapshot was taken (a prolog that got the lock first), else no (gone,
    and reaped once its grace is over).
    """
    info = jobs.get(job)
    if info is not None:
        return info.active and info.state != "COMPLETING"
    return taken is not None and tenancy.registered_at(gpu, uid, job) >= taken


def registered_shards(tenancy: Tenancy, gpu: int, shard_mib: int,
                      jobs: Mapping[int, SlurmJob], taken: float | None,
                      exclude: int | None = None) -> dict[int, int]:
    """Every job registered on ``gpu`` (any user) that holds its shards
    (:func:`holds_shards`), with its shards; ``exclude`` left out."""
    out: dict[int, int] = {}
    for uid in tenancy.users_on(gpu):
        for job in tenancy.jobs_of(gpu, uid):
            if job != exclude and holds_shards(tenancy, gpu, uid, job, jobs, taken):
                out[job] = job_shards(tenancy, job, shard_mib)
    return out


def over_promise(tenancy: Tenancy, ctx: JobContext, gpu: int, capacity: int,
                 shard_mib: int, jobs: Mapping[int, SlurmJob] | None,
                 taken: float | None) -> OverPromise | None:
    """The over-promise the newcomer ``ctx`` would make on ``gpu``, or None.

    Call under the GPU's lock, after stale registrations are reaped. ``capacity``
    <= 0 (unknown) checks nothing; nor does a missing controller snapshot
    (``jobs`` None: which registered jobs still run is not known, and a requeue
    could not be asked for anyway).
    """
    if capacity <= 0 or ctx.shards <= 0 or jobs is None:
        return None
    registered = registered_shards(tenancy, gpu, shard_mib, jobs, taken, exclude=ctx.job_id)
    if ctx.shards + sum(registered.values()) <= capacity:
        return None
    return OverPromise(gpu, capacity, ctx.job_id, ctx.shards, registered)


@dataclass(frozen=True)
class Refusal:
    """What :func:`refuse` did."""

    requeued: bool
    detail: str


def _count_file(tenancy: Tenancy, job_id: int) -> Path:
    return tenancy.root / REFUSED_DIR / str(job_id)


def refusals(tenancy: Tenancy, job_id: int) -> int:
    """How often the job was sent back already (root's count)."""
    try:
        text = read_small_file(_count_file(tenancy, job_id), owner=os.geteuid(), limit=64)
        return max(0, int(text.split()[0]))
    except (OSError, ValueError, IndexError):
        return 0


def forget(tenancy: Tenancy, job_id: int) -> None:
    """The job runs here now: its count goes."""
    with contextlib.suppress(OSError):
        _count_file(tenancy, job_id).unlink()


def _note_refusal(tenancy: Tenancy, job_id: int, n: int, now: float) -> None:
    d = ensure_root_dir(tenancy.root / REFUSED_DIR, 0o700)
    write_root_file(d / str(job_id), f"{n}\n")
    with contextlib.suppress(OSError), os.scandir(d) as it:
        for n_, entry in enumerate(it):
            if n_ >= 1000:
                break
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > STALE_S:
                    os.unlink(entry.path)


def refuse(tenancy: Tenancy, adapter: SlurmAdapter, over: OverPromise,
           now: float | None = None) -> Refusal:
    """Send the newcomer back to the queue (outside every GPU lock: a controller call).

    After :data:`MAX_REFUSALS`, or when the controller refuses the requeue, the
    newcomer is not requeued (``requeued`` False): the caller co-locates it as before.
    """
    n = refusals(tenancy, over.newcomer)
    if n >= MAX_REFUSALS:
        forget(tenancy, over.newcomer)
        return Refusal(False, f"over-promise: {over}; already requeued {n} times: "
                              "runs co-located")
    try:
        adapter.requeue(over.newcomer)
    except SlurmError as e:
        return Refusal(False, f"over-promise: {over}; requeue refused ({e}): runs co-located")
    with contextlib.suppress(OSError):
        _note_refusal(tenancy, over.newcomer, n + 1, time.time() if now is None else now)
    return Refusal(True, f"over-promise: {over}; not co-located: job {over.newcomer} "
                         f"requeued ({n + 1} of {MAX_REFUSALS})")
