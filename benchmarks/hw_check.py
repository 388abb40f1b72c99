"""The replay's GPU models against a GPU measured with ``benchmarks/hw_colocation.py``.

    PYTHONPATH=. python benchmarks/hw_check.py [--gpu h100|h200] [RUN.json ...] [--out FILE]

Reads the committed runs of one GPU (``--gpu``, default ``h100``:
``benchmarks/results/hardware/<gpu>_colocation_run*.json``, or the runs named) and
prints, then writes to ``benchmarks/results/hardware/<gpu>_check.json``:

* **interference**: each tenant's measured speed (steps per second over its solo speed
  in the same run) next to the replay's prediction (``rate_for`` of
  ``slurm_colloc/gpu/sim/interference``, with each tenant's MPS server as in the run)
  fed with the tenants' solo SM activity (GPM, as the sim's traces carry it). The error is the
  absolute slowdown error, as in ``interference_fit.py``; per regime (mode, tenants,
  summed solo SM activity), and the run-to-run noise of the same combination.
* **power**: measured board power (NVML's energy counter) against
  :func:`~slurm_colloc.gpu.sim.power.power_w` at the measured SM and DRAM activity,
  scaled to the GPU's idle and limit, for GEMM/small-kernel runs and runs with copies
  apart; then ``idle + (max - idle) * min(1, floor + k * s**gamma)`` fitted on the
  first run's compute rows and scored on the second's (held out): what the GPU's
  tensor-core kernels draw (``<gpu>_fit``), which the replay does not adopt (its jobs'
  kernel mix is unknown).
* **util vs SM activity**: what NVML's utilisation and GPM's SM activity read on the
  same runs.

The workloads are synthetic (bf16 GEMMs with CPU pauses, small fp32 GEMMs, copies): the
check says where the model's shape is wrong, not what a given training job does.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from slurm_colloc.gpu.sim.interference import rate_for

RESULTS = Path(__file__).parent / "results" / "hardware"


def _solo(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per workload: solo speed, SM activity, util, DRAM (mean of the modes' solo runs)."""
    acc: dict[str, list[dict[str, float]]] = {}
    for mode in runs:
        for r in mode["runs"]:
            if len(r["combo"]) == 1:
                t = r["tenants"][0]
                acc.setdefault(r["combo"], []).append({
                    "rate": t["steps"] / t["elapsed"], "sm": r["sm_active_pct"],
                    "util": r["nvml_util_pct"], "dram": r["dram_bw_pct"],
                    "power": r["power_w"]})
    return {w: {k: float(np.mean([x[k] for x in xs])) for k in xs[0]} for w, xs in acc.items()}


@dataclass(frozen=True)
class _Proc:
    """A tenant as the simulation's ``rate_for`` sees it."""

    pid: int
    sm_pct: float
    mps_server: int


def _server(mode: str, i: int) -> int:
    """The MPS server of tenant ``i``: none (ts), one (mps1), alternating two (mps2)."""
    return {"ts": 0, "mps1": 1, "mps2": 1 + i % 2}[mode]


def interference_rows(doc: dict[str, Any], run: str) -> list[dict[str, Any]]:
    solo = _solo(doc["modes"])
    rows = []
    for mode in doc["modes"]:
        for r in mode["runs"]:
            combo = r["combo"]
            if len(combo) < 2:
                continue
            demands = [solo[w]["sm"] for w in combo]
            procs = [_Proc(i + 1, d, _server(mode["mode"], i)) for i, d in enumerate(demands)]
            for i, (w, t) in enumerate(zip(combo, r["tenants"], strict=True)):
                meas = solo[w]["rate"] / (t["steps"] / t["elapsed"])
                pred = 1.0 / rate_for(procs, i + 1)
                rows.append({"run": run, "mode": mode["mode"], "combo": combo, "tenant": i,
                             "workload": w, "n": len(combo), "summed_sm": sum(demands),
                             "slowdown": meas, "pred": pred, "err": abs(pred - meas)})
    return rows


def _regime(s: float) -> str:
    return "<100%" if s < 100 else ("100-160%" if s <= 160 else ">160%")


def _stats(x: pd.Series) -> dict[str, float]:
    return {"n": len(x), "median": round(float(x.median()), 3),
            "p90": round(float(x.quantile(0.9)), 3), "mean": round(float(x.mean()), 3)}


