"""Prolog (root, compute node): give a shard job its MPS daemon and memory limit.

For a shard job: make sure the (GPU, user) MPS control daemon runs, register the job
with it, and leave the TaskProlog the values to export (pipe directory, pinned
memory limit = shards x shard size, optional thread percentage). For a whole-GPU
job: make sure no idle or stale MPS daemon of ours is left on its GPUs.

Failure policy: any error is logged with the job id and the job runs without MPS
(its Slurm shards still bound its share); the prolog never makes slurmd drain the
node. The caller (prolog/colloc_prolog.py) always exits 0.

Promises checked (issue 28): a shard job whose shards and the GPU's registered jobs'
exceed the GPU is not co-located but requeued (:mod:`slurm_colloc.node.promise`:
logged, bounded, never held; the node is never drained for it).
"""

from __future__ import annotations

import logging
import pwd
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.budget import budget_of
from slurm_colloc.gpu.identity import GpuMap
from slurm_colloc.mps.control import MpsControlError, MpsDaemon
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import promise, user_cap
from slurm_colloc.node.gpus import node_gpu_map
from slurm_colloc.node.job import JobContext, context_to_json
from slurm_colloc.node.mps_protocol import node_protocol, v3_node
from slurm_colloc.slurm.adapter import SlurmAdapter
from slurm_colloc.slurm.squeue_json import SlurmJob


@dataclass(frozen=True)
class PrologDecision:
    """What the prolog did, for the log and the accounting record."""

    mode: str
    """``shared`` (MPS, limited), ``exclusive`` (whole GPU), ``none`` (no GPU)."""
    gpu: int | None = None
    limit_mib: int | None = None
    pipe_dir: str | None = None
    detail: str = ""


ABSENT_GRACE_S = 120.0
"""A registered job missing from the controller's list is reaped only when it was
already missing this long ago: one snapshot taken during a controller restart or
failover must not tear down the MPS daemons of running jobs."""


def daemon_for(
    cfg: CollocConfig, tenancy: Tenancy, gpu: int, uid: int, uuid: str | None = None
) -> MpsDaemon:
    """The MPS control daemon handle serving ``uid`` on Slurm's GPU ``gpu``.

    ``uuid``: the GPU's UUID, which a daemon being started must see it by; handles
    that only talk to or stop a running daemon do not need it.
    """
    return MpsDaemon(cfg.mps_control, gpu, tenancy.pipe_dir(gpu, uid), tenancy.log_dir(gpu, uid),
                     tenancy.daemon_state(gpu, uid), device=uuid)


def reap_stale(
    cfg: CollocConfig, tenancy: Tenancy, gpu: int, jobs: Mapping[int, SlurmJob] | None,
    keep: int | None = None, now: float | None = None, taken: float | None = None,
) -> list[int]:
    """Forget jobs on ``gpu`` the controller says are over; stop daemons left idle.

    Covers a crashed epilog or a node reboot: markers of finished jobs would
    otherwise keep a daemon (and its pipe directory) alive forever. ``jobs`` is the
    snapshot the prolog already took (no controller call here, under the lock);
    None (the controller could not be asked) reaps nothing. A job listed as pending
    or finished is reaped at once; one missing from the list only after
    ``ABSENT_GRACE_S``. ``taken``: when the snapshot was taken (before the lock); a
    job registered after that (another prolog got the lock first) is not judged by it:
    it would show as pending, or be missing, and lose its MPS registration and share
    of the server-side cap while it starts.
    """
    now = time.time() if now is None else now
    reaped = []
    for uid in tenancy.users_on(gpu):
        for job in tenancy.jobs_of(gpu, uid):
            if job == keep or jobs is None:
                continue
            if taken is not None and tenancy.registered_at(gpu, uid, job) >= taken:
                continue
            info = jobs.get(job)
            if info is not None:
                stale = not info.active
                if not stale:
                    tenancy.clear_absent(gpu, uid, job)
            else:
                stale = now - tenancy.absent_since(gpu, uid, job, now) >= ABSENT_GRACE_S
            if stale:
                tenancy.remove_job(job)
                reaped.append(job)
        if not tenancy.jobs_of(gpu, uid):
            with tenancy.cap_locked(gpu, uid):  # after any start in progress (_ensure_daemon)
                daemon_for(cfg, tenancy, gpu, uid).stop()
                tenancy.retire_pipe_dir(gpu, uid)  # purged by the caller, after the lock
    return reaped


