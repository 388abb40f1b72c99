"""Epilog side of the metrics sidecar: an attempt's summary, and the estimator history.

:func:`job_summary` is the hook the epilog calls (``slurm_colloc.node.epilog``): it
reads the attempt's node-local series and returns the
:class:`~slurm_colloc.accounting.record.MetricsSummary` that goes into AdminComment
(with a :func:`downsample`-d series of ``series_points`` points, so a plot needs no
node-local file), plus the ids of the jobs that shared a GPU with it.

:func:`record_history` files a successful attempt's measured peak in the estimator's
history (``slurm_colloc.estimators.history.SqliteHistory`` at ``history_db``), keyed by the job
owner's uid, the model fingerprint and the estimator inputs the prolog stored, so the
owner's next ``sbatch --colloc`` of the same model and job is estimated from
measurement. The uid is the prolog's (slurmd's ``SLURM_JOB_UID``), never user text:
the fingerprint is user-controlled, so a peak only ever counts for its owner
(security issue 11, H3; policy in ``slurm_colloc/estimators/history.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace

from slurm_colloc.accounting.record import MetricsSummary
from slurm_colloc.config import CollocConfig
from slurm_colloc.metrics import store

IDLE_SM_PCT = 5.0
"""A sample with SM activity (or utilisation) below this counts as idle."""


def downsample(
    rows: Sequence[store.Row], points: int, start: float | None = None
) -> tuple[tuple[int, int, int | None], ...]:
    """At most ``points`` points over the attempt's rows, oldest first (pure).

    The rows' time span is cut into ``points`` equal buckets; each non-empty bucket
    gives (seconds from ``start`` (default: the first row) to its first row, the max
    of the job's memory in it (MiB), the sample-weighted mean SM activity % (a row
    without SM activity counts with its utilisation) or None when neither was
    measured). The peak survives: it is the max of some bucket.
    """
    if points <= 0 or not rows:
        return ()
    ordered = sorted((r for r in rows if math.isfinite(r.t)), key=lambda r: r.t)
    if not ordered:
        return ()
    t0, t1 = ordered[0].t, ordered[-1].t
    origin = t0 if start is None or not math.isfinite(start) or start <= 0 else start
    span = t1 - t0
    buckets: dict[int, list[store.Row]] = {}
    for r in ordered:
        i = 0 if span <= 0 else min(points - 1, int((r.t - t0) / span * points))
        buckets.setdefault(i, []).append(r)
    out: list[tuple[int, int, int | None]] = []
    for i in sorted(buckets):
        b = buckets[i]
        act = [(r.sm_pct if r.sm_pct is not None else r.util_pct, r.n) for r in b]
        known = [(x, n) for x, n in act if x is not None and math.isfinite(x)]
        sm = None
        if known:
            sm = round(sum(x * n for x, n in known) / sum(n for _, n in known))
        out.append((max(0, round(b[0].t - origin)), max(r.mem_max_mib for r in b), sm))
    return tuple(out)


def summarize(
    rows: Sequence[store.Row], *, points: int = 0, start: float | None = None
) -> tuple[MetricsSummary | None, list[str]]:
    """Summary and co-tenants of an attempt's rows (pure); with ``points`` > 0 the
    summary carries the :func:`downsample`-d series (seconds from ``start``)."""
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
            series=downsample(rows, points, start),
        ),
        tenants,
    )


def job_summary(
    cfg: CollocConfig, job_id: int, attempt: int, *, now: float | None = None,
) -> tuple[MetricsSummary | None, list[str]]:
    """The epilog hook: (summary or None when nothing was sampled, co-tenant job ids).

    The summary's series has ``cfg.series_points`` points at most, timed from the
    attempt's start as the prolog recorded it (else from the first sample). Its
    ``gaps`` are the holes in the sampling from that start to ``now`` (the epilog's
    time), put down to the collector or the job (:mod:`.gaps`).
    """
    series = store.read_series(cfg.metrics_dir, job_id, attempt)
    if not series.rows:
        return None, []
    meta = store.read_meta(cfg.metrics_dir, job_id, attempt)
    start = meta.start if meta is not None and meta.job_id == job_id and meta.start else None
    summ, tenants = summarize(series.rows, points=cfg.series_points, start=start)
    if summ is not None:
        summ = with_gaps(summ, series.rows, cfg, start, time.time() if now is None else now)
    return summ, tenants


def with_gaps(summ: MetricsSummary, rows: Sequence[store.Row], cfg: CollocConfig,
              start: float | None, end: float) -> MetricsSummary:
    """``summ`` with the attempt's sampling gaps (from ``start``, else the first row)."""
    from slurm_colloc.metrics import gaps

    t0 = start if start is not None else min(r.t for r in rows)
    if end <= t0:
        return summ
    down = gaps.collector_down(cfg.metrics_dir, t0, end, end,
                               stall_s=max(60.0, 30 * cfg.sample_interval_s))
    found = gaps.sampling_gaps(rows, t0, end, cfg.sample_interval_s, down)
    return replace(summ, span_s=round(end - t0), gaps=tuple(
        (max(0, round(g.start - t0)), max(1, round(g.seconds)), g.cause) for g in found))


