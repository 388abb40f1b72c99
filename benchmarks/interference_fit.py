"""Fit and score the n-tenant interference model on the Lucid pair measurements.

    python benchmarks/interference_fit.py [--data DIR] [--json] [--out FILE]

DIR defaults to /work/shared/data/colocation (``lucid_single_jobs.csv``: each job
alone, with its GPU utilisation; ``lucid_colocated_pairs.csv``: 1,388 pairs sharing
a GPU under MPS, each job's speed normalised to its speed alone). Every pair gives
two observations: the job's own solo utilisation ``u``, its partner's ``O``, and its
measured slowdown ``1 / speed``.

Model (slurm_colloc/gpu/sim/interference.py): slowdown_i = max(1 + a u_i^p O_i^q,
saturation at capacity C). ``a, p, q``: least absolute slowdown error (Nelder-Mead);
``C``: the grid value (1.0-2.0, step 0.05) that minimises the pairs' error with those
``a, p, q`` (weakly identified: the error is flat above it, two tenants rarely
saturate a GPU; a larger ``C`` means less slowdown).

Scores, all on the slowdown factor (time per unit of work / alone), absolute error:

* ``pairs_holdout``: leave-one-model-out. For each model family (ResNet18, VGG, ...)
  the model is re-fitted on the pairs that do not involve it and scored on the pairs
  that do; median and p90 over all held-out predictions.
* ``pairs_in_sample``, and baselines (the previous ``min(1, 96/S)^0.52``, no slowdown)
  scored on the same held-out predictions.
* ``multiway``: slowdown of each of 3 *typical training jobs* (the median solo
  utilisation of Lucid's medium and heavy jobs, label >= 1) and of each of 7 *small
  jobs* (median of Lucid's CIFAR-10 jobs) under one MPS server, against the published
  A100 MPS figures: +50-110 % (1.5-2.1x) and 2-2.5x. These figures are checks: no
  constant is fitted to them.

``--json`` prints ``{"pairs_holdout": {"median_abs_err", "p90_abs_err"},
"multiway": {"3": x, "7": y}, ...}``; ``--out`` also writes it to a file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from slurm_colloc.gpu.sim.interference import (
    DEFAULT_MODEL,
    TIME_SLICED,
    ContentionModel,
)

DEFAULT_DATA = Path("/work/shared/data/colocation")
KEYS = ["model", "dataset", "batchsize", "amp"]
PUBLISHED = {"3": (1.5, 2.1), "7": (2.0, 2.5)}
"""Published MPS slowdowns on an A100: 3 co-located training jobs +50-110 % each,
7 small jobs 2-2.5x (quoted in issue 14)."""
C_GRID = np.round(np.arange(1.0, 2.001, 0.05), 2)


def load_pairs(data_dir: Path) -> pd.DataFrame:
    """One row per co-located job: model, partner, u, O (fractions), y (slowdown)."""
    single = pd.read_csv(data_dir / "lucid_single_jobs.csv")
    pairs = pd.read_csv(data_dir / "lucid_colocated_pairs.csv", index_col=0)
    util = single[[*KEYS, "gpu_util"]]
    for n in ("1", "2"):
        pairs = pairs.merge(
            util.rename(columns={c: c + n for c in [*KEYS, "gpu_util"]}),
            on=[k + n for k in KEYS],
            how="inner",
        )
    rows = []
    for me, other in (("1", "2"), ("2", "1")):
        rows.append(pd.DataFrame({
            "model": pairs["model" + me], "other": pairs["model" + other],
            "u": pairs["gpu_util" + me] / 100.0, "O": pairs["gpu_util" + other] / 100.0,
            "y": 1.0 / pairs["speed" + me], "pair": pairs.index,
        }))
    return pd.concat(rows, ignore_index=True)


def typical_demands(data_dir: Path) -> dict[str, float]:
    """Solo utilisation (%) of a typical training job and a typical small job."""
    single = pd.read_csv(data_dir / "lucid_single_jobs.csv")
    return {
        "training": float(single[single.label >= 1].gpu_util.median()),
        "small": float(single[single.dataset == "CIFAR-10"].gpu_util.median()),
    }


def nelder_mead(fun: Callable[[np.ndarray], float], x0: list[float], iters: int = 600,
                step: float = 0.3) -> np.ndarray:
    """Minimise ``fun`` (numpy only: the lab extra has no scipy)."""
    pts = [np.array(x0, float)]
    for i in range(len(x0)):
        x = np.array(x0, float)
        x[i] += step * (abs(x[i]) or 1.0)
        pts.append(x)
    vals = [fun(x) for x in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        c = np.mean(pts[:-1], axis=0)
        xr = c + (c - pts[-1])
        fr = fun(xr)
        if fr < vals[0]:
            xe = c + 2 * (c - pts[-1])
            fe = fun(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = c + 0.5 * (pts[-1] - c)
            fc = fun(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0] + 0.5 * (x - pts[0]) for x in pts]
                vals = [fun(x) for x in pts]
    return pts[int(np.argmin(vals))]


def _contention(th: np.ndarray, u: np.ndarray, o: np.ndarray) -> np.ndarray:
    return 1.0 + np.exp(th[0]) * u ** th[1] * o ** th[2]


def _pair_stretch(u: np.ndarray, o: np.ndarray, c: float) -> np.ndarray:
    """Vectorised saturation stretch k of two tenants (bisection)."""
    lo, hi = np.ones_like(u), np.full_like(u, 1e3)
    for _ in range(50):
        k = (lo + hi) / 2
        over = u / ((1 - u) + u * k) + o / ((1 - o) + o * k) > c
        lo, hi = np.where(over, k, lo), np.where(over, hi, k)
    return np.where(u + o > c, (lo + hi) / 2, 1.0)


def predict(m: ContentionModel, u: np.ndarray, o: np.ndarray) -> np.ndarray:
    """Slowdown of jobs with solo demand ``u`` next to one partner of demand ``o``."""
    th = np.array([np.log(m.a), m.p, m.q])
    return np.maximum(_contention(th, u, o), (1 - u) + u * _pair_stretch(u, o, m.capacity))


def fit(frame: pd.DataFrame) -> ContentionModel:
    """``a, p, q`` by least absolute slowdown error; then the smallest tolerated ``C``."""
    u, o, y = frame.u.to_numpy(), frame.O.to_numpy(), frame.y.to_numpy()
    th = nelder_mead(lambda t: float(np.mean(np.abs(_contention(t, u, o) - y))),
                     [-0.3, 1.7, 1.6])
    free = float(np.mean(np.abs(_contention(th, u, o) - y)))  # no saturation at all
    a, p, q = round(float(np.exp(th[0])), 4), round(float(th[1]), 3), round(float(th[2]), 3)
    best, best_c = free, float("inf")
    for c in C_GRID:  # ascending: ties go to the smallest capacity (the most slowdown)
        err = float(np.mean(np.abs(predict(ContentionModel(a, p, q, float(c)), u, o) - y)))
        if err < best - 1e-9:
            best, best_c = err, float(c)
    return ContentionModel(a, p, q, best_c if best_c != float("inf") else float(C_GRID[-1]))


def _old_model(u: np.ndarray, o: np.ndarray) -> np.ndarray:
    """The model before issue 14: every tenant ``min(1, 96/S)^0.52`` of solo speed."""
    return 1.0 / np.minimum(1.0, 0.96 / (u + o)) ** 0.52


def _stats(err: np.ndarray) -> dict[str, float]:
    return {"median_abs_err": round(float(np.median(err)), 4),
            "p90_abs_err": round(float(np.quantile(err, 0.9)), 4),
            "mean_abs_err": round(float(np.mean(err)), 4), "n": len(err)}


def leave_one_model_out(frame: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Held-out errors of the model and of the baselines, per-family folds pooled."""
    errs: dict[str, list[np.ndarray]] = {"model": [], "old": [], "none": []}
    per_family = {}
    for fam in sorted(frame.model.unique()):
        test = ((frame.model == fam) | (frame.other == fam)).to_numpy()
        m = fit(frame[~test])
        t = frame[test]
        u, o, y = t.u.to_numpy(), t.O.to_numpy(), t.y.to_numpy()
        e = np.abs(predict(m, u, o) - y)
        errs["model"].append(e)
        errs["old"].append(np.abs(_old_model(u, o) - y))
        errs["none"].append(np.abs(1.0 - y))
        per_family[fam] = round(float(np.median(e)), 4)
    out = {k: _stats(np.concatenate(v)) for k, v in errs.items()}
    out["per_family_median"] = per_family  # type: ignore[assignment]
    return out