def user_total_mib(cfg: CollocConfig, tenancy: Tenancy, gpu: int, uid: int) -> int:
    """Pinned memory of all of ``uid``'s jobs on ``gpu`` (their limits, from root state).

    The pinned limit (``COLLOC_PINNED_MIB``; env files of older versions only have the
    allocation ``COLLOC_LIMIT_MIB``) is what the server-side cap must add up: contexts
    are outside it on both sides.
    """
    total = 0
    for job in tenancy.jobs_of(gpu, uid):
        text = tenancy.read_job_limits(job)  # root's copy: the user's may be rewritten
        if text is None:
            continue
        values = {}
        for line in text.splitlines():
            key, _, value = line.partition("=")
            if key in ("COLLOC_LIMIT_MIB", "COLLOC_PINNED_MIB") and value.isdigit() \
                    and len(value) < 9:
                values[key] = int(value)
        total += values.get("COLLOC_PINNED_MIB", values.get("COLLOC_LIMIT_MIB", 0))
    return total


def no_gpu(ctx: JobContext, cfg: CollocConfig) -> str:
    """A job slurmd bound no GPU to: leave the epilog a context so it asks nothing."""
    Tenancy(Path(cfg.mps_root)).write_job_context(ctx.job_id, context_to_json(ctx))
    return "none gpu=None no GPU bound by slurmd"


def run(
    ctx: JobContext, cfg: CollocConfig, adapter: SlurmAdapter,
    jobs: Mapping[int, SlurmJob] | None = None, taken: float | None = None,
) -> PrologDecision:
    """Prepare MPS for the job (see module docstring).

    ``jobs``: the controller snapshot the context came from (used for reaping),
    ``taken``: when it was taken.
    """
    tenancy = Tenancy(Path(cfg.mps_root))
    if not ctx.gpus:
        return PrologDecision("none", detail="no GPU bound to the job")
    tenancy.write_job_context(ctx.job_id, context_to_json(ctx))
    start_metrics(ctx, cfg)
    replay_records(cfg)
    try:
        if not ctx.is_shared:
            return _exclusive(ctx, cfg, tenancy, jobs, taken)
        try:
            return _shared(ctx, cfg, tenancy, jobs, taken, check=True)
        except promise.OverPromise as over:  # issue 28: the GPU cannot hold it too
            return _refused(ctx, cfg, tenancy, adapter, jobs, taken, over)
    finally:
        tenancy.purge_quarantine()  # after every GPU lock is released; never raises


class MpsSetupError(RuntimeError):
    """MPS could not be set up for a shared job; the hard limit was still tried."""


def _refused(
    ctx: JobContext, cfg: CollocConfig, tenancy: Tenancy, adapter: SlurmAdapter,
    jobs: Mapping[int, SlurmJob] | None, taken: float | None, over: promise.OverPromise,
) -> PrologDecision:
    """The newcomer would over-promise its GPU: requeued, or (refused too often, or
    the requeue failed) co-located as before with a warning (:mod:`.promise`)."""
    refusal = promise.refuse(tenancy, adapter, over)
    if refusal.requeued:
        return PrologDecision("refused", over.gpu, detail=f"WARNING {refusal.detail}")
    d = _shared(ctx, cfg, tenancy, jobs, taken, check=False)
    return PrologDecision(d.mode, d.gpu, d.limit_mib, d.pipe_dir,
                          detail=f"{d.detail}; WARNING {refusal.detail}")


def _shared(
    ctx: JobContext, cfg: CollocConfig, tenancy: Tenancy,
    jobs: Mapping[int, SlurmJob] | None, taken: float | None, *, check: bool = False,
) -> PrologDecision:
    """A shard job: MPS (v2 daemon or v3 namespace), then the hard limit, always.

    The hard cgroup limit does not depend on MPS: whatever fails in the MPS set-up
    (a planted pipe dir, a refused command, a lock timeout), :func:`hard_limit` is
    still applied before the error goes up (the job then runs without MPS, but not
    without its cap where the driver has one).

    ``check``: raise :class:`~slurm_colloc.node.promise.OverPromise` (nothing set up)
    when the job's shards and the GPU's registered jobs' exceed the GPU (issue 28).
    """
    gpu = ctx.gpus[0]
    gmap = node_gpu_map(cfg)
    info = gmap.by_slurm_index(gpu)
    limit = ctx.shards * cfg.shard_mib
    try:
        budget = budget_of(cfg, info)
        pinned = budget.pinned_limit_mib(ctx.shards)
        gid = pwd.getpwuid(ctx.uid).pw_gid if ctx.uid else 0
        env = _client_env(ctx, cfg, tenancy, gpu, info.uuid, limit, pinned)
        capacity = budget.shards_per_gpu if check else 0
        if node_protocol(cfg) == 3:
            env.update(_v3_setup(ctx, cfg, tenancy, jobs, taken, pinned, gid, gmap, capacity))
            tenancy.write_job_env(ctx.job_id, env, ctx.uid, gid)
        else:
            _v2_setup(ctx, cfg, tenancy, jobs, taken, env, gid, info.uuid, capacity)
        promise.forget(tenancy, ctx.job_id)
    except promise.OverPromise:
        raise  # nothing set up: the caller requeues the newcomer
    except Exception as e:
        hard = hard_limit(ctx, cfg, info.index, limit)
        raise MpsSetupError(f"MPS not set up ({type(e).__name__}: {e}); "
                            f"hard limit: {hard}") from e
    hard = hard_limit(ctx, cfg, info.index, limit)
    return PrologDecision(
        "shared", gpu, limit, env["CUDA_MPS_PIPE_DIRECTORY"],
        detail=f"{ctx.shards} shards x {cfg.shard_mib} MiB on GPU {gpu} ({info.uuid}), "
               f"pinned {pinned} MiB; hard limit: {hard}",
    )


