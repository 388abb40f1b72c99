"""Epilog side of the metrics sidecar: an attempt's summary, and the estimator history.

:func:`job_summary` is the hook the epilog calls (``slurm_colloc.node.epilog``): it
reads the attempt's node-local series and returns the
:class:`~slurm_colloc.accounting.record.MetricsSummary` that goes into AdminComment,
plus the ids of the jobs that shared a GPU with it.

:func:`record_history` files a successful attempt's measured peak in the estimator's
history (``estimators.history.SqliteHistory`` at ``history_db``), keyed by the model
fingerprint and the estimator inputs the prolog stored, so the next
``sbatch --colloc`` of the same model and job is estimated from measurement.
"""

from __future__ import annotations

from collections.abc import Sequence

from slurm_colloc.accounting.record import MetricsSummary
from slurm_colloc.config import CollocConfig
from slurm_colloc.metrics import store

IDLE_SM_PCT = 5.0
"""A sample with SM activity (or utilisation) below this counts as idle."""


def summarize(rows: Sequence[store.Row]) -> tuple[MetricsSummary | None, list[str]]:
    """Summary and co-tenants of an attempt's rows (pure)."""
    if not rows:
        return None, []
    n = sum(r.n for r in rows)
    peak = max(r.mem_max_mib for r in rows)
    mean = sum(r.mem_mib * r.n for r in rows) / n
    sm_rows = [r for r in rows if r.sm_pct is not None]
    dcgm = bool(sm_rows)
    act_rows = sm_rows or [r for r in rows if r.util_pct is not None]
    mean_act = None
    if act_rows:
        w = sum(r.n for r in act_rows)
        vals = [(r.sm_pct if dcgm else r.util_pct) or 0.0 for r in act_rows]
        mean_act = sum(v * r.n for v, r in zip(vals, act_rows, strict=True)) / w / 100.0
    energy = sum(r.energy_j for r in rows)
    tenants = sorted({t for r in rows for t in r.tenants}, key=store._job_key)
    return (
        MetricsSummary(
            peak_mib=peak, mean_mib=round(mean, 1),
            mean_sm_activity=None if mean_act is None else round(mean_act, 3),
            energy_j=round(energy, 1), samples=n, dcgm=dcgm,
        ),
        tenants,
    )


def job_summary(
    cfg: CollocConfig, job_id: int, attempt: int
) -> tuple[MetricsSummary | None, list[str]]:
    """The epilog hook: (summary or None when nothing was sampled, co-tenant job ids)."""
    series = store.read_series(cfg.metrics_dir, job_id, attempt)
    return summarize(series.rows)


def record_history(
    cfg: CollocConfig, job_id: int, attempt: int, summary: MetricsSummary | None,
    *, succeeded: bool,
) -> str:
    """File the attempt's measured peak in the estimator history; returns what it did.

    Only a successful attempt counts: a job killed by OOM shows the limit it hit, not
    what it needed. Without a fingerprint and batch size (no ``--colloc=SUMMARY``)
    there is no key to file it under.
    """
    if not succeeded:
        return "not recorded: attempt failed"
    if summary is None or not summary.peak_mib or summary.peak_mib <= 0 or summary.samples == 0:
        return "not recorded: no measurement"
    meta = store.read_meta(cfg.metrics_dir, job_id, attempt)
    if meta is None or not meta.fingerprint or not meta.batch_size:
        return "not recorded: no model fingerprint or batch size"
    from estimators.history import SqliteHistory

    SqliteHistory(cfg.history_db).record(
        meta.fingerprint, meta.batch_size, meta.seq_len, meta.optimizer or "adam",
        meta.precision or "fp32", summary.peak_mib, job_id=str(job_id),
    )
    return f"recorded peak {summary.peak_mib} MiB for {meta.fingerprint[:12]}"