def multiway(m: ContentionModel, demands: dict[str, float]) -> dict[str, float]:
    """Slowdown of each of 3 typical training jobs and of each of 7 small jobs."""
    return {"3": round(m.slowdowns([demands["training"]] * 3)[0], 3),
            "7": round(m.slowdowns([demands["small"]] * 7)[0], 3)}


def report(data: Path) -> dict[str, object]:
    """Everything ``--json`` prints."""
    frame = load_pairs(data)
    fitted = fit(frame)
    lomo = leave_one_model_out(frame)
    demands = typical_demands(data)
    u, o, y = frame.u.to_numpy(), frame.O.to_numpy(), frame.y.to_numpy()
    mw = multiway(DEFAULT_MODEL, demands)
    return {
        "pairs_holdout": {"median_abs_err": lomo["model"]["median_abs_err"],
                          "p90_abs_err": lomo["model"]["p90_abs_err"]},
        "multiway": mw,
        "error_unit": "absolute error of the slowdown factor (time per unit of work / alone)",
        "holdout": "leave-one-model-out over model families, re-fitted per fold",
        "pairs_holdout_detail": lomo["model"],
        "pairs_holdout_per_family_median": lomo["per_family_median"],
        "pairs_in_sample": _stats(np.abs(predict(DEFAULT_MODEL, u, o) - y)),
        "baselines_holdout": {"previous min(1,96/S)^0.52": lomo["old"],
                              "no slowdown": lomo["none"]},
        "multiway_published": {k: list(v) for k, v in PUBLISHED.items()},
        "multiway_in_range": {k: PUBLISHED[k][0] <= mw[k] <= PUBLISHED[k][1] for k in mw},
        "multiway_time_sliced": multiway(TIME_SLICED, demands),
        "multiway_demands_pct": demands,
        "shipped": {"a": DEFAULT_MODEL.a, "p": DEFAULT_MODEL.p, "q": DEFAULT_MODEL.q,
                    "capacity": DEFAULT_MODEL.capacity},
        "fitted_now": {"a": fitted.a, "p": fitted.p, "q": fitted.q,
                       "capacity": fitted.capacity},
        "data": str(data), "job_speeds": len(frame), "pairs": int(frame.pair.nunique()),
    }


