"""GPU-memory estimators for training jobs, from a model summary.

Pure Python, no torch, no Slurm: this runs on login nodes inside ``sbatch``.

    >>> from estimators import estimate, parse_summary
    >>> est = estimate(open("model.txt").read(), batch_size=32)
    >>> est.estimate_mib, est.breakdown

See ``docs/estimators.md`` for the formats, the estimators and their accuracy.
"""

from __future__ import annotations

import dataclasses
import math

from slurm_colloc.estimators.base import Estimate, Estimator, Job
from slurm_colloc.estimators.errors import EstimatorInputError, SummaryParseError
from slurm_colloc.estimators.history import HistoryBounds, HistoryStore, SqliteHistory
from slurm_colloc.estimators.history_scaling import HISTORY_MARGIN, scale_history
from slurm_colloc.estimators.model import Layer, ModelSummary
from slurm_colloc.estimators.parsers import parse_summary, read_summary_file
from slurm_colloc.estimators.registry import DEFAULT, get, names

__all__ = [
    "Estimate",
    "Estimator",
    "EstimatorInputError",
    "HistoryBounds",
    "HistoryStore",
    "Job",
    "Layer",
    "ModelSummary",
    "SqliteHistory",
    "SummaryParseError",
    "estimate",
    "estimator_names",
    "parse_summary",
    "read_summary_file",
]


def estimator_names() -> list[str]:
    """Names accepted by ``estimator=``."""
    return names()


def estimate(
    summary: str | ModelSummary,
    batch_size: int,
    *,
    seq_len: int | None = None,
    optimizer: str = "adam",
    precision: str = "fp32",
    estimator: str = DEFAULT,
    history: HistoryStore | None = None,
    model_factory: str | None = None,
    attention: str | None = None,
) -> Estimate:
    """Estimate a training job's peak GPU memory (MiB, as nvidia-smi reports it).

    ``summary`` is summary text (any supported format) or a parsed summary. When a
    ``history`` store has measured peaks for the same fingerprint, sequence length,
    optimizer and precision, they win (:mod:`slurm_colloc.estimators.history_scaling`):
    the estimator is ``history`` (same batch size), ``history-fit`` (two or more other batch sizes)
    or ``history-anchored`` (one other batch size plus this estimator's growth).
    ``attention`` (``eager``, ``sdpa``, ``flash``) is the job's attention
    implementation; None takes what the summary shows, else eager (the safe side).
    """
    parsed = parse_summary(summary) if isinstance(summary, str) else summary
    job = Job(batch_size=batch_size, seq_len=seq_len, optimizer=optimizer, precision=precision,
              attention=attention)
    est = get(estimator, model_factory=model_factory)
    if history is None:
        return est.estimate(parsed, job)
    fp = parsed.fingerprint()
    points = history.peaks(fp, seq_len, optimizer, precision)
    result = _from_history(points, parsed, job, est, estimator) if points else \
        est.estimate(parsed, job)
    if isinstance(history, HistoryBounds):
        return _raised_to_bounds(result, history.floors(fp, seq_len, optimizer, precision),
                                 batch_size)
    return result


def _raised_to_bounds(result: Estimate, bounds: dict[int, int], batch_size: int) -> Estimate:
    """``result``, raised to the lower bounds of incomplete runs (issue 27): a peak
    sampled with gaps, or of a killed run, is at least what the job needs, so it may
    raise the estimate (plus the history margin), never lower it."""
    below = [p for b, p in bounds.items() if 0 < b <= batch_size and p > 0]
    if not below:
        return result
    floor = math.ceil(max(below) * (1 + HISTORY_MARGIN))
    if floor <= result.estimate_mib:
        return result
    notes = result.notes
    notes.append(f"raised from {result.estimate_mib} MiB to {floor} MiB: an incomplete "
                 f"run of this model reached {max(below)} MiB")
    return dataclasses.replace(
        result, estimate_mib=floor,
        breakdown={**result.breakdown, "incomplete_run_floor":
                   float(floor - result.estimate_mib)},
        uncertainty={**result.uncertainty, "notes": notes, "floor_mib": floor})


def _from_history(points: dict[int, int], parsed: ModelSummary, job: Job, est: Estimator,
                  estimator: str) -> Estimate:
    """An estimate from measured peaks of the same model (see :mod:`.history_scaling`)."""
    cold: dict[int, Estimate] = {}

    def cold_mib(b: int) -> int:
        if b not in cold:
            cold[b] = est.estimate(parsed, dataclasses.replace(job, batch_size=b))
        return cold[b].estimate_mib

    s = scale_history(points, job.batch_size, cold_mib)
    if s is None:  # no usable point (a 0 MiB peak)
        return est.estimate(parsed, job)
    margin = max(0, s.estimate_mib - math.ceil(s.peak_mib))
    notes = [f"{s.basis} ({estimator} estimate {'also used' if cold else 'not used'})"]
    return Estimate(
        estimate_mib=s.estimate_mib,
        estimator=s.estimator,
        breakdown={"measured_peak" if s.method == "exact" else "inferred_peak":
                   float(s.estimate_mib - margin), "margin": float(margin)},
        margin_mib=margin,
        fingerprint=parsed.fingerprint(),
        uncertainty={"basis": s.basis, "history_points": len(points), "notes": notes},
    )
