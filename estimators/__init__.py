"""GPU-memory estimators for training jobs, from a model summary.

Pure Python, no torch, no Slurm: this runs on login nodes inside ``sbatch``.

    >>> from estimators import estimate, parse_summary
    >>> est = estimate(open("model.txt").read(), batch_size=32)
    >>> est.estimate_mib, est.breakdown

See ``docs/estimators.md`` for the formats, the estimators and their accuracy.
"""

from __future__ import annotations

import math

from estimators.base import Estimate, Estimator, Job
from estimators.errors import EstimatorInputError, SummaryParseError
from estimators.history import HISTORY_MARGIN, HistoryStore, SqliteHistory
from estimators.model import Layer, ModelSummary
from estimators.parsers import parse_summary, read_summary_file
from estimators.registry import DEFAULT, get, names

__all__ = [
    "Estimate",
    "Estimator",
    "EstimatorInputError",
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
) -> Estimate:
    """Estimate a training job's peak GPU memory (MiB, as nvidia-smi reports it).

    ``summary`` is summary text (any supported format) or a parsed summary. When a
    ``history`` store has a measured peak for the same fingerprint and job, that
    measurement (plus :data:`HISTORY_MARGIN`) wins and the estimator is ``history``.
    """
    parsed = parse_summary(summary) if isinstance(summary, str) else summary
    job = Job(batch_size=batch_size, seq_len=seq_len, optimizer=optimizer, precision=precision)
    est = get(estimator, model_factory=model_factory)
    if history is not None:
        fp = parsed.fingerprint()
        measured = history.lookup(fp, batch_size, seq_len, optimizer, precision)
        if measured is not None:
            margin = math.ceil(measured * HISTORY_MARGIN)
            return Estimate(
                estimate_mib=measured + margin,
                estimator="history",
                breakdown={"measured_peak": float(measured), "margin": float(margin)},
                margin_mib=margin,
                fingerprint=fp,
                uncertainty={"notes": [f"measured peak of an earlier run; {estimator} not used"]},
            )
    return est.estimate(parsed, job)