def main(argv: list[str] | None = None) -> int:
    """Print the scores (text, or ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data_dir", nargs="?", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    a = ap.parse_args(argv)
    r = report(a.data_dir)
    text = json.dumps(r, indent=1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    if a.json:
        sys.stdout.write(text + "\n")
        return 0
    f = r["fitted_now"]
    print(f"data: {r['data']} ({r['job_speeds']} job speeds from {r['pairs']} pairs)")
    print(f"fit: slowdown = max(1 + {f['a']} u^{f['p']} O^{f['q']}, saturation at "  # type: ignore[index]
          f"C = {f['capacity']})   shipped: {r['shipped']}")  # type: ignore[index]
    print(f"{'slowdown abs error':45s} {'median':>7s} {'p90':>7s}")
    rows = [("model, leave-one-model-out", r["pairs_holdout_detail"]),
            ("model, in-sample", r["pairs_in_sample"]),
            *[(f"baseline {k}, same folds", v)
              for k, v in r["baselines_holdout"].items()]]  # type: ignore[attr-defined]
    for name, e in rows:
        print(f"{name:45s} {e['median_abs_err']:7.4f} {e['p90_abs_err']:7.4f}")  # type: ignore[index]
    print(f"multiway (one MPS server): {r['multiway']}  published {r['multiway_published']}"
          f"  in range {r['multiway_in_range']}; time-sliced {r['multiway_time_sliced']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
