"""Recompute the lag-corrected figures of committed replay runs from their CSVs.

    python benchmarks/recorrect_lags.py DIR [DIR ...]

For every run directory under each DIR (``<trace>.csv`` beside ``<trace>_jobs.csv``,
``_trace.csv`` and ``_gpu_timeseries.csv``), the start-lag fields of each policy's row
(``start_lag_s``, both stretches, ``makespan_corrected_h``, the corrected energies and
their ratios to whole-gpu) are computed again with :func:`metrics.lag_fields` from the
run's own files, and ``<trace>.csv`` and the table of ``<trace>.md`` are rewritten.
Everything else in the row (raw makespan, energy, OOMs) is kept as measured.

Why: runs replayed before :func:`slurm_colloc.bench.lag.ledger_lags` took a requeued
job's late first sighting for a start lag (heavy60h-041: 5-8 trace hours) and removed it
from the corrected makespan. The measurements were right; only the arithmetic on them
changes, so the runs are recomputed instead of replayed again. Rebuild the summaries
afterwards with ``replay.py --summary-only``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pandas as pd

from slurm_colloc.bench import report
from slurm_colloc.bench.collect import JobOutcome
from slurm_colloc.bench.metrics import PolicyMetrics, lag_fields, relative_to
from slurm_colloc.bench.sampler import GpuPoint
from slurm_colloc.bench.trace import jobs_from_csv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay import read_metrics  # the replay driver's own CSV reader


def _wall(h: Any, scale: float) -> float | None:
    """Trace hours after trace start -> wall seconds after t0 = 0 (None for blanks)."""
    return None if h is None or pd.isna(h) else float(h) * 3600.0 / scale


def _text(v: Any) -> str:
    return "" if pd.isna(v) else str(v)


def outcomes_of(jobs: pd.DataFrame, policy: str, scale: float) -> list[JobOutcome]:
    """The jobs CSV's rows of one policy as outcomes on a clock with t0 = 0."""
    out = []
    rows: list[dict[Any, Any]] = jobs[jobs.policy == policy].to_dict("records")
    for r in rows:
        out.append(JobOutcome(
            str(r["job"]), int(r["job_id"]), str(r["state"]), int(r["attempts"]),
            _wall(r["submit_h"], scale) or 0.0, _wall(r["start_h"], scale),
            _wall(r["end_h"], scale), int(r["oom_crashes"]), int(r["requeues"]),
            _text(r["gres"]), None if pd.isna(r["need_mib"]) else int(r["need_mib"]),
            _text(r["mode"]), _wall(r.get("first_gpu_h"), scale)))
    return out


def points_of(ts: pd.DataFrame, policy: str, scale: float) -> list[GpuPoint]:
    """The time series' rows of one policy as sampler points on the same clock."""
    rows: list[dict[Any, Any]] = ts[ts.policy == policy].to_dict("records")
    return [GpuPoint(float(r["t_h"]) * 3600.0 / scale, int(r["gpu"]), int(r["memory_mib"]),
                     float(r["sm_pct"]), float(r["power_w"]), float(r["energy_j"]),
                     int(r["processes"])) for r in rows]


def recorrect(run_dir: Path, name: str) -> list[PolicyMetrics]:
    """The run's rows with the lag fields recomputed (ratios refilled)."""
    rows = read_metrics(run_dir / f"{name}.csv")
    jobs = pd.read_csv(run_dir / f"{name}_jobs.csv")
    ts = pd.read_csv(run_dir / f"{name}_gpu_timeseries.csv")
    trace = jobs_from_csv((run_dir / f"{name}_trace.csv").read_text())
    new = []
    for m in rows:
        scale = m.time_scale
        fields = lag_fields(outcomes_of(jobs, m.policy, scale), points_of(ts, m.policy, scale),
                            trace, t0=0.0, scale=scale, energy_kwh=m.energy_kwh)
        new.append(replace(m, **fields))  # type: ignore[arg-type]
    return relative_to(new)


def rewrite(run_dir: Path, name: str, rows: list[PolicyMetrics]) -> None:
    """``<trace>.csv`` anew; in ``<trace>.md`` the table between its header and the line
    after it replaced (the prose around it is kept)."""
    report.write_text(run_dir / f"{name}.csv", report.metrics_csv(rows))
    md = run_dir / f"{name}.md"
    if not md.exists():
        return
    lines = md.read_text().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("| policy |")), None)
    if start is None:
        return
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    table = report.markdown_table(rows).rstrip("\n").splitlines()
    md.write_text("\n".join([*lines[:start], *table, *lines[end:]]) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Recompute every run under the given directories; print what changed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path)
    a = p.parse_args(argv)
    found = 0
    for d in a.dirs:
        for csv_path in sorted(d.rglob("*.csv")):
            name = csv_path.stem
            run_dir = csv_path.parent
            if not all((run_dir / f"{name}_{part}.csv").exists()
                       for part in ("jobs", "trace", "gpu_timeseries")):
                continue
            found += 1
            old = {m.policy: m for m in read_metrics(csv_path)}
            rows = recorrect(run_dir, name)
            rewrite(run_dir, name, rows)
            for m in rows:
                was = asdict(old[m.policy])
                sys.stdout.write(
                    f"{run_dir} {m.policy}: makespan corrected vs whole "
                    f"{was['makespan_corrected_vs_whole']:.3f} -> "
                    f"{m.makespan_corrected_vs_whole:.3f}, lag {was['start_lag_s']:.2f} -> "
                    f"{m.start_lag_s:.2f} s\n")
    if not found:
        sys.stderr.write("no run directories found\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