def interference(frame: pd.DataFrame) -> dict[str, Any]:
    frame = frame.assign(regime=frame.summed_sm.map(_regime),
                         tenants=frame.n.map(lambda n: "4+" if n >= 4 else str(n)))
    out: dict[str, Any] = {"all": _stats(frame.err)}
    out["by_mode"] = {m: _stats(g.err) for m, g in frame.groupby("mode")}
    out["by_mode_tenants"] = {f"{m} {n}": _stats(g.err)
                              for (m, n), g in frame.groupby(["mode", "tenants"])}
    out["by_mode_regime"] = {f"{m} {r}": _stats(g.err)
                             for (m, r), g in frame.groupby(["mode", "regime"])}
    # total work done per GPU (sum of speeds): what a replay's makespan follows
    tot = frame.groupby(["run", "mode", "combo"]).agg(
        measured=("slowdown", lambda s: float(np.sum(1 / s))),
        predicted=("pred", lambda s: float(np.sum(1 / s))))
    out["throughput_sum"] = {
        f"{m} {c}": {"measured": round(float(g.measured.mean()), 3),
                     "predicted": round(float(g.predicted.mean()), 3)}
        for (m, c), g in tot.reset_index().groupby(["mode", "combo"])}
    runs = sorted(frame.run.unique())
    if len(runs) >= 2:
        a = frame[frame.run == runs[0]].set_index(["mode", "combo", "tenant"]).slowdown
        b = frame[frame.run == runs[1]].set_index(["mode", "combo", "tenant"]).slowdown
        both = a.index.intersection(b.index)
        out["run_to_run"] = _stats((a[both] - b[both]).abs())
    return out


def power_rows(doc: dict[str, Any], run: str) -> list[dict[str, Any]]:
    rows = []
    idle = doc["idle"]["power_w"]
    for mode in doc["modes"]:
        for r in mode["runs"]:
            rows.append({"run": run, "mode": mode["mode"], "combo": r["combo"],
                         "sm": r["sm_active_pct"], "dram": r["dram_bw_pct"],
                         "util": r["nvml_util_pct"], "power": r["power_w"], "idle": idle,
                         "max": doc["gpu"]["power_limit_w"]})
    return rows


