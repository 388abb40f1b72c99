"""The trace model: jobs with arrival times and measured profiles, and their CSV form.

All times in a trace are *trace seconds* (what the job would take on a real GPU);
the replayer compresses them by a time scale. Memory is in MiB.
"""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass, fields
from pathlib import Path

SIZE_CLASSES = ("light", "medium", "heavy")


@dataclass(frozen=True)
class TraceJob:
    """One training job of a trace."""

    name: str
    arrival_s: float
    """Submission time, trace seconds after the trace starts."""
    size_class: str
    model: str
    batch_size: int
    peak_mib: int
    """True peak GPU memory (measured for this model and batch size)."""
    steady_mib: int
    """Memory held from the start; grows to ``peak_mib`` at ``peak_at`` of the work."""
    peak_at: float
    sm_pct: float
    """SM activity (DCGM SMACT) alone on a GPU, %: mapped from the measured GPU utilisation
    of a similar job (:func:`slurm_colloc.gpu.sim.activity.sm_activity_from_util`)."""
    work_s: float
    """Run time alone on a whole GPU, trace seconds."""
    guess_mib: int
    """What the user asks for when no tool helps (shards policy, explicit --colloc-mem)."""
    summary: str = ""
    """Model whose summary file the user passes to ``--colloc`` ('' = none exists)."""
    source: str = ""
    """Where the profile came from (data set and row)."""
    gpus: int = 1
    """GPUs the job uses (data parallel: one rank per GPU, each with this profile)."""
    user: str = ""
    """Unix user who submits it ('' = root); separate users get separate MPS servers."""
    util_pct: float = 0.0
    """nvidia-smi GPU utilisation alone (the measurement ``sm_pct`` was mapped from);
    0 = not known (traces before issue 24)."""

    def __post_init__(self) -> None:
        if self.size_class not in SIZE_CLASSES:
            raise ValueError(f"{self.name}: size class {self.size_class!r}")
        if not 0 < self.steady_mib <= self.peak_mib:
            raise ValueError(f"{self.name}: need 0 < steady_mib <= peak_mib")
        if not 0.0 <= self.peak_at <= 1.0:
            raise ValueError(f"{self.name}: peak_at {self.peak_at} not in [0, 1]")
        if self.work_s <= 0 or self.arrival_s < 0:
            raise ValueError(f"{self.name}: work_s must be > 0 and arrival_s >= 0")
        if self.gpus < 1:
            raise ValueError(f"{self.name}: gpus must be >= 1")


@dataclass(frozen=True)
class Trace:
    """A named list of jobs and the GPUs it is meant for."""

    name: str
    description: str
    gpus: int
    gpu_memory_mib: int
    jobs: tuple[TraceJob, ...]

    @property
    def total_work_s(self) -> float:
        """GPU-seconds of work on whole GPUs (solo run time x GPUs, summed)."""
        return sum(j.work_s * j.gpus for j in self.jobs)

    def class_counts(self) -> dict[str, int]:
        """Jobs per size class."""
        return {c: sum(1 for j in self.jobs if j.size_class == c) for c in SIZE_CLASSES}


_FIELDS = [f.name for f in fields(TraceJob)]
_OPTIONAL = {"gpus", "user", "util_pct"}
"""Columns older trace CSVs (before issues 14 and 24) do not have."""
_INT = {"batch_size", "peak_mib", "steady_mib", "guess_mib", "gpus"}
_FLOAT = {"arrival_s", "peak_at", "sm_pct", "work_s", "util_pct"}


def jobs_to_csv(jobs: tuple[TraceJob, ...] | list[TraceJob]) -> str:
    """CSV text, one row per job, header = field names."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_FIELDS, lineterminator="\n")
    w.writeheader()
    for j in jobs:
        w.writerow(asdict(j))
    return buf.getvalue()


def jobs_from_csv(text: str) -> tuple[TraceJob, ...]:
    """Inverse of :func:`jobs_to_csv`; unknown or missing columns are errors."""
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames is None or not (
        set(_FIELDS) - _OPTIONAL <= set(reader.fieldnames) <= set(_FIELDS)
    ):
        raise ValueError(f"trace CSV columns must be {_FIELDS}, got {reader.fieldnames}")
    out = []
    for row in reader:
        kw: dict[str, object] = {}
        for k, v in row.items():
            kw[k] = int(v) if k in _INT else float(v) if k in _FLOAT else v
        out.append(TraceJob(**kw))  # type: ignore[arg-type]
    return tuple(out)


def write_trace(trace: Trace, path: Path) -> None:
    """Write the jobs of ``trace`` as CSV."""
    path.write_text(jobs_to_csv(trace.jobs))
