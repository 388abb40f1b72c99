"""Fit and score the co-location interference model on the Lucid measurements.

    python benchmarks/interference_fit.py [DATA_DIR]

DATA_DIR defaults to /work/shared/data/colocation (``lucid_single_jobs.csv``: each
job alone, with its GPU utilisation; ``lucid_colocated_pairs.csv``: 1,388 pairs
sharing a GPU, each job's speed normalised to its speed alone). Every pair gives two
observations (speed1, speed2) whose predictor is the summed solo utilisation S.

Model: rate = min(1, C / S) ** alpha (see slurm_colloc/gpu/sim/interference.py),
fitted by grid search on mean absolute error. Printed: in-sample and 5-fold
cross-validated MAE / median absolute error against naive baselines.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from slurm_colloc.gpu.sim.interference import DEFAULT_MODEL, InterferenceModel

DEFAULT_DATA = Path("/work/shared/data/colocation")
KEYS = ["model", "dataset", "batchsize", "amp"]


def load_pairs(data_dir: Path) -> pd.DataFrame:
    """One row per co-located job: S (summed solo util, %) and y (normalised speed)."""
    single = pd.read_csv(data_dir / "lucid_single_jobs.csv")
    pairs = pd.read_csv(data_dir / "lucid_colocated_pairs.csv", index_col=0)
    util = single[[*KEYS, "gpu_util"]]
    for n in ("1", "2"):
        pairs = pairs.merge(
            util.rename(columns={c: c + n for c in [*KEYS, "gpu_util"]}),
            on=[k + n for k in KEYS],
            how="inner",
        )
    s = pairs.gpu_util1 + pairs.gpu_util2
    return pd.DataFrame(
        {
            "S": np.concatenate([s, s]),
            "y": np.concatenate([pairs.speed1, pairs.speed2]),
            "pair": np.concatenate([pairs.index, pairs.index]),
        }
    )


def _predict(S: np.ndarray, c: np.ndarray | float, a: np.ndarray | float) -> np.ndarray:
    return np.minimum(1.0, c / S) ** a


def _grid_best(
    S: np.ndarray, y: np.ndarray, cs: np.ndarray, al: np.ndarray
) -> tuple[float, float, float]:
    C, A = np.meshgrid(cs, al, indexing="ij")
    mae = np.abs(_predict(S[None, None, :], C[..., None], A[..., None]) - y).mean(axis=-1)
    i = np.unravel_index(np.argmin(mae), mae.shape)
    return float(mae[i]), float(C[i]), float(A[i])


def fit(frame: pd.DataFrame) -> InterferenceModel:
    """Grid search (coarse, then fine around the best) for C and alpha minimising MAE."""
    S, y = frame.S.to_numpy(), frame.y.to_numpy()
    _, c0, a0 = _grid_best(S, y, np.arange(50, 200, 2.0), np.arange(0.05, 3.0, 0.05))
    _, c, a = _grid_best(
        S, y, np.arange(c0 - 3, c0 + 3, 0.25), np.arange(max(0.01, a0 - 0.1), a0 + 0.1, 0.005)
    )
    return InterferenceModel(capacity_pct=round(c, 1), alpha=round(a, 3))


def errors(frame: pd.DataFrame, predict: Callable[[float], float]) -> dict[str, float]:
    """MAE and median absolute error of a predictor of speed from S."""
    pred = np.array([predict(s) for s in frame.S])
    err = np.abs(pred - frame.y.to_numpy())
    return {"mae": float(err.mean()), "median": float(np.median(err))}


def cross_validated(frame: pd.DataFrame, k: int = 5, seed: int = 0) -> dict[str, float]:
    """k-fold CV by pair (both jobs of a pair stay in the same fold)."""
    pairs = frame.pair.unique()
    rng = np.random.default_rng(seed)
    rng.shuffle(pairs)
    errs = []
    for fold in np.array_split(pairs, k):
        test = frame.pair.isin(fold)
        m = fit(frame[~test])
        t = frame[test]
        errs.append(np.abs(_predict(t.S.to_numpy(), m.capacity_pct, m.alpha) - t.y.to_numpy()))
    e = np.concatenate(errs)
    return {"mae": float(e.mean()), "median": float(np.median(e))}


def main() -> int:
    data = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DATA
    frame = load_pairs(data)
    m = fit(frame)
    mean_speed = float(frame.y.mean())
    rows = [
        ("fitted  min(1, C/S)^alpha (in-sample)", errors(frame, lambda s: m.rate([s]))),
        ("fitted  same, 5-fold CV by pair", cross_validated(frame)),
        ("shipped DEFAULT_MODEL", errors(frame, lambda s: DEFAULT_MODEL.rate([s]))),
        ("naive   no slowdown (speed 1)", errors(frame, lambda s: 1.0)),
        (f"naive   constant mean ({mean_speed:.3f})", errors(frame, lambda s: mean_speed)),
        ("naive   time slicing min(1, 100/S)", errors(frame, lambda s: min(1.0, 100.0 / s))),
    ]
    print(f"data: {data} ({len(frame)} job speeds from {frame.pair.nunique()} pairs)")
    print(
        f"fit:  rate = min(1, {m.capacity_pct:g} / S) ** {m.alpha:g}"
        "   (S = summed solo GPU util, %)"
    )
    print(f"shipped: C = {DEFAULT_MODEL.capacity_pct:g}, alpha = {DEFAULT_MODEL.alpha:g}")
    print(f"{'model':45s} {'MAE':>7s} {'median':>7s}")
    for name, e in rows:
        print(f"{name:45s} {e['mae']:7.4f} {e['median']:7.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