def concave(th: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Load (share of max - idle) at SM activity ``s``: ``min(1, floor + k * s**gamma)``."""
    floor, k, gamma = th
    load: np.ndarray = np.minimum(1.0, floor + k * np.power(s, gamma))
    return load


def fit_power(frame: pd.DataFrame, floor: float) -> np.ndarray:
    """``k, gamma`` by grid search on absolute load error, ``floor`` fixed."""
    s = frame.sm.to_numpy() / 100
    y = ((frame.power - frame.idle) / (frame["max"] - frame.idle)).to_numpy()
    grid = itertools.product(np.linspace(0.3, 2.0, 86), np.linspace(0.3, 1.5, 61))
    k, g = min(grid, key=lambda kg: float(np.mean(np.abs(
        concave(np.array([floor, *kg]), s) - y))))
    return np.array([floor, k, g])


def _rel(pred: pd.Series | np.ndarray, frame: pd.DataFrame) -> pd.Series:
    return (pd.Series(np.asarray(pred), index=frame.index) - frame.power).abs() / frame.power


def power(frame: pd.DataFrame, gpu: str = "h100") -> dict[str, Any]:
    """The replay's power model on the measured rows, and a concave fit held out
    (``<gpu>_fit``)."""
    from slurm_colloc.gpu.sim import power as pm

    frame = frame[frame.sm > 0].copy()
    frame["model"] = [pm.power_w(r.sm, r.idle, r["max"], r.dram) for _, r in frame.iterrows()]
    copies = frame.combo.str.contains("B")
    compute, copy = frame[~copies], frame[copies]
    runs = sorted(frame.run.unique())
    fit_on, held = compute[compute.run == runs[0]], compute[compute.run == runs[-1]]
    th = fit_power(fit_on, pm.ACTIVE_FLOOR)
    pred = held.idle + (held["max"] - held.idle) * concave(th, held.sm.to_numpy() / 100)
    return {
        "model": {"active_floor": pm.ACTIVE_FLOOR, "k_sm": round(pm.K_SM, 3),
                  "k_dram": pm.K_DRAM},
        "model_error_compute": _stats(_rel(compute.model, compute)),
        "model_error_copies": _stats(_rel(copy.model, copy)),
        "model_bias_compute_w": round(float((compute.model - compute.power).median()), 1),
        f"{gpu}_fit": {"floor": float(th[0]), "k_sm": round(float(th[1]), 3),
                       "gamma": round(float(th[2]), 3), "fitted_on": runs[0],
                       "held_out": runs[-1],
                       "held_out_error": _stats(_rel(pred, held))},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--gpu", default="h100", choices=["h100", "h200"],
                    help="whose committed runs and check file (default h100)")
    ap.add_argument("--out", help="default: results/hardware/<gpu>_check.json; '-': none")
    args = ap.parse_args()
    gpu = args.gpu
    out = args.out or str(RESULTS / f"{gpu}_check.json")
    paths = args.runs or sorted(RESULTS.glob(f"{gpu}_colocation_run*.json"))
    if not paths:
        ap.error(f"no runs: {RESULTS}/{gpu}_colocation_run*.json")
    docs = {p.stem: json.loads(p.read_text()) for p in paths}
    inter = pd.DataFrame([r for name, d in docs.items() for r in interference_rows(d, name)])
    pw = pd.DataFrame([r for name, d in docs.items() for r in power_rows(d, name)])
    first = next(iter(docs.values()))
    idle_ctx = {m["mode"]: round(m["idle_with_contexts"]["power_w"], 1) for m in first["modes"]}
    solo = _solo(first["modes"])
    result = {
        "gpu": first["gpu"], "runs": list(docs),
        "solo": {w: {k: round(v, 2) for k, v in s.items()} for w, s in solo.items()},
        "idle_w": round(first["idle"]["power_w"], 1),
        "idle_with_4_idle_contexts_w": idle_ctx,
        "interference": interference(inter), "power": power(pw, gpu),
    }
    print(f"{result['gpu']['name']}, driver {result['gpu']['driver']}; runs: {', '.join(docs)}")
    print("\nsolo workloads (speed, GPM SM activity %, NVML util %, DRAM %, W):")
    for w, s in result["solo"].items():
        print(f"  {w}: {s['rate']:7.1f}/s  sm {s['sm']:5.1f}  util {s['util']:5.1f}  "
              f"dram {s['dram']:5.1f}  {s['power']:5.0f} W")
    print(f"idle {result['idle_w']} W; with 4 idle CUDA contexts: {idle_ctx}")
    it = result["interference"]
    print("\ninterference, |predicted - measured| slowdown (median / p90, n):")
    for k, v in it["by_mode_tenants"].items():
        print(f"  {k:8s} {v['median']:.3f} / {v['p90']:.3f}  (n={v['n']})")
    for k, v in it["by_mode_regime"].items():
        print(f"  {k:14s} {v['median']:.3f} / {v['p90']:.3f}  (n={v['n']})")
    if "run_to_run" in it:
        r = it["run_to_run"]
        print(f"  run-to-run noise of the same tenant: median {r['median']:.3f}, "
              f"p90 {r['p90']:.3f}")
    print("\nwork per second on the GPU, in solo jobs' worth (measured vs predicted):")
    for k, v in it["throughput_sum"].items():
        print(f"  {k:10s} {v['measured']:5.2f}  vs {v['predicted']:5.2f}")
    p = result["power"]
    m, f = p["model"], p[f"{gpu}_fit"]
    print(f"\npower model (floor {m['active_floor']}, k_sm {m['k_sm']}, k_dram {m['k_dram']}),"
          " relative error median / p90:")
    print(f"  GEMM and small-kernel runs  {p['model_error_compute']['median']:.3f} / "
          f"{p['model_error_compute']['p90']:.3f} (bias {p['model_bias_compute_w']} W)")
    print(f"  runs with copies            {p['model_error_copies']['median']:.3f} / "
          f"{p['model_error_copies']['p90']:.3f}")
    print(f"  {gpu.upper()} fit min(1, {f['floor']} + {f['k_sm']} s^{f['gamma']}) on "
          f"{f['fitted_on']}, held out on {f['held_out']}: {f['held_out_error']['median']:.3f} / "
          f"{f['held_out_error']['p90']:.3f}")
    if out != "-":
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
