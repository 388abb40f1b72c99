"""Measured job profiles and the model summaries users would pass to ``--colloc``.

* Lucid (ASPLOS '23) single-job measurements: GPU memory, GPU utilisation and speed
  of real training jobs alone on a GPU (``colocation/lucid_single_jobs.csv``).
* Measured peak memory of timm models at several batch sizes on an A100 40 GB
  (``gpu-memory/timm_a100_calibration.csv``).
* torchinfo summaries of the same timm models (``benchmarks/summaries``), the file a
  user would hand to ``sbatch --colloc=SUMMARY``.
"""

from __future__ import annotations

import csv
import json
import lzma
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SHARED_DATA = Path("/work/shared/data")
REPO_ROOT = Path(__file__).resolve().parents[2]
SUMMARY_FILES = (
    REPO_ROOT / "benchmarks" / "summaries" / "timm_torchinfo.jsonl.xz",
    REPO_ROOT / "benchmarks" / "summaries" / "timm_torchinfo.jsonl",
    REPO_ROOT / "benchmarks" / "summaries" / "timm_torchinfo.jsonl.partial.jsonl",
)
MAX_PLAUSIBLE_PEAK_MIB = 38 * 1024
"""Rows at or above this on a 40 GB card are runs that hit the card's limit."""


@dataclass(frozen=True)
class LucidProfile:
    """One row of the Lucid single-job measurements."""

    model: str
    dataset: str
    batch_size: int
    amp: bool
    speed: float
    gpu_util: float
    gmem_mib: int


def load_lucid(path: Path | None = None) -> list[LucidProfile]:
    """All Lucid single-job rows."""
    path = path or SHARED_DATA / "colocation" / "lucid_single_jobs.csv"
    with path.open() as f:
        return [
            LucidProfile(
                r["model"], r["dataset"], int(r["batchsize"]), r["amp"] == "1",
                float(r["speed"]), float(r["gpu_util"]), round(float(r["gmem"])),
            )
            for r in csv.DictReader(f)
        ]


def load_timm_peaks(path: Path | None = None) -> dict[tuple[str, int], int]:
    """(model, batch) -> measured peak MiB, keeping only plausible rows.

    A row is dropped when it reached the card's limit or when a larger batch of the
    same model measured *less* memory than a smaller one (a failed run).
    """
    path = path or SHARED_DATA / "gpu-memory" / "timm_a100_calibration.csv"
    by_model: dict[str, dict[int, int]] = {}
    with path.open() as f:
        for r in csv.DictReader(f):
            by_model.setdefault(r["model"], {})[int(r["batch_size"])] = int(
                r["measured_peak_mib"]
            )
    out: dict[tuple[str, int], int] = {}
    for model, rows in by_model.items():
        best = 0
        for batch in sorted(rows):
            peak = rows[batch]
            if peak < best or peak >= MAX_PLAUSIBLE_PEAK_MIB:
                break
            best = peak
            out[(model, batch)] = peak
    return out


def _summary_lines(path: Path) -> Iterator[str]:
    if path.suffix == ".xz":
        with lzma.open(path, "rt") as f:
            yield from f
    else:
        with path.open() as f:
            yield from f


def load_summaries(paths: tuple[Path, ...] = SUMMARY_FILES) -> dict[str, str]:
    """model -> torchinfo summary text, from whichever summary files exist."""
    out: dict[str, str] = {}
    for p in paths:
        if not p.exists():
            continue
        for line in _summary_lines(p):
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue  # a partial file may end mid-line
            if isinstance(d, dict) and isinstance(d.get("summary"), str):
                out.setdefault(str(d["model"]), d["summary"])
    return out
