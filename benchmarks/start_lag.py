"""Start lag of replayed jobs (Slurm start -> first process on a GPU), per run and policy.

    python benchmarks/start_lag.py [--results DIR] [--out FILE]

Reads every committed ``<results>/<trace>/x<scale>/run<N>/`` (jobs CSV, trace CSV,
GPU time series, per-policy CSV) and prints, per run and policy: the start lag in
real seconds and trace minutes (median, p90, mean over the jobs recognised on a GPU,
:mod:`slurm_colloc.bench.lag`), its decomposition where the files allow it, and the
figures with the compression excess of that lag removed (makespan, ratio to
whole-gpu, energy over own makespan and over the common window, work-weighted stretch
by Slurm time and by GPU time). Then x60 against x120 per policy, raw and corrected,
with the x120 run-to-run spread. Writes the JSON to ``results/start_lag.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

import pandas as pd

from slurm_colloc.bench import lag as L

RESULTS = Path(__file__).resolve().parent / "results"
COLLOC = ("colloc", "colloc-oracle")


def _jobs(run_dir: Path, name: str) -> dict[str, list[L.JobTimes]]:
    jobs = pd.read_csv(run_dir / f"{name}_jobs.csv")
    tr = pd.read_csv(run_dir / f"{name}_trace.csv")
    if "gpus" not in tr:
        tr["gpus"] = 1
    j = jobs.merge(tr[["name", "gpus", "work_s", "steady_mib", "user"]],
                   left_on="job", right_on="name")
    out: dict[str, list[L.JobTimes]] = {}
    for r in j.itertuples():
        if not (math.isfinite(r.start_h) and math.isfinite(r.end_h)):
            continue
        out.setdefault(str(r.policy), []).append(L.JobTimes(
            str(r.job), float(r.submit_h), float(r.start_h), float(r.end_h),
            int(r.steady_mib), int(r.gpus), float(r.work_s) / 3600.0,
            r.state == "COMPLETED", int(r.attempts)))
    return out


def _q(v: list[float], q: float) -> float:
    if not v:
        return math.nan
    s = sorted(v)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _dist(lags_h: list[float], scale: float) -> dict[str, float]:
    real = [x * 3600 / scale for x in lags_h]
    return {"n": len(real), "real_s_median": round(_q(real, 0.5), 2),
            "real_s_p90": round(_q(real, 0.9), 2),
            "real_s_mean": round(statistics.fmean(real), 2) if real else math.nan,
            "trace_min_median": round(_q(lags_h, 0.5) * 60, 1),
            "trace_min_p90": round(_q(lags_h, 0.9) * 60, 1)}


def _first_on_gpu(jobs: list[L.JobTimes], lags: list[L.Lag], users: dict[str, str],
                  ) -> dict[str, bool]:
    """Matched job -> no job of its user was on its GPU when it started (MPS daemon start)."""
    by = {j.name: j for j in jobs}
    placed = [(lg, by[lg.name]) for lg in lags if lg.gpu is not None]
    out = {}
    for lg, j in placed:
        out[j.name] = not any(
            o.gpu == lg.gpu and users.get(o.name) == users.get(j.name) and oj.name != j.name
            and oj.start_h + (o.lag_h or 0) <= j.start_h < oj.end_h
            for o, oj in placed)
    return out


def _concurrent(starts: list[float], t: float, window_h: float) -> int:
    return max(0, sum(1 for s in starts if t - window_h <= s <= t) - 1)


def decompose(jobs: list[L.JobTimes], lags: list[L.Lag], users: dict[str, str],
              starts: dict[str, list[float]], scale: float) -> dict[str, object]:
    """Lag split by MPS daemon start and by how many prologs ran just before it.

    ``starts``: Slurm start times (trace hours) per policy of the run; every cluster
    shares the host, the colloc ones also run a prolog per start.
    """
    all_starts = sorted(t for v in starts.values() for t in v)
    prologs = sorted(t for p, v in starts.items() if p in COLLOC for t in v)
    got = {lg.name: lg.lag_h for lg in lags if lg.lag_h is not None}
    first = _first_on_gpu(jobs, lags, users)
    by = {j.name: j for j in jobs}
    out: dict[str, object] = {
        "first_of_user_on_gpu": _dist([got[n] for n, f in first.items() if f], scale),
        "joins_users_server": _dist([got[n] for n, f in first.items() if not f], scale)}
    win = 10 * scale / 3600  # 10 wall seconds before the start, every cluster of the run
    bins: dict[str, list[float]] = {"0-5": [], "6-11": [], "12-17": [], "18+": []}
    for n, lag_h in got.items():
        k = _concurrent(all_starts, by[n].start_h, win)
        bins["0-5" if k <= 5 else "6-11" if k <= 11 else "12-17" if k <= 17 else "18+"].append(
            lag_h)
    out["by_starts_in_previous_10_wall_s"] = {k: _dist(v, scale) for k, v in bins.items()}
    out["fit_vs_prologs_in_previous_10_wall_s"] = _fit(
        [(_concurrent(prologs, by[n].start_h, win), x * 3600 / scale) for n, x in got.items()])
    return out


def _fit(points: list[tuple[int, float]]) -> dict[str, float]:
    """Least squares lag_s = a + b * k: ``a`` an unloaded start, ``b`` per other prolog."""
    if len(points) < 3:
        return {}
    xs, ys = [float(k) for k, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    r = statistics.correlation(xs, ys) if sxx and len(set(ys)) > 1 else math.nan
    return {"intercept_s": round(my - b * mx, 2), "slope_s_per_prolog": round(b, 3),
            "r": round(r, 3), "k_median": statistics.median(xs), "n": len(points)}


def _load_points(jobs: list[L.JobTimes], lags: list[L.Lag], starts: dict[str, list[float]],
                 scale: float) -> list[tuple[int, float]]:
    """(colloc prologs started in the 10 wall s before, lag in real s) of matched jobs."""
    prologs = sorted(t for p, v in starts.items() if p in COLLOC for t in v)
    by = {j.name: j for j in jobs}
    win = 10 * scale / 3600
    return [(_concurrent(prologs, by[lg.name].start_h, win), lg.lag_h * 3600 / scale)
            for lg in lags if lg.lag_h is not None]


def held_out(all_runs: dict[str, dict[str, dict[str, object]]], fit_on: str,
             ) -> dict[str, object]:
    """Fit lag_s = a + b * prologs on the ``fit_on`` runs, predict every other run.

    Per policy; the prediction of a run is the median of a + b * k over its jobs,
    checked against the median lag measured there (never used in the fit).
    """
    out: dict[str, object] = {"fit_on": fit_on}
    for policy in ("whole-gpu", *COLLOC):
        train = [pt for lbl, pols in all_runs.items() if lbl.startswith(fit_on)
                 and policy in pols for pt in pols[policy]["load_points"]]  # type: ignore[attr-defined]
        f = _fit(train)
        if not f:
            continue
        checks = {}
        for lbl, pols in all_runs.items():
            if lbl.startswith(fit_on) or policy not in pols:
                continue
            pts = pols[policy]["load_points"]
            pred = statistics.median(f["intercept_s"] + f["slope_s_per_prolog"] * k
                                     for k, _ in pts)  # type: ignore[attr-defined]
            obs = statistics.median(y for _, y in pts)  # type: ignore[attr-defined]
            checks[lbl] = {"predicted_s": round(pred, 2), "measured_s": round(obs, 2),
                           "error_s": round(pred - obs, 2)}
        out[policy] = {"fit": f, "held_out": checks}
    return out


def _rate_points(jobs: dict[str, list[L.JobTimes]], lags: list[L.Lag], scale: float,
                 ) -> list[tuple[float, float]]:
    """(starts per wall s in the 60 s before, every cluster; lag in real s) per matched job."""
    all_starts = sorted(j.start_h for js in jobs.values() for j in js)
    by = {j.name: j for js in jobs.values() for j in js}
    win = 60 * scale / 3600
    return [(_concurrent(all_starts, by[lg.name].start_h, win) / 60, lg.lag_h * 3600 / scale)
            for lg in lags if lg.lag_h is not None]


def queue_fit(all_runs: dict[str, dict[str, dict[str, object]]], fit_on: tuple[str, ...],
              ) -> dict[str, object]:
    """Per-run median lag against the host's start rate: ``lag = s / (1 - c * rate)``.

    The host (2 cores, every cluster) as one queue: ``s`` the lag of an unloaded
    start, ``1 / c`` the start rate that saturates it. Fitted by grid search on the
    colloc runs of ``fit_on``, checked on the others.
    """
    pts = {(p, lbl): (statistics.median(x for x, _ in r["rate_points"]),  # type: ignore[attr-defined]
                      statistics.median(y for _, y in r["rate_points"]))  # type: ignore[attr-defined]
           for lbl, pols in all_runs.items() for p, r in pols.items()
           if p in COLLOC and r["rate_points"]}
    fit = [k for k in pts if k[1].startswith(fit_on)]

    def err(sv: float, c: float) -> float:
        if any(c * pts[k][0] >= 0.99 for k in fit):
            return math.inf
        return sum((sv / (1 - c * pts[k][0]) - pts[k][1]) ** 2 for k in fit)

    _, sv, c = min((err(a / 100, b / 1000), a / 100, b / 1000)
                   for a in range(5, 300, 5) for b in range(100, 1000, 5))
    rows = {f"{p} {lbl}": {"rate_per_s": round(r, 2), "measured_s": round(y, 2),
                           "predicted_s": round(sv / (1 - c * r), 2) if c * r < 1 else math.inf,
                           "held_out": (p, lbl) not in fit}
            for (p, lbl), (r, y) in sorted(pts.items())}
    return {"fit_on": list(fit_on), "s_unloaded_s": sv, "capacity_starts_per_s": round(1 / c, 2),
            "runs": rows}


def _idle_w(ts: pd.DataFrame) -> float:
    idle = ts[ts.processes == 0].power_w
    return float(idle.median()) if len(idle) else 0.0


def _samples(ts: pd.DataFrame) -> list[tuple[float, int, int, int]]:
    return list(zip(ts.t_h, ts.gpu, ts.memory_mib, ts.processes, strict=True))


def analyse_run(run_dir: Path, name: str, scale: float) -> dict[str, dict[str, object]]:
    """Per policy: lag distribution, decomposition, corrected figures."""
    jobs = _jobs(run_dir, name)
    ts = pd.read_csv(run_dir / f"{name}_gpu_timeseries.csv")
    met = pd.read_csv(run_dir / f"{name}.csv").set_index("policy")
    tr = pd.read_csv(run_dir / f"{name}_trace.csv")
    col = tr["user"] if "user" in tr else pd.Series([None] * len(tr))
    users = {n: (str(u) if isinstance(u, str) else "") for n, u in zip(tr.name, col, strict=True)}
    starts = {p: sorted(j.start_h for j in js) for p, js in jobs.items()}
    out: dict[str, dict[str, object]] = {}
    for policy, js in jobs.items():
        samples = _samples(ts[ts.policy == policy])
        period = L.sample_period_s(samples, scale)
        raw, exact = _exact_lags(run_dir, name, policy, js)
        if raw is None:  # no ledger in this run: read the lags off the samples
            raw = L.match_lags(js, L.steps(samples))
        lags = L.debiased(raw, L.quantisation_h(0.0 if exact else period, scale))
        r = _corrected(js, lags, scale, ts[ts.policy == policy],
                       float(met.loc[policy, "energy_kwh"]))
        r["sample_period_s"] = round(period, 3)
        r["lag_as_measured"] = _dist([lg.lag_h for lg in raw if lg.lag_h is not None], scale)
        r["decomposition"] = decompose(js, lags, users, starts, scale)
        r["load_points"] = _load_points(js, lags, starts, scale)
        r["rate_points"] = _rate_points(jobs, lags, scale)
        out[policy] = r
    _ratios(out)
    return out


def _exact_lags(run_dir: Path, name: str, policy: str, js: list[L.JobTimes],
                ) -> tuple[list[L.Lag] | None, bool]:
    """Lags from the jobs CSV's ``first_gpu_h`` (the replay's GPU ledger), if it has one."""
    jobs = pd.read_csv(run_dir / f"{name}_jobs.csv")
    if "first_gpu_h" not in jobs or jobs.first_gpu_h.isna().all():
        return None, False
    first = {str(j): float(f) for j, f, p in zip(jobs.job, jobs.first_gpu_h, jobs.policy,
                                                 strict=True) if p == policy and f == f}
    return L.ledger_lags(js, first), True


def _corrected(js: list[L.JobTimes], lags: list[L.Lag], scale: float, pts: pd.DataFrame,
               energy_kwh: float) -> dict[str, object]:
    lag_h = L.filled(lags)
    span, span_c = L.corrected_makespan(js, lag_h, scale)
    _, span_all = L.corrected_makespan(js, lag_h, scale, handovers=True)
    s_slurm, s_gpu = L.stretch(js, lag_h)
    gpus, idle = int(pts.gpu.nunique()), _idle_w(pts)
    return {
        "lag": _dist([lg.lag_h for lg in lags if lg.lag_h is not None], scale),
        "jobs": len(js), "matched": sum(1 for lg in lags if lg.lag_h is not None),
        "lag_job_h_total": round(sum(lag_h.values()), 2),
        "makespan_h": round(span, 3), "makespan_corrected_h": round(span_c, 3),
        "makespan_corrected_all_h": round(span_all, 3),
        "critical_chain_jobs": len(L.critical_chain(js)),
        "stretch_slurm": round(s_slurm, 3), "stretch_gpu": round(s_gpu, 3),
        "idle_w": idle, "gpus": gpus, "energy_kwh": round(energy_kwh, 3),
        "energy_corrected_kwh": round(
            L.corrected_energy_kwh(energy_kwh, span - span_c, gpus, idle), 3),
    }


def _ratios(out: dict[str, dict[str, object]]) -> None:
    """Ratios to whole-gpu, raw and corrected; energy over the (corrected) common window."""
    base = out.get("whole-gpu")
    common = max(float(r["makespan_h"]) for r in out.values())  # type: ignore[arg-type]
    common_c = max(float(r["makespan_corrected_h"]) for r in out.values())  # type: ignore[arg-type]
    for r in out.values():
        g, idle = int(r["gpus"]), float(r["idle_w"])  # type: ignore[call-overload, arg-type]
        r["energy_common_kwh"] = round(float(r["energy_kwh"]) + g * idle * (  # type: ignore[arg-type]
            common - float(r["makespan_h"])) / 1000, 3)  # type: ignore[arg-type]
        r["energy_common_corrected_kwh"] = round(float(r["energy_corrected_kwh"]) + g * idle * (  # type: ignore[arg-type]
            common_c - float(r["makespan_corrected_h"])) / 1000, 3)  # type: ignore[arg-type]
    if base is None:
        return
    for r in out.values():
        for k in ("makespan_h", "makespan_corrected_h", "makespan_corrected_all_h",
                  "energy_common_kwh",
                  "energy_common_corrected_kwh"):
            r[f"{k}_vs_whole"] = round(float(r[k]) / float(base[k]), 3)  # type: ignore[arg-type]


def runs(results: Path) -> list[tuple[str, str, float, Path]]:
    """(trace, run label, scale, dir) of every committed run.

    A multi-node replay's runs sit under ``<trace>_n<N>/`` (``replay.py --nodes N``):
    their files are the trace's, their label keeps the ``_n<N>`` so that one-node and
    multi-node runs are compared apart.
    """
    out = []
    for jobs in sorted(results.glob("*/x*/run*/*_jobs.csv")):
        d = jobs.parent
        m = re.fullmatch(r"x(\d+(?:\.\d+)?)", d.parent.name)
        group = d.parent.parent.name
        trace = group if (d / f"{group}_jobs.csv").exists() else re.sub(r"_n\d+$", "", group)
        if m and jobs.name == f"{trace}_jobs.csv":
            out.append((trace, f"{group}/{d.parent.name}/{d.name}", float(m.group(1)), d))
    return out


def compare_scales(all_runs: dict[str, dict[str, dict[str, object]]],
                   ) -> dict[str, dict[str, object]]:
    """Per trace and policy: ratio to whole-gpu per time scale, raw and corrected.

    ``spread``: max - min over the runs of the most-run scale (run-to-run spread);
    ``agree``: every other scale's median within that spread of its median, widened
    by the smaller scale's own spread where it has several runs.
    """
    out: dict[str, dict[str, object]] = {}
    groups: dict[tuple[str, str, str], list[float]] = {}
    for label, pols in all_runs.items():
        trace, scale, _ = label.split("/")
        for pol, r in pols.items():
            for key in ("makespan_h_vs_whole", "makespan_corrected_h_vs_whole",
                        "makespan_corrected_all_h_vs_whole", "stretch_slurm", "stretch_gpu",
                        "makespan_h", "makespan_corrected_h", "makespan_corrected_all_h",
                        "energy_common_kwh_vs_whole", "energy_common_corrected_kwh_vs_whole"):
                if key in r:
                    groups.setdefault((trace, pol, key), []).append(float(r[key]))  # type: ignore[arg-type]
                    groups.setdefault((trace, pol, f"{key}@{scale}"), []).append(
                        float(r[key]))  # type: ignore[arg-type]
    scales = sorted({lbl.split("/")[1] for lbl in all_runs})
    for (trace, pol, key), _ in sorted(groups.items()):
        if "@" in key:
            continue
        per = {s: groups.get((trace, pol, f"{key}@{s}"), []) for s in scales}
        per = {s: v for s, v in per.items() if v}
        if len(per) < 2:
            continue
        ref = max(per, key=lambda s: len(per[s]))
        spread = max(per[ref]) - min(per[ref])
        med = {s: statistics.median(v) for s, v in per.items()}
        diff = {s: round(med[s] - med[ref], 3) for s in per if s != ref}
        out.setdefault(f"{trace}/{pol}", {})[key] = {
            "median": {s: round(m, 3) for s, m in med.items()},
            "runs": {s: len(v) for s, v in per.items()}, "reference": ref,
            "spread": round(spread, 3), "diff_from_reference": diff,
            "within_spread": all(abs(d) <= spread / 2 + 1e-9 or
                                 min(per[ref]) <= med[s] <= max(per[ref])
                                 for s, d in diff.items())}
    return out


def table(all_runs: dict[str, dict[str, dict[str, object]]]) -> str:
    """One line per run and policy."""
    lines = ["run | policy | matched/jobs | lag real s med [p90] | lag trace min med "
             "| makespan h raw -> corr -> +handovers | vs whole raw -> corr -> +handovers "
             "| stretch Slurm / GPU | energy common kWh raw -> corr"]
    for label, pols in all_runs.items():
        for pol, r in pols.items():
            lg = r["lag"]
            assert isinstance(lg, dict)
            lines.append(
                f"{label} | {pol} | {r['matched']}/{r['jobs']} | {lg['real_s_median']} "
                f"[{lg['real_s_p90']}] | {lg['trace_min_median']} | {r['makespan_h']} -> "
                f"{r['makespan_corrected_h']} -> {r['makespan_corrected_all_h']} | "
                f"{r.get('makespan_h_vs_whole', '')} -> "
                f"{r.get('makespan_corrected_h_vs_whole', '')} -> "
                f"{r.get('makespan_corrected_all_h_vs_whole', '')} | {r['stretch_slurm']} / "
                f"{r['stretch_gpu']} | {r['energy_common_kwh']} -> "
                f"{r['energy_common_corrected_kwh']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the table and the scale comparison; write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=RESULTS / "start_lag.json")
    a = ap.parse_args(argv)
    all_runs = {label: analyse_run(d, trace, scale)
                for trace, label, scale, d in runs(a.results)}
    cmp_ = compare_scales(all_runs)
    check = held_out(all_runs, "philly90h/x120/")
    queue = queue_fit(all_runs, ("heavy60h/", "philly90h/x120/"))
    for pols in all_runs.values():
        for r in pols.values():
            r.pop("load_points", None)
            r.pop("rate_points", None)
    sys.stdout.write(table(all_runs))
    for policy, v in check.items():
        if isinstance(v, dict):
            sys.stdout.write(f"load fit {policy} on {check['fit_on']}: {json.dumps(v['fit'])}\n")
            for lbl, c in v["held_out"].items():
                sys.stdout.write(f"  held out {lbl}: {json.dumps(c)}\n")
    for key, v in cmp_.items():
        for metric, c in v.items():  # type: ignore[union-attr]
            if metric.endswith("_vs_whole") or metric.startswith(("stretch", "makespan")):
                sys.stdout.write(f"{key} {metric}: {json.dumps(c)}\n")
    sys.stdout.write(f"queue fit on {queue['fit_on']}: s = {queue['s_unloaded_s']} s, "
                     f"capacity {queue['capacity_starts_per_s']} starts/s\n")
    for k, v in queue["runs"].items():  # type: ignore[attr-defined]
        sys.stdout.write(f"  {k}: {json.dumps(v)}\n")
    a.out.write_text(json.dumps({"runs": all_runs, "scales": cmp_, "load_fit": check,
                                 "queue_fit": queue},
                                indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
