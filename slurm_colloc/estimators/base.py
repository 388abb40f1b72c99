"""The estimator interface: a job description in, an :class:`Estimate` out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from slurm_colloc.estimators.errors import EstimatorInputError
from slurm_colloc.estimators.model import ModelSummary
from slurm_colloc.estimators.physics import OPTIMIZERS, PRECISIONS

ATTENTION_IMPLS = ("eager", "sdpa", "flash")
MAX_BATCH_SIZE = 1 << 20
MAX_SEQ_LEN = 1 << 22


@dataclass(frozen=True)
class Job:
    """What, besides the model, decides a training job's memory."""

    batch_size: int
    seq_len: int | None = None
    optimizer: str = "adam"
    precision: str = "fp32"
    attention: str | None = None
    """``eager``, ``sdpa`` or ``flash``; None: from what the summary shows, else eager."""

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
            raise EstimatorInputError(f"batch size must be an integer, got {self.batch_size!r}")
        if not 1 <= self.batch_size <= MAX_BATCH_SIZE:
            raise EstimatorInputError(
                f"batch size {self.batch_size} is out of range (1..{MAX_BATCH_SIZE})")
        if self.seq_len is not None and not 1 <= self.seq_len <= MAX_SEQ_LEN:
            raise EstimatorInputError(f"sequence length {self.seq_len} is out of range "
                                      f"(1..{MAX_SEQ_LEN})")
        if self.optimizer not in OPTIMIZERS:
            raise EstimatorInputError(f"unknown optimizer {self.optimizer!r}; "
                                      f"one of {', '.join(OPTIMIZERS)}")
        if self.attention is not None and self.attention not in ATTENTION_IMPLS:
            raise EstimatorInputError(f"unknown attention implementation {self.attention!r}; "
                                      f"one of {', '.join(ATTENTION_IMPLS)}")
        if self.precision not in PRECISIONS:
            raise EstimatorInputError(f"unknown precision {self.precision!r}; "
                                      f"one of {', '.join(PRECISIONS)}")


@dataclass(frozen=True)
class Estimate:
    """An estimator's answer. ``estimate_mib`` includes ``margin_mib``; the breakdown
    (MiB per component, margin included as ``margin``) adds up to it."""

    estimate_mib: int
    estimator: str
    breakdown: dict[str, float]
    margin_mib: int
    fingerprint: str
    uncertainty: dict[str, object] = field(default_factory=dict)

    @property
    def notes(self) -> list[str]:
        """The uncertainty notes (assumptions the estimate rests on)."""
        notes = self.uncertainty.get("notes", [])
        return [str(n) for n in notes] if isinstance(notes, list) else []

    def to_json(self) -> dict[str, object]:
        """The ``colloc estimate --json`` object (a stable contract)."""
        return {
            "estimate_mib": self.estimate_mib,
            "estimator": self.estimator,
            "breakdown": {k: round(v, 1) for k, v in self.breakdown.items()},
            "margin_mib": self.margin_mib,
            "fingerprint": self.fingerprint,
            "uncertainty": self.uncertainty,
        }


class Estimator(Protocol):
    """One way of estimating peak GPU memory (nvidia-smi ``memory.used``) of a job."""

    name: str

    def estimate(self, summary: ModelSummary, job: Job) -> Estimate:
        """Estimate the job's peak GPU memory."""
        ...
