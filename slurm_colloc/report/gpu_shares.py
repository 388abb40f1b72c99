"""Each job's share of a GPU, for a site's own (jobstats-style) accounting.

Why: Princeton jobstats and the GPU-hour reports built on it credit a whole GPU to
every job that ran on one. A colloc job held ``gres/shard:K`` of a GPU cut into ``N``
shards, i.e. ``K/N`` of it; this module says so per job, from Slurm's accounting
alone (``sacct --json``'s AllocTRES through :mod:`slurm_colloc.slurm.sacct_json`),
so any host with sacct can compute it. The GPU index comes from colloc's record
(AdminComment or SystemComment, config ``record_field``) when the job has one.
``colloc admin gpu-shares`` prints it as CSV or JSON.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from slurm_colloc.accounting.field import record_in
from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.budget import config_budget
from slurm_colloc.gpu_settings import effective
from slurm_colloc.slurm.adapter import by_start
from slurm_colloc.slurm.records import AccountingRecord

COLUMNS = ("jobid", "user", "node", "gpu", "shards", "shards_per_gpu", "fraction")


@dataclass(frozen=True)
class GpuShare:
    """One job's (latest attempt's) hold on GPUs."""

    jobid: str
    user: str
    node: str
    gpu: int | None
    """The GPU index colloc recorded (None: no colloc record, or a whole-GPU job)."""
    shards: int
    """``gres/shard`` allocated (0 for a ``gres/gpu`` job)."""
    shards_per_gpu: int | None
    """Shards one GPU of that node has (colloc.conf; None when it cannot say)."""
    fraction: float | None
    """GPUs held: ``shards / shards_per_gpu``, or the ``gres/gpu`` count; None when a
    shard job's GPU size is unknown."""


def _spg(cfg: CollocConfig, node: str) -> int | None:
    b = config_budget(effective(cfg, node=node or None, model=None))
    return b.shards_per_gpu if b is not None and b.shards_per_gpu > 0 else None


def share_of(row: AccountingRecord, cfg: CollocConfig) -> GpuShare | None:
    """The row's GPU share; None for a job that held no GPU (or shard)."""
    shards = row.alloc_tres.get("gres/shard", 0)
    gpus = row.alloc_tres.get("gres/gpu", 0)
    if shards <= 0 and gpus <= 0:
        return None
    node = row.fields.get("NodeList", "")
    rec = record_in(row.fields, cfg.record_field)
    last = rec.attempts[-1] if rec and rec.attempts else None
    gpu = last.gpu if last is not None else None
    if shards <= 0:
        return GpuShare(row.job_id, row.fields.get("User", ""), node, gpu, 0, None,
                        float(gpus))
    spg = _spg(cfg, node)
    frac = round(shards / spg, 4) if spg else None
    return GpuShare(row.job_id, row.fields.get("User", ""), node, gpu, shards, spg, frac)


def shares(rows: Iterable[AccountingRecord], cfg: CollocConfig) -> list[GpuShare]:
    """One share per job that held a GPU, the latest row of a requeued job (pure)."""
    by_job: dict[str, list[AccountingRecord]] = {}
    for r in rows:
        by_job.setdefault(r.job_id, []).append(r)
    latest = (by_start(recs)[-1] for recs in by_job.values())
    out = [s for r in latest if (s := share_of(r, cfg)) is not None]
    return sorted(out, key=lambda s: (len(s.jobid), s.jobid))


def render(items: list[GpuShare], fmt: str) -> str:
    """``csv`` (header + one line per job) or ``json`` (a list of objects)."""
    if fmt == "json":
        return json.dumps([asdict(s) for s in items], indent=1) + "\n"
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for s in items:
        w.writerow(["" if v is None else v for v in (getattr(s, c) for c in COLUMNS)])
    return buf.getvalue()