def _exclusive(
    ctx: JobContext, cfg: CollocConfig, tenancy: Tenancy,
    jobs: Mapping[int, SlurmJob] | None, taken: float | None,
) -> PrologDecision:
    """A whole-GPU job: no MPS; stale MPS registrations on its GPUs are reaped first."""
    for gpu in ctx.gpus:
        with tenancy.locked(gpu):
            reap_stale(cfg, tenancy, gpu, jobs, taken=taken)
            busy = [j for u in tenancy.users_on(gpu) for j in tenancy.jobs_of(gpu, u)]
        if busy:
            return PrologDecision(
                "exclusive", gpu, detail=f"WARNING: GPU {gpu} still serves MPS jobs {busy}"
            )
    return PrologDecision("exclusive", ctx.gpus[0], detail="whole GPU, no MPS")


def _client_env(
    ctx: JobContext, cfg: CollocConfig, tenancy: Tenancy, gpu: int, uuid: str, limit: int,
    pinned: int,
) -> dict[str, str]:
    """What the TaskProlog exports to a shared job (MPS v2 pipe directory; v3 replaces it)."""
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(tenancy.pipe_dir(gpu, ctx.uid)),
        "CUDA_MPS_LOG_DIRECTORY": str(tenancy.log_dir(gpu, ctx.uid)),
        # Slurm's index would name another device, or none, once MPS remaps the
        # daemon's one GPU for its clients; the UUID names the same GPU either way
        # (and also if the job ends up outside MPS)
        "CUDA_VISIBLE_DEVICES": uuid,
        # device 0 = the job's only visible GPU; allocations only: the job's CUDA
        # context comes on top, so its shards hold allocations + context
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={pinned}M",
        "COLLOC_GPU": str(gpu),
        "COLLOC_GPU_UUID": uuid,
        "COLLOC_LIMIT_MIB": str(limit),
        "COLLOC_PINNED_MIB": str(pinned),
    }
    if cfg.active_thread_percentage:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(cfg.active_thread_percentage)
    return env


def _v2_setup(
    ctx: JobContext, cfg: CollocConfig, tenancy: Tenancy, jobs: Mapping[int, SlurmJob] | None,
    taken: float | None, env: dict[str, str], gid: int, uuid: str, capacity: int = 0,
) -> None:
    """MPS v2: the job registered on its (GPU, user) daemon, started if needed.

    ``capacity`` > 0: the GPU's shards, checked before anything is registered (issue 28).
    The GPU lock covers the registration only. The daemon's start and the user's server
    cap come after it, under the (GPU, user) cap lock, by a group commit
    (:mod:`slurm_colloc.node.user_cap`): under a burst the GPU's other prologs register
    while the first one starts the daemon, and one start plus one commit serves them
    all (issue 28: prolog p99; a start under the GPU lock queued the whole wave behind
    it, then behind each other's registrations). The daemon cannot be stopped meanwhile:
    the job's marker is written first, and only a user's last job stops its daemon.
    """
    gpu = ctx.gpus[0]
    with tenancy.locked(gpu):
        reap_stale(cfg, tenancy, gpu, jobs, keep=ctx.job_id, taken=taken)
        _check_promise(cfg, tenancy, ctx, gpu, capacity, jobs, taken)
        tenancy.add_job(gpu, ctx.uid, ctx.job_id)
        tenancy.write_job_env(ctx.job_id, env, ctx.uid, gid)
        ticket = user_cap.register(tenancy, gpu, ctx.uid)
    daemon = daemon_for(cfg, tenancy, gpu, ctx.uid, uuid)
    # server side: a client that drops its own limit (env -i, --cleanenv) gets its
    # user's total share of this GPU, not the whole GPU (docs/node.md); committed
    # after the GPU lock, one commit for every registration before it (issue 28)
    _commit_cap(ctx, cfg, tenancy, daemon, ticket, gid)