def record_history(
    cfg: CollocConfig, job_id: int, attempt: int, summary: MetricsSummary | None,
    *, succeeded: bool, uid: int | None = None,
) -> str:
    """File the attempt's measured peak in the estimator history; returns what it did.

    Only a successful, completely sampled attempt counts: a job killed by OOM shows
    the limit it hit, not what it needed, and a peak sampled while the collector was
    down for part of the attempt is only part of it (sqlite keeps one largest peak per
    key, so such a lower bound is left out; the accounting history uses it as one).
    Without a fingerprint and batch size (no ``--colloc=SUMMARY``) there is no key to
    file it under. The peak is filed under the job owner's uid as
    the prolog recorded it (root-side ``JobMeta.uid``); ``uid``, when the caller (the
    epilog, from slurmd's environment) knows it too, must agree or nothing is filed.
    """
    if not succeeded:
        return "not recorded: attempt failed"
    if summary is None or not summary.peak_mib or summary.peak_mib <= 0 or summary.samples == 0:
        return "not recorded: no measurement"
    down = sum(g[1] for g in summary.gaps if g[2] == "collector")
    if down > 0:  # a partial peak would size the next run too small (issue 27)
        return f"not recorded: sampling gaps (collector down {down} s)"
    meta = store.read_meta(cfg.metrics_dir, job_id, attempt)
    if meta is None or not meta.fingerprint or not meta.batch_size:
        return "not recorded: no model fingerprint or batch size"
    if meta.job_id != job_id or meta.attempt != attempt:
        return "not recorded: the attempt's meta is of another job"
    if isinstance(meta.uid, bool) or not isinstance(meta.uid, int) or meta.uid < 0:
        return "not recorded: no job owner uid"
    if uid is not None and uid != meta.uid:
        return f"not recorded: job owner uid {uid} differs from the prolog's {meta.uid}"
    from slurm_colloc.estimators.history import HistoryUnsafe, SqliteHistory

    fp = meta.fingerprint.lower()
    if len(fp) > 64 or any(c not in "0123456789abcdef" for c in fp):
        return "not recorded: the fingerprint is not 1-64 hex digits"
    source = f"job record (user-supplied, est={meta.estimator or '?'})"
    try:
        SqliteHistory(cfg.history_db, uid=meta.uid).record(
            fp, meta.batch_size, meta.seq_len, meta.optimizer or "adam",
            meta.precision or "fp32", summary.peak_mib, job_id=str(job_id),
            uid=meta.uid, attempt=attempt, fp_source=source[:80],
        )
    except HistoryUnsafe as e:
        return f"not recorded: history db unsafe: {e}"
    return f"recorded peak {summary.peak_mib} MiB for uid {meta.uid}, {fp[:12]}"
