"""Fit and held-out check of the simulated GPU's activity and power models (issue 24).

One command: ``.venv/bin/python benchmarks/power_fit.py [--json OUT]``. Prints

1. the utilisation -> SM activity curve (:mod:`slurm_colloc.gpu.sim.activity`), fitted
   on 70 % of GPUMemNet's A100 runs (split by a hash of the run's file name) and its
   error on the other 30 %;
2. the overlap weight of co-located tenants' busy shares, fitted on 70 % of the Lucid
   pairs (split by a hash of the model pair), with its error on the held-out 30 %, next
   to the capped sum the simulation used before;
3. the power model's anchors (:mod:`slurm_colloc.gpu.sim.power`) and its error on each.

Needs ``/work/shared/data``; writes nothing unless ``--json`` is given.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import statistics as st
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurm_colloc.gpu.sim import activity, power

DATA = Path("/work/shared/data")


def held_out(key: str) -> bool:
    """30 % of keys, by sha256 (the split of the estimator and interference fits)."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 1000 < 300


def errors(pairs: list[tuple[float, float]]) -> dict[str, float]:
    """Median and p90 absolute error (points of %) of (predicted, measured) pairs."""
    e = sorted(abs(p - m) for p, m in pairs)
    return {"n": len(e), "median": round(st.median(e), 2), "p90": round(e[int(0.9 * len(e))], 2)}


def util_curve() -> dict[str, object]:
    """Per-decile medians (fit split) and the held-out error of the stored curve."""
    rows = [(r["Filename"], float(r["Avg GPUTL"]), 100 * float(r["Avg SMACT"]))
            for r in csv.DictReader((DATA / "gpu-memory" / "gpumemnet_mlp_a100.csv").open())]
    fit = [(u, s) for f, u, s in rows if not held_out(f)]
    hold = [(u, s) for f, u, s in rows if held_out(f)]
    knots = []
    for lo in range(0, 100, 10):
        sel = [(u, s) for u, s in fit if lo <= u < lo + 10]
        if sel:
            knots.append((round(st.median(u for u, _ in sel), 1),
                          round(st.median(s for _, s in sel), 1)))
    bins = {}
    for lo, hi in ((20, 40), (40, 60), (60, 80), (80, 90)):
        sel = [s for u, s in hold if lo <= u < hi]
        mid = [activity.sm_activity_from_util(u) for u, _ in [(x, 0) for x in
               (u for u, _ in hold if lo <= u < hi)]]
        bins[f"{lo}-{hi}"] = {"measured": round(st.median(sel), 1),
                              "model": round(st.median(mid), 1), "n": len(sel)}
    return {"fitted_knots": knots, "stored_knots": list(activity.UTIL_TO_SMACT),
            "fit": errors([(activity.sm_activity_from_util(u), s) for u, s in fit]),
            "held_out": errors([(activity.sm_activity_from_util(u), s) for u, s in hold]),
            "held_out_bins": bins,
            "identity_held_out": errors([(min(100.0, u), s) for u, s in hold])}


def _pairs() -> list[tuple[str, float, float, float]]:
    col = DATA / "colocation"
    single = {(r["model"], r["dataset"], r["batchsize"], r["amp"]): float(r["gpu_util"])
              for r in csv.DictReader((col / "lucid_single_jobs.csv").open())}
    out = []
    for r in csv.DictReader((col / "lucid_colocated_pairs.csv").open()):
        a = single.get((r["model1"], r["dataset1"], r["batchsize1"], r["amp1"]))
        b = single.get((r["model2"], r["dataset2"], r["batchsize2"], r["amp2"]))
        if a is not None and b is not None:
            key = "|".join(sorted((r["model1"], r["model2"])))
            out.append((key, a, b, float(r["gpu_util"])))
    return out


