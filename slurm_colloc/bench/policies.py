"""How each policy submits a trace job: a registry of small policy objects.

* ``whole-gpu``: today's practice, ``--gres=gpu:1``, plain Slurm (no colloc node scripts).
* ``shards``: Slurm shards sized by the user's guess; no estimate, no MPS limits,
  no recovery (plain Slurm: a job that runs out of GPU memory is lost).
* ``colloc``: ``--colloc=SUMMARY --colloc-batch-size=N`` where a summary exists
  (the default estimator runs in the cli_filter), else ``--colloc-mem=<guess>``;
  MPS limits and OOM requeue on a whole GPU by colloc's node scripts.
* ``colloc-oracle``: ``--colloc-mem=<true peak>``: the policy without estimator error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slurm_colloc.bench.trace import TraceJob


@dataclass(frozen=True)
class Policy:
    """One way of submitting jobs, and the cluster it needs."""

    name: str
    label: str
    node_scripts: bool
    one_gpu_args: Callable[[TraceJob, Path | None, int], list[str]]
    """(job, summary file or None, shard MiB) -> sbatch options of a one-GPU job."""
    mps_protocol: str = "2"
    """The MPS its cluster's nodes run (``3``: one multi-user server per GPU)."""
    spread_shards: bool = True
    """Least-loaded shard placement (``LL_SHARED_GRES``); False: Slurm's first fit."""
    priority_weight_tres: str = ""
    """slurm.conf ``PriorityWeightTRES`` of its cluster (empty: Slurm's default)."""
    sm_capacity_pct: int = 0
    """Compute admission on its cluster (colloc.conf ``sm_capacity_pct``; 0: off), with
    the users' history of earlier runs written from the trace (a warm site)."""

    def args(self, job: TraceJob, summary: Path | None, shard_mib: int) -> list[str]:
        """sbatch options: a multi-GPU job asks for whole GPUs under every policy.

        Data-parallel jobs are not co-located (``--colloc`` sizes one GPU); on a colloc
        cluster job_submit then gives them their node exclusively (docs/admin.md).
        """
        if job.gpus > 1:
            return [f"--gres=gpu:{job.gpus}"]
        return self.one_gpu_args(job, summary, shard_mib)


def _whole(job: TraceJob, summary: Path | None, shard_mib: int) -> list[str]:
    return ["--gres=gpu:1"]


def _shards(job: TraceJob, summary: Path | None, shard_mib: int) -> list[str]:
    return [f"--gres=shard:{max(1, math.ceil(job.guess_mib / shard_mib))}"]


def _colloc(job: TraceJob, summary: Path | None, shard_mib: int) -> list[str]:
    if summary is not None:
        return [f"--colloc={summary}", f"--colloc-batch-size={job.batch_size}"]
    return [f"--colloc-mem={job.guess_mib}M"]


def _oracle(job: TraceJob, summary: Path | None, shard_mib: int) -> list[str]:
    return [f"--colloc-mem={job.peak_mib}M"]


def _colloc_margin_once(job: TraceJob, summary: Path | None, shard_mib: int) -> list[str]:
    """Diagnostic: the default estimator's ``estimate_mib`` (margin included once).

    The submit path reserves ``estimate_mib + margin_mib`` although ``estimate_mib``
    already contains the margin; this policy runs the same estimator in the replayer
    and passes its figure as ``--colloc-mem`` to measure what counting it once buys.
    """
    if summary is None:
        return [f"--colloc-mem={job.guess_mib}M"]
    from slurm_colloc.estimators import registry
    from slurm_colloc.estimators.base import Job
    from slurm_colloc.estimators.parsers import read_summary_file

    est = registry.get(registry.DEFAULT).estimate(
        read_summary_file(summary), Job(batch_size=job.batch_size))
    return [f"--colloc-mem={est.estimate_mib}M"]


SIZE_PRIORITY = "GRES/shard=10000,GRES/gpu=10000"
"""Priority by the share of the partition's GPUs a job asks for (shards and whole GPUs
weigh the same per GPU); below colloc's OOM-recovery boost (``Nice=-10000``)."""

DIAGNOSTIC = {"colloc-margin-once", "colloc-v3", "colloc-pack", "colloc-sm", "colloc-v3-sm",
              "colloc-v3-prio", "whole-gpu-prio"}
"""Policies not run by default: ``colloc-margin-once`` bypasses part of the submit
path; ``colloc-v3`` and ``colloc-pack`` would be a fifth and sixth cluster on the replay
machine (ask for them with ``--policies``, beside ``colloc``, to measure one MPS server
per GPU against several, packing against spreading, and compute admission)."""

POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("whole-gpu", "whole GPU (--gres=gpu:1)", False, _whole),
        Policy("shards", "shards, user guess, no limits/recovery", False, _shards),
        Policy("colloc", "slurm-colloc, default estimator", True, _colloc),
        Policy("colloc-oracle", "slurm-colloc, oracle memory", True, _oracle),
        Policy("colloc-v3", "slurm-colloc, MPS v3 (one multi-user server per GPU)", True,
               _colloc, mps_protocol="3"),
        Policy("colloc-pack", "slurm-colloc, shards packed first-fit (no LL_SHARED_GRES)",
               True, _colloc, spread_shards=False),
        Policy("colloc-sm", "slurm-colloc, compute admission (sm_capacity_pct=100, "
               "warm history)", True, _colloc, sm_capacity_pct=100),
        Policy("colloc-v3-sm", "slurm-colloc, MPS v3 and compute admission "
               "(sm_capacity_pct=108, warm history)", True, _colloc, mps_protocol="3",
               sm_capacity_pct=108),
        Policy("colloc-v3-prio", "slurm-colloc, MPS v3, priority by GPU share "
               "(PriorityWeightTRES)", True, _colloc, mps_protocol="3",
               priority_weight_tres=SIZE_PRIORITY),
        Policy("whole-gpu-prio", "whole GPU, priority by GPU share (PriorityWeightTRES)",
               False, _whole, priority_weight_tres=SIZE_PRIORITY),
        Policy("colloc-margin-once", "slurm-colloc, estimate with its margin once "
               "(diagnostic)", True, _colloc_margin_once),
    )
}


def get(names: list[str]) -> list[Policy]:
    """Policies by name; an unknown name is an error, never a silent default."""
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    return [POLICIES[n] for n in names]
