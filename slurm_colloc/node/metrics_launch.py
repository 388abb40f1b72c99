"""Prolog side of the metrics sidecar: record the attempt, make sure a collector runs.

This sits on every job's start, so it does the least possible: one small JSON
write, one non-blocking ``flock`` probe on the collector's lock in root's private
directory (no pid parsing, so a stale pid file can never fool it, and no user can
open the file, so no user's lock can pass for a collector), and only when no
collector holds the lock a detached double-fork + exec of
``python -m slurm_colloc.metrics.collector`` (its supervisor,
:mod:`slurm_colloc.metrics.supervisor`, which restarts the sampling worker).
Measured cost: see docs/report.md (well under a millisecond when the collector is
already running). With ``collector_unit`` set the start is systemd's
(:mod:`slurm_colloc.node.collector_start`), the detached start its fallback.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from slurm_colloc.config import CollocConfig
from slurm_colloc.detach import spawn_module
from slurm_colloc.metrics import liveness, spawn, store
from slurm_colloc.node.collector_start import start_collector
from slurm_colloc.node.job import JobContext

SPANK = "SPANK__SLURM_SPANK_OPTION_colloc_colloc_"


def _int(v: str | None) -> int | None:
    return int(v) if v and v.isdigit() and len(v) < 10 else None


def _name(v: str | None) -> str | None:
    if not v or v == "(null)" or len(v) > 32:
        return None
    v = v.lower()
    return v if all(c.isalnum() or c in "-_." for c in v) else None


def meta_for(ctx: JobContext, cfg: CollocConfig, env: Mapping[str, str]) -> store.JobMeta:
    """The attempt's meta: job facts plus the estimator inputs (SPANK env, untrusted)."""
    sub = ctx.submit
    return store.JobMeta(
        job_id=ctx.job_id, attempt=ctx.restarts, uid=ctx.uid, gpus=ctx.gpus,
        limit_mib=ctx.limit_mib(cfg.shard_mib),
        shards=ctx.shards, start=time.time(),
        estimate_mib=(sub.est_mib or sub.need_mib) if sub else None,
        estimator=(sub.estimator or sub.mode) if sub else None,
        fingerprint=sub.fingerprint if sub else None,
        batch_size=_int(env.get(SPANK + "batch_size")),
        seq_len=_int(env.get(SPANK + "seq_len")),
        optimizer=_name(env.get(SPANK + "optimizer")),
        precision=_name(env.get(SPANK + "precision")),
        sluid=ctx.sluid,  # slurmd's, validated: the collector's key for 26.05 cgroups
    )


def collector_running(metrics_dir: str) -> bool:
    """True while a collector holds its lock (root's private directory only).

    See :func:`slurm_colloc.metrics.liveness.collector_running`: a lock a user could
    open (the old 0644 ``collector.pid``) let any job keep every collector out.
    """
    return liveness.collector_running(metrics_dir)


def spawn_collector(env: Mapping[str, str]) -> None:
    """Start the collector fully detached (own session; slurmd does not wait for it).

    An orphaned worker starts its successor the same way
    (:mod:`slurm_colloc.metrics.spawn`)."""
    spawn_module(spawn.MODULE, (), spawn.collector_env(env))


def ensure_collector(
    ctx: JobContext, cfg: CollocConfig, env: Mapping[str, str] | None = None
) -> str:
    """Prolog hook: store the attempt's meta; start the collector unless it runs.

    Returns what it did (for the prolog's log line). Raises only OSError-type errors
    of the metrics dir, which the prolog logs and ignores.
    """
    if not ctx.gpus:
        return "no GPU"
    env = os.environ if env is None else env
    store.write_meta(cfg.metrics_dir, meta_for(ctx, cfg, env))
    if collector_running(cfg.metrics_dir):
        return "collector running"
    return start_collector(cfg.collector_unit, lambda: spawn_collector(env))
