"""Where a replay's time went, per run and policy, from the committed run CSVs.

    python benchmarks/replay_breakdown.py TRACE [--results DIR] [--out FILE]

For every ``<results>/<TRACE>/x<scale>/run<N>/``: per policy, the median and mean
*stretch* of completed jobs (last attempt's run time / solo work: interference and
time slicing; 1.0 = as fast as alone), the trace hours from the first start of a
multi-GPU job to the end of the last one (exclusive-node jobs), the makespan, and the
share of GPU samples idle while a job waited, over the whole run and before the first
multi-GPU job started (Slurm latency plus draining the node for it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from slurm_colloc.bench import lag as L
from slurm_colloc.bench.metrics import idle_while_queued

RESULTS = Path(__file__).resolve().parent / "results"


def breakdown(run_dir: Path, name: str, scale: float = 120.0) -> dict[str, dict[str, float]]:
    """Per policy figures of one run (``scale``: its time scale, for the sample clock)."""
    jobs = pd.read_csv(run_dir / f"{name}_jobs.csv")
    tr = pd.read_csv(run_dir / f"{name}_trace.csv")
    if "gpus" not in tr:
        tr["gpus"] = 1
    ts = pd.read_csv(run_dir / f"{name}_gpu_timeseries.csv")
    j = jobs.merge(tr[["name", "work_s", "gpus", "steady_mib"]], left_on="job", right_on="name")
    out: dict[str, dict[str, float]] = {}
    for policy, g in j.groupby("policy"):
        done = g[g.state == "COMPLETED"]
        # single-attempt jobs only: a requeued job's start_h is its first attempt's
        one = done[done.attempts == 1]
        stretch = (one.end_h - one.start_h) / (one.work_s / 3600.0)
        multi = g[g.gpus > 1]
        r = {"makespan_h": round(float(g.end_h.max()), 3),
             "stretch_median": round(float(stretch.median()), 3),
             "stretch_mean": round(float(stretch.mean()), 3)}
        waits = list(zip(g.submit_h, g.start_h, strict=True))
        s = ts[(ts.policy == policy) & (ts.t_h >= 0) & (ts.t_h <= float(g.end_h.max()))]
        samples = list(zip(s.t_h, s.processes, strict=True))
        r["idle_while_waiting"] = round(idle_while_queued(samples, waits), 4)
        if len(multi):
            cut = float(multi.start_h.min())
            r["idle_while_waiting_before_multi_gpu"] = round(
                idle_while_queued([x for x in samples if x[0] < cut], waits), 4)
            r["multi_gpu_first_start_h"] = round(float(multi.start_h.min()), 3)
            r["multi_gpu_last_end_h"] = round(float(multi.end_h.max()), 3)
            r["multi_gpu_span_h"] = round(float(multi.end_h.max() - multi.start_h.min()), 3)
        r.update(_weighted_stretch(g, ts[ts.policy == policy], scale))
        out[str(policy)] = r
    return out


def _weighted_stretch(g: pd.DataFrame, ts: pd.DataFrame, scale: float) -> dict[str, float]:
    """Work-weighted stretch by Slurm's times and by GPU time (start lag removed, issue 24)."""
    jobs = [L.JobTimes(str(r.job), r.submit_h, r.start_h, r.end_h, int(r.steady_mib),
                       int(r.gpus), r.work_s / 3600, r.state == "COMPLETED", int(r.attempts))
            for r in g.itertuples() if r.start_h == r.start_h and r.end_h == r.end_h]
    samples = list(zip(ts.t_h, ts.gpu, ts.memory_mib, ts.processes, strict=True))
    period = L.sample_period_s(samples, scale)
    lags = L.debiased(L.match_lags(jobs, L.steps(samples)), L.quantisation_h(period, scale))
    slurm, gpu = L.stretch(jobs, L.filled(lags))
    return {"stretch_work_weighted_slurm": round(slurm, 3),
            "stretch_work_weighted_gpu": round(gpu, 3)}


def main(argv: list[str] | None = None) -> int:
    """Print (and optionally write) the JSON: run dir -> policy -> figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    runs = sorted((a.results / a.trace).glob(f"x*/run*/{a.trace}_jobs.csv"))
    r = {str(p.parent.relative_to(a.results)):
         breakdown(p.parent, a.trace, float(p.parent.parent.name.lstrip("x"))) for p in runs}
    text = json.dumps(r, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