def overlap() -> dict[str, object]:
    """Fit the overlap weight on the fit split; errors per regime on the held-out one."""
    rows = _pairs()
    fit = [r for r in rows if not held_out(r[0])]
    hold = [r for r in rows if held_out(r[0])]

    def med_err(w: float, rs: list[tuple[str, float, float, float]]) -> float:
        return st.median(abs(activity.combined_pct((a, b), w) - m) for _, a, b, m in rs)

    best = min((w / 100 for w in range(0, 101)), key=lambda w: med_err(w, fit))
    regimes = {}
    for lo, hi in ((0, 100), (100, 160), (160, 201)):
        sel = [r for r in hold if lo <= r[1] + r[2] < hi]
        regimes[f"sum {lo}-{hi}%"] = {
            "model": errors([(activity.combined_pct((a, b)), m) for _, a, b, m in sel]),
            "capped_sum": errors([(min(100.0, a + b), m) for _, a, b, m in sel])}
    ratio = [m / min(100.0, a + b) for _, a, b, m in rows]
    return {"fitted_weight": best, "stored_weight": activity.OVERLAP_WEIGHT,
            "pairs": len(rows), "fit_pairs": len(fit), "held_out_pairs": len(hold),
            "median_measured_over_capped_sum": round(st.median(ratio), 3),
            "fit": errors([(activity.combined_pct((a, b)), m) for _, a, b, m in fit]),
            "held_out": errors([(activity.combined_pct((a, b)), m) for _, a, b, m in hold]),
            "held_out_capped_sum": errors([(min(100.0, a + b), m) for _, a, b, m in hold]),
            "held_out_regimes": regimes}


ANCHORS = (
    ("idle A100-SXM4-40GB, four boards (public nvidia-smi log)", 0.0, 0.0, 53.5, "fit"),
    ("saturating training job at the SXM4 board limit (datasheet)", 92.0, 70.0, 400.0, "fit"),
)


def power_anchors() -> list[dict[str, object]]:
    """Each anchor with the model's power and error."""
    out = []
    for what, s, d, w, role in ANCHORS:
        p = power.power_w(s, power.A100_IDLE_W, power.A100_SXM_MAX_W, dram_pct=d)
        out.append({"figure": what, "smact": s, "drama": d, "measured_w": w,
                    "model_w": round(p, 1), "error_pct": round(100 * (p - w) / w, 1),
                    "role": role})
    return out


def main() -> int:
    """Print the three fits; ``--json`` writes them too."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = {"util_to_smact": util_curve(), "overlap": overlap(), "power": power_anchors(),
           "power_curve_w": {f"{s}": round(power.power_w(s, 55, 400), 1)
                             for s in (0, 10, 20, 40, 60, 80, 92)}}
    u = res["util_to_smact"]
    print("1. GPU utilisation -> SM activity (GPUMemNet A100), points of %:")
    print(f"   fit {u['fit']}  held out {u['held_out']}  (identity: {u['identity_held_out']})")
    for k, v in u["held_out_bins"].items():  # type: ignore[union-attr]
        print(f"   util {k}%: measured SMACT {v['measured']}  model {v['model']}  (n={v['n']})")
    o = res["overlap"]
    print(f"2. combined utilisation of Lucid pairs: weight fitted {o['fitted_weight']}, "
          f"stored {o['stored_weight']}; median measured/capped sum "
          f"{o['median_measured_over_capped_sum']}")
    print(f"   held out: model {o['held_out']}  capped sum {o['held_out_capped_sum']}")
    for k, v in o["held_out_regimes"].items():  # type: ignore[union-attr]
        print(f"   {k}: model {v['model']}  capped sum {v['capped_sum']}")
    print("3. power anchors:")
    for a in res["power"]:
        print(f"   [{a['role']}] {a['figure']}: {a['measured_w']} W, model {a['model_w']} W "
              f"({a['error_pct']:+.1f} %)")
    print(f"   curve (W at SMACT %, DRAM proportional): {res['power_curve_w']}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