def _ensure_daemon(ctx: JobContext, cfg: CollocConfig, tenancy: Tenancy, daemon: MpsDaemon,
                   gid: int) -> None:
    """Start the (GPU, user) daemon unless it runs; under the cap lock, the job registered.

    A daemon that died with jobs registered is started afresh here too (its pipe
    directory retired first), so a new job never gets a pipe directory nothing answers in.
    What stops a daemon (a user's last job ending, reaping) takes the cap lock too, so it
    waits for a start in progress and stops a daemon whose identity is known. A failed
    start withdraws the job before the cap lock is let go: the next job's commit, which
    starts the daemon again, does not count it.
    """
    gpu = ctx.gpus[0]
    if daemon.running():
        return
    try:
        tenancy.prepare_user_dirs(gpu, ctx.uid)
        daemon.start()
    except Exception:
        _withdraw(tenancy, ctx.job_id)  # under the cap lock: no later cap counts this job
        raise
    try:
        if cfg.active_thread_percentage:
            daemon.set_defaults(None, cfg.active_thread_percentage)
        tenancy.hand_pipe_dir_to(gpu, ctx.uid, gid)
    except Exception:
        # a daemon in a pipe directory the user cannot enter would pass ``running()``
        # for the next job too: stopped (no client can have reached it), started afresh
        daemon.stop()
        _withdraw(tenancy, ctx.job_id)
        raise


def _commit_cap(ctx: JobContext, cfg: CollocConfig, tenancy: Tenancy, daemon: MpsDaemon,
                ticket: int, gid: int) -> None:
    """The job's registration ``ticket`` covered by a running daemon and its user's
    server cap (:mod:`slurm_colloc.node.user_cap`), or MPS taken back from the job:
    whatever fails (the daemon does not start or refuses, the cap lock times out), the
    job never gets the pipe directory under a cap that may not hold its own share."""
    gpu = ctx.gpus[0]
    try:
        user_cap.commit(tenancy, gpu, ctx.uid, ticket,
                        lambda: user_total_mib(cfg, tenancy, gpu, ctx.uid),
                        lambda total: _cap_or_withdraw(ctx, tenancy, daemon, total),
                        ensure=lambda: _ensure_daemon(ctx, cfg, tenancy, daemon, gid))
    except Exception:
        _withdraw(tenancy, ctx.job_id)
        raise


def _check_promise(cfg: CollocConfig, tenancy: Tenancy, ctx: JobContext, gpu: int,
                   capacity: int, jobs: Mapping[int, SlurmJob] | None,
                   taken: float | None) -> None:
    """Raise :class:`~slurm_colloc.node.promise.OverPromise` if the job would make
    ``gpu`` hold more than ``capacity`` shards (under the GPU lock)."""
    over = promise.over_promise(tenancy, ctx, gpu, capacity, cfg.shard_mib, jobs, taken)
    if over is not None:
        raise over


CAP_TRIES = 2


def _cap_or_withdraw(ctx: JobContext, tenancy: Tenancy, daemon: MpsDaemon, total: int) -> None:
    """Raise the user's server cap to ``total``, or take MPS back from this job.

    The user's running server binds every client to its cap: a job handed the pipe
    directory while the cap still holds only its co-tenants' share dies of OOM inside
    its own reservation (issue 24: philly90h-007, 9,728 MiB allowed, refused at 8.8
    GiB by its user's 7,680 MiB server cap). One retry (a busy daemon); then the
    job's env files and marker go, so the TaskProlog gives it no MPS, and the error
    reaches the prolog's log (the collector still holds it to its allocation).
    """
    for attempt in range(CAP_TRIES):
        try:
            daemon.cap_user(total)
            return
        except MpsControlError:
            if attempt + 1 < CAP_TRIES:
                time.sleep(0.5)
                continue
            _withdraw(tenancy, ctx.job_id)
            raise


def _withdraw(tenancy: Tenancy, job_id: int) -> None:
    """The job's env files and markers go: the TaskProlog gives it no MPS."""
    tenancy.forget_job_env(job_id)
    tenancy.remove_job(job_id)


