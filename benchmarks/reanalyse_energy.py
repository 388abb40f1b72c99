"""Common-window energy of committed replay results (issue 14), from their CSVs only.

    python benchmarks/reanalyse_energy.py [TRACE ...] [--results DIR] [--out FILE]

Reads ``<trace>_jobs.csv`` (end of every job, trace hours) and
``<trace>_gpu_timeseries.csv`` (each GPU's cumulative energy counter) of a replay and
recomputes each policy's energy over the *common* window, trace start until the last
policy finished (idle power after a policy's own makespan counts), and per completed
GPU-hour of work (``<trace>_trace.csv`` gives each job's work). Used to correct
results committed before the fair replay existed (philly90, heavy60 at x120).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

RESULTS = Path(__file__).resolve().parent / "results"


def _energy_at(ts: pd.DataFrame, t_h: float) -> float:
    """Joules of all GPUs' counters from the first sample until ``t_h`` (interpolated)."""
    total = 0.0
    for _, g in ts.groupby("gpu"):
        g = g.sort_values("t_h")
        t, e = g.t_h.to_numpy(), g.energy_j.to_numpy()
        total += float(np.interp(t_h, t, e)) - float(e[0])  # clamps outside the samples
    return total


def reanalyse(results: Path, trace: str) -> dict[str, dict[str, float]]:
    """Per policy: own-makespan and common-window energy, ratios, kWh per done GPU-h."""
    jobs = pd.read_csv(results / f"{trace}_jobs.csv")
    ts = pd.read_csv(results / f"{trace}_gpu_timeseries.csv")
    tr = pd.read_csv(results / f"{trace}_trace.csv")
    gpus = tr.get("gpus", 1)
    work_h = dict(zip(tr.name, tr.work_s * gpus / 3600.0, strict=True))
    ends = jobs.groupby("policy").end_h.max()
    common = float(ends.max())
    out: dict[str, dict[str, float]] = {}
    for policy, end in ends.items():
        s = ts[ts.policy == policy]
        done = jobs[(jobs.policy == policy) & (jobs.state == "COMPLETED")]
        gpu_h = float(sum(work_h.get(n, 0.0) for n in done.job))
        own = _energy_at(s, float(end)) / 3.6e6
        com = _energy_at(s, common) / 3.6e6
        out[str(policy)] = {"makespan_h": round(float(end), 3), "energy_own_kwh": round(own, 3),
                            "energy_common_kwh": round(com, 3),
                            "completed_gpu_h": round(gpu_h, 3),
                            "kwh_per_gpu_h": round(com / gpu_h, 4) if gpu_h else float("nan")}
    base = out.get("whole-gpu")
    if base:
        for r in out.values():
            r["energy_own_vs_whole"] = round(r["energy_own_kwh"] / base["energy_own_kwh"], 3)
            r["energy_common_vs_whole"] = round(
                r["energy_common_kwh"] / base["energy_common_kwh"], 3)
            r["kwh_per_gpu_h_vs_whole"] = round(r["kwh_per_gpu_h"] / base["kwh_per_gpu_h"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    """Print (and optionally write) the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", default=["philly90", "heavy60"])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    r = {t: reanalyse(a.results, t) for t in a.traces}
    text = json.dumps(r, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