def _v3_setup(
    ctx: JobContext, cfg: CollocConfig, tenancy: Tenancy, jobs: Mapping[int, SlurmJob] | None,
    taken: float | None, pinned: int, gid: int, gmap: GpuMap, capacity: int = 0,
) -> dict[str, str]:
    """MPS v3: the job's namespace on its GPU's server of the node's one daemon.

    Every user's jobs on the GPU share that server (no time-slicing between users'
    servers); the namespace carries the job's pinned limit and thread percentage.
    The job's marker is still kept in ``tenancy`` (the collector and reaping read
    it); the returned env replaces the legacy pipe directory. Node lock, then the
    GPU lock: the same order as the epilog.
    """
    gpu = ctx.gpus[0]
    node = v3_node(cfg)
    with tenancy.locked_node():
        with tenancy.locked(gpu):
            for job in reap_stale(cfg, tenancy, gpu, jobs, keep=ctx.job_id, taken=taken):
                node.remove_job(job)
            _check_promise(cfg, tenancy, ctx, gpu, capacity, jobs, taken)  # the node lock is held
        if not node.running():
            node.start({i: g.uuid for i, g in enumerate(gmap.gpus)})
        env = node.add_job(gpu, gmap.uuid(gpu), ctx.job_id, ctx.uid, gid, pinned,
                           cfg.active_thread_percentage)
        with tenancy.locked(gpu):
            tenancy.add_job(gpu, ctx.uid, ctx.job_id)
    env["COLLOC_MPS_PROTOCOL"] = "3"
    return env


def hard_limit(ctx: JobContext, cfg: CollocConfig, gpu: int, limit_mib: int) -> str:
    """Hard per-cgroup GPU memory limit where the driver has it (issue 11, H2).

    ``gpu`` is the backend's (NVML's) index of the job's GPU, ``limit_mib`` the job's
    whole allocation: the cgroup limit counts all device memory, contexts included.

    Never in the job's way: any failure is reported in the prolog's log line and the
    MPS server-side limit plus the collector's enforcement remain.
    """
    if not cfg.gpu_hard_limit:
        return "off in colloc.conf"
    try:
        from slurm_colloc.gpu.nvml import slurm_job_cgroup
        from slurm_colloc.gpu.select import backend_from_config

        backend = backend_from_config(cfg, with_dcgm=False)
        try:
            support = backend.hard_memory_limit_supported(gpu)
            if not support.supported:
                return f"unsupported ({support.reason})"
            # job_<id>, or on 26.05 (CgroupJobIdPaths=no) the SLUID slurmd gave us
            cgroup = slurm_job_cgroup(ctx.job_id, sluid=ctx.sluid)
            if cgroup is None:
                return ("no job cgroup (cgroup/v2 and PrologFlags=Contain needed; "
                        f"looked for job_{ctx.job_id}, SLUID {ctx.sluid or 'none'})")
            res = backend.set_job_memory_limit(gpu, cgroup, limit_mib)
            return f"{res.status} {res.detail}".strip()
        finally:
            backend.close()
    except Exception as e:  # noqa: BLE001 - the hard limit is an extra layer, never fatal
        return f"error ({type(e).__name__}: {e})"


def replay_records(cfg: CollocConfig) -> None:
    """Issue 28: start the node's record writer (detached, under its lock, never
    waiting) when root's spool holds records accounting has not confirmed, so records
    kept while slurmdbd was away reach it with the next job here."""
    try:
        import os

        from slurm_colloc.accounting import spool

        spool.kick(spool.spool_dir_of(cfg.evidence_dir), main_env(os.environ))
    except Exception as e:  # noqa: BLE001 - never in the job's way
        logging.getLogger("colloc.node.prolog").warning("prolog: record replay not started: %s", e)


def start_metrics(ctx: JobContext, cfg: CollocConfig) -> None:
    """Metrics sidecar (:mod:`slurm_colloc.node.metrics_launch`); never in the job's way."""
    try:
        from slurm_colloc.node.metrics_launch import ensure_collector

        ensure_collector(ctx, cfg)
    except Exception as e:  # noqa: BLE001 - metrics are optional; MPS set-up is not
        logging.getLogger("colloc.node.prolog").warning(
            "prolog: job %s: metrics sidecar not started: %s", ctx.job_id, e
        )


def main_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment Slurm tools need when run from a node script (no PATH given)."""
    out = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}
    for k in ("SLURM_CONF", "COLLOC_CONF"):
        if k in env:
            out[k] = env[k]
    return out
